"""How long an nn.LSTM's first compiled call takes, by sequence length: lowered as one `lax.scan`
(tpudist's lowering, ops/recurrent.py) against torch's decomposition, which unrolls every step.

    python scripts/bench_recurrent.py                       # lengths 16 32 64 128; unrolled up to 64
    python scripts/bench_recurrent.py --lengths 16 32 --unrolled-max 32

Each measurement is a fresh `tpudist.compile(nn.LSTM(...))` called once forward and backward (capture,
XLA compilation and the run), the persistent compilation cache off. The unrolled side is the same
lowering with `aten.lstm.input` left to torch's decomposition. Both sides' outputs are checked
against eager torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("TPUDIST_CACHE_DIR", "off")

import _bench  # noqa: E402
import torch  # noqa: E402

import tpudist  # noqa: E402


@contextlib.contextmanager
def unrolled():
    """aten.lstm.input decomposed by torch (every step unrolled), as before the scan lowering."""
    from tpudist.compile._torch.lowering import _capture, _registry
    op = torch.ops.aten.lstm.input
    _registry._KEPT.discard(op)
    _capture._decompositions.cache_clear()
    try:
        yield
    finally:
        _registry._KEPT.add(op)
        _capture._decompositions.cache_clear()


def first_call(length: int, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    layer = torch.nn.LSTM(args.features, args.hidden, num_layers=args.layers)
    x = torch.randn(length, args.batch, args.features)
    start = time.perf_counter()
    out, (h, c) = tpudist.compile(layer)(x)
    (out.sum() + c.sum()).backward()
    seconds = time.perf_counter() - start
    torch.testing.assert_close(out, layer(x)[0], rtol=1e-4, atol=1e-5)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--unrolled-max", type=int, default=64, help="longest length timed unrolled (slow)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    _bench.add_output_args(parser, "recurrent")
    args = parser.parse_args()
    first_call(3, args)  # the process's one-time costs (JAX's start, imports), timed by neither side
    with unrolled():
        first_call(3, args)
    rows = []
    for length in args.lengths:
        row = {"length": length, "scan_s": first_call(length, args)}
        if length <= args.unrolled_max:
            with unrolled():
                row["unrolled_s"] = first_call(length, args)
            row["unrolled_over_scan"] = row["unrolled_s"] / row["scan_s"]
        rows.append(row)
        print(f"  length {length}: {row}", flush=True)
    print(_bench.table(rows, [("length", "length", "d"), ("scan s", "scan_s", ".2f"),
                              ("unrolled s", "unrolled_s", ".2f"), ("unrolled / scan", "unrolled_over_scan", "x")],
                       f"nn.LSTM({args.features}, {args.hidden}, num_layers={args.layers}), batch {args.batch}: first "
                       "compiled call (capture + XLA compile + forward and backward), seconds"))
    _bench.Output.from_args(args).write({"config": vars(args), "rows": rows}, announce=True)


if __name__ == "__main__":
    main()
