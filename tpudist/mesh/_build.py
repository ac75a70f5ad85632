"""Building a `jax.sharding.Mesh` over every device of every process, topology-aware.

Placement follows `jax.experimental.mesh_utils.create_hybrid_device_mesh`: devices are grouped into
*granules* (one process each, or one TPU slice each on a multi-slice job), and each axis is split
into a part inside a granule (fast links: in-process on CPU, ICI on TPU) and a part across granules
(DCN). The innermost axes -- the last ones of the mapping -- get the in-granule devices first, so a
`{"data": -1, "model": 2}` mesh keeps each "model" group inside one process while "data" spans them.

With `dcn=` the split is the caller's, as in `create_hybrid_device_mesh(mesh_shape, dcn_mesh_shape)`:
`axes` is the shape inside one slice (ICI), `dcn` how many slices each axis spans; each axis is
(its DCN part, outer) x (its ICI part, inner). Slices are TPU slices, or emulated ones on a CPU mesh
(`MEGASCALE_NUM_SLICES`, see `tpudist.contract`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tpudist import _runtime, contract

log = logging.getLogger("tpudist.mesh")


def resolve_axes(axes: Mapping[str, int], count: int, unit: str = "devices",
                 label: str = "") -> dict[str, int]:
    """Checks the axis names and sizes and fills in the one -1 axis, if any, so that the sizes
    multiply to `count` (of `unit`: "devices", "devices per slice", "slices").

    Errors show the arithmetic, after `label`: `data(3) * model(2) = 6 != 8 devices`.
    """
    if not isinstance(axes, Mapping) or not axes:
        raise TypeError(f"axes must be a non-empty mapping of axis name -> size such as "
                        f"{{'data': -1, 'model': 2}}, got {axes!r}")
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"mesh axis names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"mesh axis {name!r} has size {size!r}; sizes are integers (-1 for the rest)")
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis {name!r} has size {size}; sizes are positive, or -1 for the rest")
    free = [name for name, size in axes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {free} in {dict(axes)}")
    fixed = math.prod(int(s) for s in axes.values() if s != -1)
    product = label + " * ".join(f"{name}({size})" for name, size in axes.items() if size != -1)
    if free:
        if count % fixed:
            raise ValueError(f"{product} = {fixed} does not divide {count} {unit}, so "
                             f"{free[0]}(-1) has no integer size; pick sizes whose product divides "
                             f"{count}")
        return {name: (count // fixed if size == -1 else int(size)) for name, size in axes.items()}
    if fixed != count:
        raise ValueError(f"{product} = {fixed} != {count} {unit}; make the product of the axis "
                         f"sizes equal {count}, or give one axis -1")
    return {name: int(size) for name, size in axes.items()}


def split_axes(sizes: Sequence[int], per_granule: int) -> tuple[list[int], list[int]] | None:
    """Splits each axis size into (inside one granule) x (across granules), innermost axes first.

    Returns `(ici_shape, dcn_shape)` with `ici[i] * dcn[i] == sizes[i]`, `prod(ici) == per_granule`,
    or None when the axes cannot be cut that way (an axis would straddle a granule unevenly).
    """
    ici = [1] * len(sizes)
    left = per_granule
    for i in reversed(range(len(sizes))):
        ici[i] = math.gcd(sizes[i], left)
        left //= ici[i]
    if left != 1:
        return None
    return ici, [s // c for s, c in zip(sizes, ici)]


def place_devices(devices: Sequence[Any], sizes: Sequence[int],
                  slices: Sequence[int] | None = None) -> np.ndarray:
    """Arranges `devices` into an array of shape `sizes`, innermost axes inside a granule.

    Granules are slices when `slices` (each device's slice) names more than one, else processes.
    Works on anything with `id` and `process_index`.
    """
    assert math.prod(sizes) == len(devices), (sizes, len(devices))
    multislice = slices is not None and len(set(slices)) > 1
    keys = list(slices) if multislice else [int(d.process_index) for d in devices]
    groups = _grouped(devices, keys)
    per_granule = len(groups[0])
    split = split_axes(list(sizes), per_granule) if all(len(g) == per_granule for g in groups) else None
    if split is None:
        # Uneven processes, or an axis that cannot be cut at a process boundary: keep the devices
        # granule-major so that the outer axes at least span processes.
        log.info("mesh %s does not split evenly over %d granules of %s devices; using granule-major "
                 "device order", list(sizes), len(groups), [len(g) for g in groups])
        flat = [d for g in groups for d in g]
        return _object_array(flat, sizes)
    ici, dcn = split
    inside = _inside_slice if multislice else _inside_granule
    return _interleave([inside(group, ici) for group in groups], dcn, ici)


def place_hybrid(devices: Sequence[Any], slices: Sequence[int], axes: Mapping[str, int],
                 dcn: Mapping[str, int]) -> tuple[dict[str, int], np.ndarray]:
    """`axes` inside each slice (ICI) times `dcn` across slices: the mesh's sizes and devices.

    Each axis's DCN part is its outer part, as in `mesh_utils.create_hybrid_device_mesh`.
    """
    groups = _grouped(devices, slices)
    counts = [len(g) for g in groups]
    if len(set(counts)) > 1:
        raise ValueError(f"the slices have unequal device counts "
                         f"({', '.join(f'slice {s}: {n}' for s, n in zip(sorted(set(slices)), counts))}); "
                         "a mesh with dcn= needs the same devices in every slice")
    ici = resolve_axes(axes, counts[0], unit="devices per slice", label="ici ")
    if not isinstance(dcn, Mapping):
        raise TypeError(f"dcn must be a mapping of axis name -> number of slices such as "
                        f"{{'data': 2}}, got {dcn!r}")
    unknown = [name for name in dcn if name not in ici]
    if unknown:
        raise ValueError(f"dcn names {unknown}, not axes of the mesh {list(ici)}; every dcn axis is a "
                         "mesh axis (give one that lives only across slices size 1 in axes)")
    across = resolve_axes({name: dcn.get(name, 1) for name in ici}, len(groups),
                          unit=f"slices ({_slice_source(devices, len(groups))})", label="dcn ")
    inside = list(ici.values())
    blocks = [_inside_slice(group, inside) for group in groups]
    sizes = {name: ici[name] * across[name] for name in ici}
    return sizes, _interleave(blocks, list(across.values()), inside)


def _slice_source(devices: Sequence[Any], count: int) -> str:
    if _runtime.reported_slices(devices) > 1:
        return "from the devices' slice_index"
    return f"{contract.NUM_SLICES}={count}" if count > 1 else f"{contract.NUM_SLICES} unset"


def _grouped(devices: Sequence[Any], keys: Sequence[int]) -> list[list[Any]]:
    """Devices grouped by key, groups in key order, each group in device-id order."""
    groups: dict[int, list[Any]] = {}
    for d, k in zip(devices, keys):
        groups.setdefault(k, []).append(d)
    return [sorted(groups[k], key=lambda d: d.id) for k in sorted(groups)]


def _interleave(blocks: Sequence[np.ndarray], dcn: Sequence[int], ici: Sequence[int]) -> np.ndarray:
    """One block of shape `ici` per granule, granules in `dcn` order -> axis i = (dcn_i, ici_i)."""
    m = len(ici)
    grid = np.empty((len(blocks),) + tuple(ici), dtype=object)
    for i, block in enumerate(blocks):
        grid[i] = block
    # (dcn..., ici...) -> interleave (dcn_0, ici_0, dcn_1, ici_1, ...) -> merge each pair.
    grid = grid.reshape(tuple(dcn) + tuple(ici))
    order = [j for i in range(m) for j in (i, m + i)]
    return grid.transpose(order).reshape([c * d for c, d in zip(ici, dcn)])


def _inside_slice(devices: list[Any], shape: list[int]) -> np.ndarray:
    """One slice's devices in `shape`: on TPU in physical ICI order, else inner axes in a process."""
    if getattr(devices[0], "platform", None) == "tpu":
        return _inside_granule(devices, shape)
    return place_devices(devices, shape)


def _inside_granule(devices: list[Any], shape: list[int]) -> np.ndarray:
    """One granule's devices in `shape`; on TPU in the physical ICI order mesh_utils computes."""
    if getattr(devices[0], "platform", None) == "tpu":
        try:
            from jax.experimental import mesh_utils
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError) as e:
            log.info("no ICI-aware order for %s over %d TPU devices (%s); using device id order",
                     shape, len(devices), e)
    return _object_array(devices, shape)


