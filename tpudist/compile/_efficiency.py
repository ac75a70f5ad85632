"""How well a training run uses its devices: model FLOPs per step, the device's peak, MFU, and
goodput (where the wall time went).

    flops = model_flops(traced.jaxpr, devices)   # one device's matmul and convolution FLOPs per call
    peak, source = device_peak_flops()       # (FLOP/s of one device, where the number comes from) or (None, why)
    mfu = flops * steps / (seconds * peak)   # model FLOPs utilisation over `seconds` of stepping

The peaks are the vendors' dense bfloat16 numbers per JAX device (on TPU v2 and v3 a device is one
of a chip's two TensorCores; from v4 on, one chip). MFU against that peak is the convention of
torchtitan and MaxText whatever the step's dtype, so a float32 step shows a low MFU. A CPU has no
published peak: MFU is then n/a, unless TPUDIST_PEAK_FLOPS gives one (FLOP/s per device; also for
a device this table does not know).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import jax

from tpudist import contract

__all__ = ["device_peak_flops", "model_flops", "xla_flops", "Goodput"]

# dense bfloat16 FLOP/s per JAX device, by `device_kind`
_TPU_PEAKS = {
    "TPU v2": 22.5e12, "TPU v3": 61.5e12,  # per TensorCore (45 and 123 per chip)
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12, "TPU v5e": 197e12,
    "TPU v5": 459e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}
_GPU_PEAKS = (  # by prefix of `device_kind`, the first that matches (SXM parts; PCIe named apart)
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100", 989e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100", 312e12), ("NVIDIA B200", 2250e12),
)


def device_peak_flops(device: Any = None) -> tuple[float | None, str]:
    """(peak dense bfloat16 FLOP/s of one `device`, where that number comes from), or (None, why
    there is none). `device`: JAX's default device when None. TPUDIST_PEAK_FLOPS overrides the table."""
    text = os.environ.get(contract.PEAK_FLOPS)
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{contract.PEAK_FLOPS}={text!r}: give the peak FLOP/s of one device as a positive "
                             "number, e.g. 197e12 (TPU v5e, bfloat16)")
        return value, contract.PEAK_FLOPS
    if device is None:
        device = jax.config.jax_default_device or jax.local_devices()[0]
        if isinstance(device, str):
            device = jax.local_devices(backend=device)[0]
    kind = getattr(device, "device_kind", "")
    peak = _TPU_PEAKS.get(kind) or next((p for prefix, p in _GPU_PEAKS if kind.startswith(prefix)), None)
    if peak is not None:
        return peak, f"{kind}, bfloat16 dense"
    if device.platform == "cpu":
        return None, f"a CPU has no published peak (set {contract.PEAK_FLOPS} to one device's FLOP/s)"
    return None, f"no peak known for device kind {kind!r} (set {contract.PEAK_FLOPS} to one device's FLOP/s)"


def model_flops(jaxpr: Any, devices: int) -> float | None:
    """The matmul and convolution FLOPs one of `devices` runs per call of the program whose traced
    `jaxpr` (a `ClosedJaxpr` or `Jaxpr`) this is: a (m, k) by (k, n) matmul counts 2mkn, a loop
    body counts once per iteration (a `scan` of the layers, the micro-batches), a `shard_map` body
    once per device of its mesh; the sum over the whole mesh, divided by `devices`. None where a
    loop's trip count is not known when tracing (`while_loop`): the count would be wrong.

    Not XLA's cost analysis of the compiled executable: that counts a loop's body once, whatever
    its trip count (a scanned stack of 2 identical layers: 0.51x of its FLOPs)."""
    total = _flops(getattr(jaxpr, "jaxpr", jaxpr))
    return None if total is None else total / max(devices, 1)


