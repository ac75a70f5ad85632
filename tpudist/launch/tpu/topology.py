"""TPU slice topology: what an accelerator type means in chips, workers and bounds.

`slice_topology("v4-32")` answers, from published tables, the questions the TPU runtime (libtpu,
through JAX or torch_xla) needs answered identically on every worker of a slice: how many chips and
TensorCores there are, how many workers (TPU VMs) they sit on, and the two 3-axis bounds libtpu
reads, `TPU_CHIPS_PER_HOST_BOUNDS` (the chips of one worker) and `TPU_HOST_BOUNDS` (the workers of
the slice), whose per-axis product is the slice's topology.

Facts this table respects (a wrong value means a hang or a wrong mesh on hardware):

- In v2, v3, v4, v5p and 7x types the number counts TensorCores (2 per chip: v4-32 is 16 chips);
  in v5e (`v5litepod-N`) and v6e types it counts chips (1 TensorCore per chip).
- A worker of a multi-worker slice has 4 chips laid out 2x2x1. A single-worker slice holds all of
  its chips: up to 4 (v2, v3, v4, v5p, 7x) or up to 8 (v5e, v6e: v5litepod-8 and v6e-8 are one
  worker with chips-per-host bounds 2,4,1).
- Host bounds are the topology divided, axis by axis, by the chips-per-host bounds
  (v4-32 = 2x2x4 -> 1,1,4; v4-64 = 2x4x4 -> 1,2,4; v3-128 = 8x8 -> 4,4,1; v6e-32 = 4x8 -> 2,4,1).
- A source that reports the topology (gcloud's `acceleratorConfig.topology`, the metadata server's
  `tpu-env`) wins over the default topology listed here, so non-default shapes (v4 and v5p
  "twisted" or elongated slices) work when the slice itself says what it is.

Sources for the tables below:

- Cloud TPU documentation, one page per generation (cloud.google.com/tpu/docs/v2, v3, v4, v5e,
  v5p, v6e, tpu7x) and "System architecture": chips per generation, TensorCores per chip, the
  topology of each accelerator type, hosts per slice.
- torch_xla `torch_xla/_internal/tpu.py` (`_ACCELERATOR_TYPE_TO_HOST_BOUNDS` for v2 and v3, chips
  per process bounds 2,2,1) and its tests `test/pjrt/test_experimental_tpu.py` (v4-16: host bounds
  1,1,2, chips-per-host bounds 2,2,1).
- xpk `src/xpk/core/system_characteristics.py`: the topologies each of v4, v5p, v5e, v6e and tpu7x
  supports, 4 chips per multi-host VM; tpu7x is named `tpu7x-<TensorCores>` there.
- ray `python/ray/_private/accelerators/tpu.py`: v5litepod and v6e hosts hold up to 8 chips with
  1 TensorCore each; v2, v3, v4, v5p hosts hold 4 chips with 2 TensorCores each.

Example::

    >>> t = slice_topology("v4-32")
    >>> t.chips, t.workers, t.chips_per_worker, t.host_bounds, t.topology
    (16, 4, 4, (1, 1, 4), '2x2x4')
    >>> bounds_str(t.chips_per_host_bounds)
    '2,2,1'
"""

from __future__ import annotations

import dataclasses
import math
import re

Bounds = tuple[int, int, int]

# The chips of one worker in a multi-worker slice, on every generation listed here.
MULTI_HOST_CHIP_BOUNDS: Bounds = (2, 2, 1)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation's naming and layout rules."""

    name: str  # as users say it: "v5e"
    prefix: str  # as accelerator types spell it: "v5litepod"
    tensorcores_per_chip: int
    counts_tensorcores: bool  # True: the type's number counts TensorCores; False: chips
    axes: int  # 2 (a 2D torus: v2, v3, v5e, v6e) or 3 (v4, v5p, 7x)
    max_single_worker_chips: int  # slices up to this many chips run on one worker
    default_topologies: tuple[str, ...]  # the documented topology per slice size, one per size

    def type_number(self, chips: int) -> int:
        """The N of `<prefix>-N` for a slice of `chips` chips."""
        return chips * self.tensorcores_per_chip if self.counts_tensorcores else chips


