"""Building a `jax.sharding.Mesh` over every device of every process, topology-aware.

Placement follows `jax.experimental.mesh_utils.create_hybrid_device_mesh`: devices are grouped into
*granules* (one process each, or one TPU slice each on a multi-slice job), and each axis is split
into a part inside a granule (fast links: in-process on CPU, ICI on TPU) and a part across granules
(DCN). The innermost axes -- the last ones of the mapping -- get the in-granule devices first, so a
`{"data": -1, "model": 2}` mesh keeps each "model" group inside one process while "data" spans them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("tpudist.mesh")


def resolve_axes(axes: Mapping[str, int], device_count: int) -> dict[str, int]:
    """Checks the axis names and sizes and fills in the one -1 axis, if any.

    Errors show the arithmetic: `data(3) * model(2) != 8 devices`.
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
    product = " * ".join(f"{name}({size})" for name, size in axes.items() if size != -1)
    if free:
        if device_count % fixed:
            raise ValueError(f"{product} = {fixed} does not divide {device_count} devices, so "
                             f"{free[0]}(-1) has no integer size; pick sizes whose product divides "
                             f"{device_count}")
        return {name: (device_count // fixed if size == -1 else int(size)) for name, size in axes.items()}
    if fixed != device_count:
        raise ValueError(f"{product} = {fixed} != {device_count} devices; make the product of the axis "
                         "sizes equal the device count, or give one axis -1")
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


def _granule_key(device: Any, multislice: bool) -> int:
    return int(device.slice_index) if multislice else int(device.process_index)


def place_devices(devices: Sequence[Any], sizes: Sequence[int]) -> np.ndarray:
    """Arranges `devices` into an array of shape `sizes`, innermost axes inside a granule.

    Works on anything with `id` and `process_index` (and `slice_index` on multi-slice TPU jobs).
    """
    assert math.prod(sizes) == len(devices), (sizes, len(devices))
    slices = {getattr(d, "slice_index", None) for d in devices}
    multislice = len(slices) > 1 and None not in slices
    granules: dict[int, list[Any]] = {}
    for d in devices:
        granules.setdefault(_granule_key(d, multislice), []).append(d)
    groups = [sorted(granules[k], key=lambda d: d.id) for k in sorted(granules)]
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
    blocks = np.empty((len(groups),) + tuple(ici), dtype=object)
    for i, group in enumerate(groups):
        blocks[i] = _inside_granule(group, ici)
    # (dcn..., ici...) -> interleave (dcn_0, ici_0, dcn_1, ici_1, ...) -> merge each pair.
    m = len(sizes)
    grid = blocks.reshape(tuple(dcn) + tuple(ici))
    order = [j for i in range(m) for j in (i, m + i)]
    return grid.transpose(order).reshape(sizes)


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


def make_mesh(axes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Any:
    """A `jax.sharding.Mesh` over every device of every process, with named axes.

    `axes` maps axis name -> size, outermost first; one size may be -1 (whatever is left). Axes
    are placed topology-aware: the last axes are filled from the devices inside one process (one
    TPU slice on a multi-slice job) first, so put the axis with the heaviest collectives (model,
    tensor) last and the data axis first. `devices` defaults to `tpudist.devices()` (joining the
    job first if needed). Example::

        mesh = tpudist.mesh.make_mesh({"data": -1, "model": 2})   # 2 procs x 2 devices: 2 x 2
        mesh.shape                                                # {'data': 2, 'model': 2}

    Raises ValueError when the sizes do not multiply to the device count (`data(3) * model(2) = 6
    != 8 devices`), TypeError for names or sizes of the wrong type.
    """
    from jax.sharding import Mesh
    if devices is None:
        from tpudist import _runtime
        devices = _runtime.devices()
    devices = list(devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    sizes = resolve_axes(axes, len(devices))
    array = place_devices(devices, list(sizes.values()))
    return Mesh(array, tuple(sizes))


def describe(mesh: Any) -> str:
    """A one-line summary for logs: `data(2) x model(2) over 4 devices in 2 processes`."""
    shape = " x ".join(f"{name}({size})" for name, size in mesh.shape.items())
    processes = len({d.process_index for d in mesh.devices.flat})
    return f"{shape} over {mesh.devices.size} devices in {processes} process{'es' * (processes != 1)}"