def _flops(jaxpr: Any) -> float | None:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "conv_general_dilated":
            total += _conv_flops(eqn)
        elif name == "while":
            return None
        elif name == "cond":
            branches = [_flops(b.jaxpr) for b in eqn.params["branches"]]
            if any(b is None for b in branches):
                return None
            total += max(branches)  # the dearest branch: an upper bound of what runs
        else:
            times = eqn.params["length"] if name == "scan" else (
                eqn.params["mesh"].size if name == "shard_map" else 1)
            for value in eqn.params.values():
                inner = value if hasattr(value, "eqns") else getattr(value, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    flops = _flops(inner)
                    if flops is None:
                        return None
                    total += times * flops
    return total


def _size(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dot_flops(eqn: Any) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    (contract, _), _ = eqn.params["dimension_numbers"]
    # every output element sums over the contracting dims: out = batch x lhs free x rhs free
    return 2.0 * _size(eqn.outvars[0].aval.shape) * _size([lhs[d] for d in contract])


def _conv_flops(eqn: Any) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    out = eqn.outvars[0].aval.shape
    p = eqn.params
    numbers = p["dimension_numbers"]
    # (output element, kernel tap) pairs that meet the input rather than its padding or the holes
    # of an input dilation, dim by dim; times the output's batch and features and the input
    # features of one group. A weight gradient is a convolution whose "kernel" is the output
    # gradient (its groups, batch_group_count, split the batch): the same rule counts it.
    pairs = 1
    for i, (ld, rd, od) in enumerate(zip(numbers.lhs_spec[2:], numbers.rhs_spec[2:], numbers.out_spec[2:])):
        pairs *= _taps(lhs[ld], rhs[rd], out[od], p["window_strides"][i], p["padding"][i][0],
                       p["lhs_dilation"][i], p["rhs_dilation"][i])
    channels = out[numbers.out_spec[0]] * out[numbers.out_spec[1]] * rhs[numbers.rhs_spec[1]]
    return 2.0 * channels * pairs


def _taps(size: int, kernel: int, out: int, stride: int, low: int, lhs_dilation: int, rhs_dilation: int) -> int:
    extent = (size - 1) * lhs_dilation + 1
    count = 0
    for tap in range(kernel):
        for position in range(out):
            at = position * stride + tap * rhs_dilation - low
            count += 0 <= at < extent and at % lhs_dilation == 0
    return count


def xla_flops(executable: Any) -> float | None:
    """XLA's own count for one device per call of `executable` (its cost analysis; see model_flops
    for why that is not the step's count); None where XLA gives none."""
    try:
        analysis = executable.cost_analysis()
    except Exception:  # a backend without cost analysis
        return None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    flops = analysis.get("flops") if isinstance(analysis, dict) else None
    return float(flops) if flops is not None and flops >= 0 else None


@dataclass
class Goodput:
    """Where a run's wall time went. `wall_s` in all; of it, `compile_s` capturing and compiling,
    `checkpoint_s` saving and restoring checkpoints (the part the loop waited for), `data_s` waiting
    for the next batch. The rest is productive: stepping. `goodput` = productive / wall."""

    wall_s: float = 0.0
    compile_s: float = 0.0
    checkpoint_s: float = 0.0
    data_s: float = 0.0

    @property
    def productive_s(self) -> float:
        return max(self.wall_s - self.compile_s - self.checkpoint_s - self.data_s, 0.0)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, other: Goodput) -> None:
        self.wall_s += other.wall_s
        self.compile_s += other.compile_s
        self.checkpoint_s += other.checkpoint_s
        self.data_s += other.data_s

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.checkpoint_s += time.perf_counter() - start

    def waited(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, adding the time each `next` blocks to `data_s`."""
        iterator = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self.data_s += time.perf_counter() - start
            yield batch

    def describe(self) -> str:
        """"goodput 93% (compile 2.1 s, data 0.3 s, checkpoint 0.0 s of 40.2 s)"."""
        return (f"goodput {100 * self.goodput:.0f}% (compile {self.compile_s:.1f} s, data {self.data_s:.1f} s, "
                f"checkpoint {self.checkpoint_s:.1f} s of {self.wall_s:.1f} s)")
