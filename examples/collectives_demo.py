"""A tour of tpudist's eager collectives, run by the launcher on every process of a job:

    python -m tpudist.xla_dist --local --nproc-per-host 4 --cpu-devices 2 -- python examples/collectives_demo.py

Run on its own it is a one-process job.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import tpudist


def tour() -> list[str]:
    import jax
    rank, n = tpudist.process_index(), tpudist.process_count()
    lines = [f"rank {rank}/{n}: {len(jax.local_devices())} local devices, {len(jax.devices())} in the job"]
    grad = torch.full((3,), float(rank + 1))
    lines.append(f"all_reduce(mean) of torch {grad.tolist()} -> {tpudist.all_reduce(grad, op='mean').tolist()}")
    pairs = [[r, r + 1] for r in range(0, n, 2)]
    lines.append(f"all_reduce(sum, groups={pairs}) of {rank} -> {tpudist.all_reduce(rank, groups=pairs)}")
    lines.append(f"all_gather of numpy [{rank}] -> {tpudist.all_gather(np.array([rank])).tolist()}")
    x = np.arange(2 * n, dtype=np.float32)
    lines.append(f"reduce_scatter(sum) of arange({2 * n}) -> {tpudist.reduce_scatter(x).tolist()}")
    lines.append(f"broadcast(src={n - 1}) of {rank * 10} -> {tpudist.broadcast(rank * 10, src=n - 1)}")
    ring = [[r, (r + 1) % n] for r in range(n)]
    lines.append(f"collective_permute(ring) of {rank} -> {int(tpudist.collective_permute(np.int32(rank), ring))}")
    grads = [torch.ones(4) * rank, torch.ones(2, 2) * rank]
    start = time.perf_counter()
    for _ in range(20):
        out = tpudist.all_reduce(grads)
    lines.append(f"20 coalesced all_reduce of 2 tensors: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms each, "
                 f"first -> {out[0].tolist()}")
    tpudist.barrier()
    return lines


def main() -> None:
    start = time.perf_counter()
    tpudist.init()
    lines = tour()
    print("\n  ".join(lines), flush=True)
    if tpudist.process_index() == 0:
        print(f"{tpudist.process_count()} processes x {len(tpudist.local_devices())} devices: "
              f"done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