# v5p, in Cloud TPU's (and xpk's) order of size; tpu7x supports these and two more.
_V5P_TOPOLOGIES = """
    2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x4x12 4x8x8 4x4x20 4x8x12 4x4x28 8x8x8 4x12x12 4x8x20
    4x4x44 8x8x12 4x4x52 4x8x28 4x12x20 8x8x16 4x4x68 8x12x12 4x4x76 8x8x20 4x12x28 4x8x44
    4x4x92 8x12x16 4x20x20 4x8x52 12x12x12 8x8x28 4x4x116 8x12x20 4x4x124 8x16x16 4x12x44
    4x8x68 4x20x28 12x12x16 4x4x148 4x8x76 4x12x52 8x16x20 4x4x164 8x12x28 4x4x172 8x8x44
    12x12x20 4x8x92 4x4x188 12x16x16 4x28x28 8x20x20 4x12x68 8x8x52 4x4x212 12x12x24 4x20x44
    8x16x28 4x12x76 4x8x116 4x4x236 12x16x20 4x4x244 4x8x124 12x12x28 16x16x16 4x20x52 8x12x44
    8x8x68 4x12x92 8x20x28 12x16x24 4x8x148 12x20x20 8x8x76 4x28x44 8x12x52 16x16x20 12x12x36
    4x8x164 12x16x28 4x20x68 4x8x172 4x12x116 8x16x44 12x20x24 4x28x52 8x8x92 4x12x124 4x8x188
    4x20x76 16x16x24 12x24x24 16x20x28
""".split()
_2D_TOPOLOGIES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

GENERATIONS: tuple[Generation, ...] = (
    Generation("v2", "v2", 2, True, 2, 4, ("2x2", "4x4", "8x8", "8x16", "16x16")),
    Generation("v3", "v3", 2, True, 2, 4,
               ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32")),
    Generation("v4", "v4", 2, True, 3, 4,
               ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12",
                "8x8x16", "8x16x16")),
    Generation("v5e", "v5litepod", 1, False, 2, 8, _2D_TOPOLOGIES),
    Generation("v5p", "v5p", 2, True, 3, 4, tuple(_V5P_TOPOLOGIES)),
    Generation("v6e", "v6e", 1, False, 2, 8, _2D_TOPOLOGIES),
    Generation("7x", "tpu7x", 2, True, 3, 4,
               ("1x1x1", *_V5P_TOPOLOGIES, "16x16x32", "16x24x24")),
)
_BY_PREFIX = {g.prefix: g for g in GENERATIONS}
# Names users type that are not accelerator types, and the spelling they meant.
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "7x": "tpu7x", "v7x": "tpu7x",
            "ironwood": "tpu7x", "trillium": "v6e"}


@dataclasses.dataclass(frozen=True)
class SliceTopology:
    """Everything the TPU runtime needs to agree on about one slice."""

    accelerator_type: str  # "v4-32"
    generation: str  # "v4"
    chips: int
    tensorcores_per_chip: int
    workers: int  # TPU VMs in the slice
    chips_per_worker: int
    chips_per_host_bounds: Bounds  # TPU_CHIPS_PER_HOST_BOUNDS
    host_bounds: Bounds  # TPU_HOST_BOUNDS
    topology: str  # "2x2x4": chips along each axis

    @property
    def tensorcores(self) -> int:
        return self.chips * self.tensorcores_per_chip


def bounds_str(bounds: Bounds) -> str:
    """`(2, 2, 1)` -> `"2,2,1"`, the spelling libtpu's *_BOUNDS variables use."""
    return ",".join(str(b) for b in bounds)


def parse_bounds(text: str, what: str = "bounds") -> Bounds:
    """`"2,2,1"` -> `(2, 2, 1)`. Raises ValueError naming `what` on anything else."""
    parts = text.strip().split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{what}={text!r} must be three positive integers like '2,2,1'")
    return int(parts[0]), int(parts[1]), int(parts[2])


def valid_forms() -> str:
    """One line per generation: the accelerator types this module knows."""
    lines = []
    for g in GENERATIONS:
        sizes = [g.type_number(_product(_axes(t))) for t in g.default_topologies]
        head = sizes if len(sizes) <= 9 else [*sizes[:7], "...", sizes[-1]]
        shown = ", ".join(str(n) for n in head)
        unit = "TensorCores" if g.counts_tensorcores else "chips"
        lines.append(f"  {g.prefix}-N ({g.name}, N counts {unit}): N in {shown}")
    return "\n".join(lines)


