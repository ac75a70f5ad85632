"""Benchmark: torch training steps through tpudist's torch -> XLA bridge, side by side in one run
with what they replace: eager torch, torch DDP, and the same models written by hand in JAX.

    python scripts/bench_torch.py single                 # reference models, batch 64 and 256, vs eager torch
    python scripts/bench_torch.py single --device cuda   # the same on a GPU (XLA:GPU vs eager CUDA torch)
    python scripts/bench_torch.py dp                     # the fused data-parallel step vs torch DDP, 2 processes
    python scripts/bench_torch.py vs-jax                 # vs the same models by hand in JAX
    python scripts/bench_torch.py vs-jax --models transformer --cpu-sync-dispatch --torch-threads 1
    python scripts/bench_torch.py hf                     # transformers' ResNet-18 and BERT-tiny, vs eager torch

- single: each model of examples/torch_models.py at each batch: forward+backward, eager vs
  `tpudist.compile(model)`, and a whole SGD-momentum step, eager vs `tpudist.compile_train_step`
  (scripts/_torch_steps.py).
- hf: the same two comparisons for models as users bring them, from `transformers` configs (random
  weights), each trained on its own loss: ResNet-18 (batch 4 x 3 x 64 x 64), BERT-tiny (2 layers,
  hidden 128, sequence 128).
- dp: the fused step (in-graph gradient all-reduce) vs torch DDP over gloo in `--processes`
  processes (tpudist.spawn), each on its share of the global batch; CPU only.
- vs-jax: the engine's floor and torch's own share (scripts/_torch_vs_jax.py).

`--device cuda` (single, hf): eager torch on CUDA tensors vs the bridge with XLA on JAX's GPU
backend (tensors cross through DLPack, zero-copy); both sides synchronize the device at the end of
each timed run; TF32 matmuls on both (XLA's default on GPU; `--no-tf32`: full float32 on both).

Each side runs warm-up steps (compiled sides compile in the first), then `--repeats` timed runs of
`--steps` steps, the sides interleaved run by run; each time is the median over the runs
(scripts/_bench.py). Prints the tables, writes the JSON (bench-results/torch_<mode>.json by default,
rewritten after every row) and a PNG beside it (scripts/_plots.py).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

import torch

import _bench
import _torch_steps as steps

MODES = {"single": "compiled and fused steps vs eager torch, the reference models",
         "dp": "the fused data-parallel step vs torch DDP (gloo)",
         "vs-jax": "vs the same models written by hand in JAX, and torch's own share",
         "hf": "compiled and fused steps vs eager torch, transformers models"}
VS_JAX_MODELS = ("mlp_small", "mlp_wide", "transformer", "resnet18")  # scripts/_jax_reference.py's
# The spelling before the subcommands, and what replaced it.
_OLD_FLAGS = {"--vs-jax": "vs-jax [--models ...]", "--hf": "hf [--models ...]", "--skip-single": "dp",
              "--skip-dp": "single", "--hf-batches": "hf --batches ...", "--dp-processes": "dp --processes N",
              "--dp-torch-threads": "dp --process-threads N"}


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--steps", type=int, default=3, help="steps per timed run")
    common.add_argument("--repeats", type=int, default=10, help="timed runs per side; the median is kept")
    common.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first")
    common.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's own "
                        "choice; with other processes on the cores, fewer threads can be faster)")
    common.add_argument("--cpu-sync-dispatch", action="store_true",
                        help="XLA:CPU runs every executable on the calling thread "
                        "(jax_cpu_enable_async_dispatch=False, process-wide, so on every side): no hand-off to "
                        "XLA's threads per call, and no host running ahead of the device (docs/torch_training.md, 'Performance')")
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", default="cpu", help="torch device: cpu, or cuda (XLA then runs on JAX's "
                        "GPU backend)")
    device.add_argument("--no-tf32", action="store_true", help="with --device cuda: full float32 matmuls on "
                        "both sides (default: TF32 on both, XLA's own default on GPU)")
    device.add_argument("--keep-going", action="store_true",
                        help="record a model that fails as an error row and go on with the next")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    modes = parser.add_subparsers(dest="mode", required=True, metavar="{single,dp,vs-jax,hf}")
    refs = sorted(steps.REFERENCES)
    for mode, parents, models, batches in (("single", [common, device], refs, [64, 256]),
                                           ("dp", [common], refs, [64, 256]),
                                           ("vs-jax", [common], list(VS_JAX_MODELS), None),
                                           ("hf", [common, device], list(steps.HF_MODELS), [4])):
        sub = modes.add_parser(mode, parents=parents, help=MODES[mode], description=MODES[mode])
        sub.add_argument("--models", nargs="+", default=models, choices=models)
        if batches:
            sub.add_argument("--batches", nargs="+", type=int, default=batches)
        _bench.add_output_args(sub, "torch_" + mode.replace("-", "_"))
    dp = modes.choices["dp"]
    dp.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4],
                    help="process counts of the data-parallel comparison, each at the same global batches")
    dp.add_argument("--process-threads", type=int,
                    help="torch threads per process (default: the cores over the processes, at least 1; one "
                    "process gets them all, as XLA's step does)")
    return parser


def _configure(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Process-wide settings, before any side runs: JAX's CPU dispatch, torch's threads, TF32."""
    import jax
    if args.cpu_sync_dispatch:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():  # the setting is read once, when the CPU client is made
            parser.error("--cpu-sync-dispatch: JAX's backends are already initialized in this process")
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if getattr(args, "device", "cpu").startswith("cuda"):
        tf32 = not args.no_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    old = [flag for flag in _OLD_FLAGS if flag in argv]
    if old and not set(argv) & set(MODES):
        parser.error(f"{old[0]} is gone: the modes are subcommands now; write `bench_torch.py {_OLD_FLAGS[old[0]]}`")
    args = parser.parse_args(argv)
    _configure(args, parser)
    import jax
    device = getattr(args, "device", "cpu")
    cuda = device.startswith("cuda")
    out = _bench.Output.from_args(args)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    key = {"single": "rows", "hf": "rows", "dp": "fused_data_parallel", "vs-jax": "vs_jax"}[args.mode]

    def report(announce: bool = False) -> None:
        out.write({
            "benchmark": f"torch training step ({args.mode}): tpudist.compile / compile_train_step (XLA) vs "
                         "eager torch, DDP and JAX",
            "machine": {"torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()],
                        "torch_device": torch.cuda.get_device_name() if cuda else "cpu"},
            "settings": {"mode": args.mode, "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
                         "device": device, "tf32": cuda and not args.no_tf32,
                         "cpu_async_dispatch": not args.cpu_sync_dispatch},
            "rows": [], "errors": errors, "vs_jax": [], "fused_data_parallel": [], key: rows}, announce=announce)

    if args.mode == "dp":
        rows.extend(steps.bench_data_parallel(args))
        text, draw = _bench.table(rows, steps.DP_COLUMNS, steps.DP_TITLE), steps.draw_dp
    elif args.mode == "vs-jax":
        import _torch_vs_jax as vs_jax
        for name in args.models:
            rows.append(vs_jax.bench_vs_jax(name, args))
            report()
            print(f"  {name}: fused/jax {rows[-1]['fused_over_jax']:.2f}x, compiled/jax "
                  f"{rows[-1]['compiled_over_jax']:.2f}x", file=sys.stderr, flush=True)
        text, draw = vs_jax.tables(rows), vs_jax.draw
    else:
        bench = steps.bench_model if args.mode == "single" else steps.bench_hf
        for name in args.models:
            for batch in args.batches:
                try:
                    rows.append(bench(name, batch, args))
                except Exception as error:
                    if not args.keep_going:
                        raise
                    errors.append({"model": name, "batch": batch, "error": traceback.format_exc()})
                    print(f"  {name} batch {batch}: FAILED {type(error).__name__}: {error}", file=sys.stderr,
                          flush=True)
                    continue
                finally:
                    report()
                r = rows[-1]
                print(f"  {name} batch {batch}: eager {r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms, "
                      f"eager train step {r['eager_train_ms']:.2f} ms, fused {r['fused_train_ms']:.2f} ms",
                      file=sys.stderr, flush=True)
        text, draw = _bench.table(rows, steps.STEP_COLUMNS, steps.STEP_TITLE), steps.draw_steps
    print(text)
    report(announce=True)
    if rows:
        out.picture(lambda png: draw(rows, png))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
