"""Where the host time of a compiled torch step goes: cProfile of `tpudist.compile`d
forward+backward and of the fused train step for one reference model, after warm-up.

    python scripts/profile_torch_step.py --model mlp --batch 64 [--device cuda] [--top 25]

Prints, for each side, the mean wall time per step and the functions with the most cumulative
time. Use it next to scripts/bench_torch.py when a compiled step is slower than eager: for small
models the per-call host work (argument crossing, dispatch) is what separates the two.
"""

from __future__ import annotations

import argparse
import copy
import pstats
import sys
from cProfile import Profile

import torch

import _bench
import tpudist
from _torch_steps import REFERENCES, WithLoss, ready, sgd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=sorted(REFERENCES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)

    ref = REFERENCES[args.model]
    torch.manual_seed(0)
    model = ref.build("bench").to(args.device)
    inputs, target = ref.batch("bench", args.batch, torch.Generator().manual_seed(0))
    inputs, target = tuple(x.to(args.device) for x in inputs), target.to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    compiled = tpudist.compile(WithLoss(model, ref.loss))
    params = list(model.parameters())
    fused_model = copy.deepcopy(model)
    fused = tpudist.compile_train_step(fused_model, ref.loss, sgd(fused_model.parameters()))

    def compiled_step() -> None:
        for p in params:
            p.grad = None
        compiled(*inputs, target).backward()

    compiled_profile, fused_profile = Profile(), Profile()
    sides = {"compiled forward+backward": _bench.Side(compiled_step, around=lambda: compiled_profile),
             "fused train step": _bench.Side(lambda: fused((*inputs, target)), wait=ready,
                                             around=lambda: fused_profile)}
    profiles = dict(zip(sides, (compiled_profile, fused_profile)))
    # One run each, under cProfile (enabled only while its side's run is timed).
    times = _bench.interleave(sides, rounds=1, steps=args.steps, warmup=3, sync=sync)
    rows = [{"side": side, "ms": t.median * 1e3} for side, t in times.items()]
    print(_bench.table(rows, [("side", "side", "s"), ("ms per step (under cProfile)", "ms", ".3f")],
                       f"{args.model} batch {args.batch} on {args.device}"))
    for side, profile in profiles.items():
        print(f"== {side}")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