def parse_accelerator_type(accelerator_type: str) -> tuple[Generation, int]:
    """`"v4-32"` -> (the v4 Generation, 32). Raises ValueError listing the valid forms."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type.strip().lower())
    generation = _BY_PREFIX.get(match.group(1)) if match else None
    if match is None or generation is None:
        hint = ""
        if match and match.group(1) in _ALIASES:
            hint = f" (spell it {_ALIASES[match.group(1)]}-{match.group(2)})"
        raise ValueError(f"unknown TPU accelerator type {accelerator_type!r}{hint}; "
                         f"valid forms:\n{valid_forms()}")
    return generation, int(match.group(2))


def slice_topology(accelerator_type: str, topology: str | None = None) -> SliceTopology:
    """The slice an accelerator type names, with `topology` (e.g. "2x2x4") overriding the default.

    Raises ValueError when the type is unknown, when its size has no documented topology and none
    is given, or when the topology cannot be that type (wrong chip count, wrong number of axes, or
    axes that do not split into whole workers).
    """
    generation, number = parse_accelerator_type(accelerator_type)
    canonical = f"{generation.prefix}-{number}"
    if topology is None:
        by_number = {generation.type_number(_product(_axes(t))): t
                     for t in generation.default_topologies}
        if number not in by_number:
            raise ValueError(
                f"TPU accelerator type {accelerator_type!r} has no documented default topology. A "
                "slice of another shape must report its topology (gcloud's "
                "acceleratorConfig.topology, or TOPOLOGY in the TPU VM's tpu-env metadata).\n"
                "Valid forms:\n"
                f"{valid_forms()}")
        topology = by_number[number]
    axes = _axes(topology)
    if len(axes) != generation.axes:
        raise ValueError(f"topology {topology!r} of {canonical} must have {generation.axes} axes "
                         f"(like {generation.default_topologies[-1]!r})")
    chips = _product(axes)
    if generation.type_number(chips) != number:
        unit = "TensorCores" if generation.counts_tensorcores else "chips"
        raise ValueError(
            f"topology {topology!r} has {chips} chips = {generation.type_number(chips)} {unit}, "
            f"but {canonical} has {number} {unit}")
    axes3 = (axes + (1,))[:3] if len(axes) == 2 else axes
    assert len(axes3) == 3, axes3
    if chips <= generation.max_single_worker_chips:
        chip_bounds: Bounds = (axes3[0], axes3[1], axes3[2])
    else:
        chip_bounds = MULTI_HOST_CHIP_BOUNDS
    if any(a % c for a, c in zip(axes3, chip_bounds)):
        raise ValueError(f"topology {topology!r} of {canonical} does not split into workers of "
                         f"{bounds_str(chip_bounds)} chips along each axis")
    host_bounds: Bounds = (axes3[0] // chip_bounds[0], axes3[1] // chip_bounds[1],
                           axes3[2] // chip_bounds[2])
    return SliceTopology(
        accelerator_type=canonical, generation=generation.name, chips=chips,
        tensorcores_per_chip=generation.tensorcores_per_chip, workers=_product(host_bounds),
        chips_per_worker=_product(chip_bounds), chips_per_host_bounds=chip_bounds,
        host_bounds=host_bounds, topology="x".join(str(a) for a in axes))


def from_bounds(accelerator_type: str, chips_per_host_bounds: str, host_bounds: str,
                topology: str | None = None) -> SliceTopology:
    """A slice described by the bounds a TPU VM's metadata (`tpu-env`) reports.

    Used when the metadata server gives `CHIPS_PER_HOST_BOUNDS` and `HOST_BOUNDS`: they win over
    the table, so a type this module does not know still launches. TensorCores per chip come from
    the table when the generation is known, else 1.
    """
    chip_bounds = parse_bounds(chips_per_host_bounds, "CHIPS_PER_HOST_BOUNDS")
    hosts = parse_bounds(host_bounds, "HOST_BOUNDS")
    try:
        generation: Generation | None = parse_accelerator_type(accelerator_type)[0]
    except ValueError:
        generation = None
    chips = _product(chip_bounds) * _product(hosts)
    if topology is None:
        axes = [c * h for c, h in zip(chip_bounds, hosts)]
        if generation is not None and generation.axes == 2 and axes[2] == 1:
            axes = axes[:2]
        topology = "x".join(str(a) for a in axes)
    return SliceTopology(
        accelerator_type=accelerator_type, generation=generation.name if generation else "unknown",
        chips=chips, tensorcores_per_chip=generation.tensorcores_per_chip if generation else 1,
        workers=_product(hosts), chips_per_worker=_product(chip_bounds),
        chips_per_host_bounds=chip_bounds, host_bounds=hosts, topology=topology)


def _axes(topology: str) -> tuple[int, ...]:
    parts = topology.strip().lower().split("x")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"topology {topology!r} must look like '2x4' or '2x2x4'")
    return tuple(int(p) for p in parts)


def _product(values: tuple[int, ...] | list[int]) -> int:
    return math.prod(values)
