"""Where the host time of a compiled torch step goes: cProfile of `tpudist.compile`d
forward+backward and of the fused train step for one reference model, after warm-up.

    python scripts/profile_torch_step.py --model mlp --batch 64 [--device cuda] [--top 25]

Prints, for each side, the mean wall time per step and the functions with the most cumulative
time. Use it next to scripts/bench_torch.py when a compiled step is slower than eager: for small
models the per-call host work (argument crossing, dispatch) is what separates the two.
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tpudist  # noqa: E402
from torch_models import REFERENCES, WithLoss  # noqa: E402


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
    fused = tpudist.compile_train_step(fused_model, ref.loss,
                                       torch.optim.SGD(fused_model.parameters(), lr=0.01, momentum=0.9))

    def compiled_step() -> None:
        for p in params:
            p.grad = None
        compiled(*inputs, target).backward()

    def fused_step() -> None:
        fused((*inputs, target))

    for name, step in (("compiled forward+backward", compiled_step), ("fused train step", fused_step)):
        for _ in range(3):
            step()
        sync()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for _ in range(args.steps):
            step()
        sync()
        profile.disable()
        elapsed = (time.perf_counter() - start) / args.steps
        print(f"== {name}: {args.model} batch {args.batch} on {args.device}: {elapsed * 1e3:.3f} ms per step "
              f"(under cProfile)")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