def _object_array(items: Sequence[Any], shape: Sequence[int]) -> np.ndarray:
    # np.array() would unpack devices that happen to be sequences; fill element by element.
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out.reshape(tuple(shape))


def make_mesh(axes: Mapping[str, int], devices: Sequence[Any] | None = None, *,
              dcn: Mapping[str, int] | None = None) -> Any:
    """A `jax.sharding.Mesh` over every device of every process, with named axes.

    `axes` maps axis name -> size, outermost first; one size may be -1 (whatever is left). Axes
    are placed topology-aware: the last axes are filled from the devices inside one process (one
    slice on a multi-slice job) first, so put the axis with the heaviest collectives (model,
    tensor) last and the data axis first. `devices` defaults to `tpudist.devices()` (joining the
    job first if needed). Example::

        mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})   # 2 procs x 2 devices: 2 x 2
        mesh.shape                                                # {'data': 2, 'model': 2}

    On a job of several slices (TPU slices over DCN, or `MEGASCALE_NUM_SLICES` on a CPU mesh),
    `dcn` says how many slices each axis spans, and `axes` is then the shape inside one slice, as
    in `mesh_utils.create_hybrid_device_mesh`: an axis's size is its ICI size times its DCN size,
    the DCN part outermost. On 2 slices of 8 devices::

        mesh = make_mesh({"data": -1, "model": 4}, dcn={"data": 2})   # data(4) x model(4)

    Raises ValueError when the sizes do not multiply to the device count (`data(3) * model(2) = 6
    != 8 devices`; with `dcn`, `ici data(2) * model(4) = 8 != 4 devices per slice` or `dcn data(2) *
    model(1) = 2 != 1 slices`), TypeError for names or sizes of the wrong type.
    """
    from jax.sharding import Mesh
    if devices is None:
        devices = _runtime.devices()
    devices = list(devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    slices = _runtime.device_slices(devices)
    if dcn is None:
        sizes = resolve_axes(axes, len(devices))
        array = place_devices(devices, list(sizes.values()), slices)
    else:
        sizes, array = place_hybrid(devices, slices, axes, dcn)
    return Mesh(array, tuple(sizes))


def describe(mesh: Any) -> str:
    """A one-line summary for logs: `data(2) x model(2) over 4 devices in 2 processes`
    (`..., 2 slices` on a multi-slice job)."""
    shape = " x ".join(f"{name}({size})" for name, size in mesh.shape.items())
    processes = len({d.process_index for d in mesh.devices.flat})
    slices = len(set(_runtime.device_slices(mesh.devices.flat)))
    more = f", {slices} slices" if slices > 1 else ""
    return f"{shape} over {mesh.devices.size} devices in {processes} process{'es' * (processes != 1)}{more}"
