"""Where the first step's time goes: the fused step's first call split into phases, per model.

    python scripts/bench_first_step.py                       # every zoo and hand-written model
    python scripts/bench_first_step.py --models gpt2 mlp_small --no-inductor
    python scripts/bench_first_step.py --models bart --optimizer adamw --no-inductor

Models: the zoo (tests/compile/test_zoo.py's ZOO: `compile_train_step(model, None, SGD)` on its
batch; `--optimizer adamw` for AdamW), the hand-written JAX models (scripts/_jax_reference.py:
`compile_train_step(model, cross_entropy, SGD)`, and `jax.jit`'s first call of the JAX version beside it) and gpt2 at 12
layers (`gpt2@12`: the depth ratio 12/2 against the zoo's 2-layer gpt2); a name ending in `+noscan`
(`gpt2@12+noscan`) runs that model with every layer lowered on its own, the repeated-layer scan off
(TPUDIST_SCAN_LAYERS=0), tpudist's rows only. Each measurement runs in
a fresh process: "cold" with an empty persistent compilation cache (TPUDIST_CACHE_DIR, which it
fills), "warm" with the caches the cold process filled (XLA's and the fused step's step cache; the
median of `--warm-runs` processes, their first steps in `warm_runs`; "warm/cold" is its share of cold); "inductor" is `torch.compile(model)`'s first
forward + backward + optimizer step with an empty inductor cache. The warm process then times the
steady step of the fused step, eager torch and the dynamo path (`torch.compile(backend="tpudist")`,
"-" while no such backend is registered).

Phases, from timers that exist: torch.export and the decomposition to core ATen (timed by wrapping
them here), the rest of the capture (TrainStepStats.capture_seconds less both), JAX's own monitoring events
(tracing to a jaxpr, which runs tpudist's op lowerings; jaxpr -> StableHLO; XLA's compile, a cache
read when warm) and "other": the first call less all of those (planning, state upload, the run).
"kernels" counts the fusions in the fused step's optimized HLO: what XLA compiled and each step launches.
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _bench
import _plots

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("mlp_small", "mlp_wide", "transformer", "resnet18")
DEPTH = {"gpt2@12": ("gpt2", {"n_layer": 12})}  # name -> (zoo entry, config overrides)
UNSCANNED = "+noscan"  # a model name ending in it runs with every layer lowered on its own (TPUDIST_SCAN_LAYERS=0)
CHILD_TIMEOUT_S = 900  # one fresh process's deadline: a 12-layer first step on a loaded 2-core host
EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
          "to_mlir": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "xla": "/jax/core/compile/backend_compile_duration",
          "cache_read": "/jax/compilation_cache/cache_retrieval_time_sec"}
PHASES = ("export", "decompose", "capture_rest", "trace", "to_mlir", "xla", "other")


def _zoo() -> Any:
    """tests/compile/test_zoo.py as a module (tests/ is not a package; sys.path stays as it is)."""
    if "test_zoo" in sys.modules:
        return sys.modules["test_zoo"]
    spec = importlib.util.spec_from_file_location("test_zoo", ROOT / "tests" / "compile" / "test_zoo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["test_zoo"] = module
    spec.loader.exec_module(module)
    return module


def all_models() -> list[str]:
    return [*_zoo().ZOO, *REFERENCE, *DEPTH, *(name + UNSCANNED for name in DEPTH)]


# -- one fresh process ------------------------------------------------------------------------------

class _Clock:
    """Seconds per JAX monitoring event and per wrapped torch.export stage, summed while `on`."""

    def __init__(self) -> None:
        import jax
        import torch
        self.on, self.seconds = False, collections.Counter()
        self.hits = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)
        jax.monitoring.register_event_listener(self._count)
        torch.export.export = self._timed("export", torch.export.export)
        from tpudist.compile._torch.lowering import _capture  # the capture's decomposition to core ATen
        _capture.decompose = self._timed("decompose", _capture.decompose)

    def _event(self, event: str, seconds: float, **_: Any) -> None:
        if self.on:
            self.seconds[event] += seconds

    def _count(self, event: str, **_: Any) -> None:
        if self.on and event == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[name] += time.perf_counter() - start
        return timed

    def first(self, fn: Any) -> dict[str, Any]:
        """`fn()` timed with the phases inside it."""
        self.seconds.clear()
        self.on = True
        try:
            _, total = _bench.first_call(fn)
        finally:
            self.on = False
        row = {"first_s": total, "export": self.seconds["export"], "decompose": self.seconds["decompose"],
               "cache_hits": self.hits}
        row.update({k: self.seconds[e] for k, e in EVENTS.items()})
        return row


def _torch_side(name: str) -> tuple[Any, Any, Any]:
    """(model, batch, loss_fn) of a zoo, depth or reference model, seeded alike in every process."""
    import torch
    import torch.nn.functional as F
    if name in REFERENCE:
        import _jax_reference as jr
        ref = jr.MODELS[name]
        torch.manual_seed(0)
        inputs, target = ref.batch(ref.batch_size, torch.Generator().manual_seed(0))
        return ref.build(), (*inputs, target), F.cross_entropy
    zoo = _zoo()
    base, extra = DEPTH.get(name, (name, {}))
    entry = zoo.ZOO[base]
    torch.manual_seed(0)
    return entry.build({**entry.no_dropout, **extra}), zoo.make_batch(entry.kind, 0), None


def _call(model: Any, batch: Any, loss_fn: Any) -> Any:
    if loss_fn is not None:
        *inputs, target = batch
        return loss_fn(model(*inputs), target)
    return model(**batch).loss


OPTIMIZERS = {"sgd": ("SGD", {"lr": 0.01}), "adamw": ("AdamW", {"lr": 1e-3})}


def _optimizer(name: str, params: Any) -> Any:
    import torch
    cls, kwargs = OPTIMIZERS[name]
    return getattr(torch.optim, cls)(params, **kwargs)


def _kernels(step: Any) -> int | None:
    """The fused step's XLA kernels: the fusions in its optimized HLO, loop bodies included."""
    executable = step._last.program.executable if step._last is not None else None
    return executable.as_text().count(" fusion(") if executable is not None else None


def _eager_step(model: Any, batch: Any, loss_fn: Any, optimizer: str = "sgd") -> Any:
    opt = _optimizer(optimizer, model.parameters())

    def step() -> float:
        opt.zero_grad()
        loss = _call(model, batch, loss_fn)
        loss.backward()
        opt.step()
        return float(loss)
    return step


def child_tpudist(name: str, steady: bool, optimizer: str) -> dict[str, Any]:
    import tpudist
    tpudist.init()  # the persistent cache in TPUDIST_CACHE_DIR, as every tpudist program has it
    clock = _Clock()
    model, batch, loss_fn = _torch_side(name)
    eager_model, dynamo_model = copy.deepcopy(model), copy.deepcopy(model)
    step = tpudist.compile_train_step(model, loss_fn, _optimizer(optimizer, model.parameters()))
    row = clock.first(lambda: float(step(batch)))
    row["kernels"] = _kernels(step)
    capture = step.stats.capture_seconds
    row["capture_rest"] = max(0.0, capture - row["export"] - row["decompose"])
    row["tpudist_compile_s"] = step.stats.compile_seconds
    row["other"] = row["first_s"] - sum(row[p] for p in PHASES if p != "other")
    if steady:
        row.update(_steady(step, batch, loss_fn, eager_model, dynamo_model, optimizer))
    return row


def _steady(step: Any, batch: Any, loss_fn: Any, eager_model: Any, dynamo_model: Any, optimizer: str) -> dict[str, Any]:
    import torch
    sides = {"fused": lambda: float(step(batch)), "eager": _eager_step(eager_model, batch, loss_fn, optimizer)}
    row: dict[str, Any] = {}
    if "tpudist" in torch._dynamo.list_backends():
        dynamo = _eager_step(torch.compile(dynamo_model, backend="tpudist"), batch, loss_fn, optimizer)
        try:
            row["dynamo_first_s"] = _bench.first_call(dynamo)[1]
            sides["dynamo"] = dynamo
        except Exception as exc:  # the dynamo path is being built: its failure is a result, not a crash
            row["dynamo_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    times = _bench.interleave(sides, rounds=5, steps=3, warmup=1, settle_s=_bench.SETTLE_S)
    row.update({f"{side}_ms": t.median * 1e3 for side, t in times.items()})
    row["torch_threads"] = torch.get_num_threads()
    return row


def child_jax(name: str) -> dict[str, Any]:
    import jax
    import numpy as np
    import torch
    import tpudist
    import _jax_reference as jr
    tpudist.init()
    clock = _Clock()
    ref = jr.MODELS[name]
    torch.manual_seed(0)
    model = ref.build()
    inputs, target = ref.batch(ref.batch_size, torch.Generator().manual_seed(0))
    params, state = ref.params_from(model)
    train, _ = jr.jax_steps(ref)
    x, y = jax.device_put(ref.jax_input(inputs[0])), jax.device_put(target.numpy().astype(np.int32))
    held = [params, state, jr.optimizer_init(params)]
    return clock.first(lambda: float(train(*held, x, y)[-1]))


def child_inductor(name: str, optimizer: str) -> dict[str, Any]:
    import torch
    model, batch, loss_fn = _torch_side(name)
    step = _eager_step(torch.compile(model), batch, loss_fn, optimizer)
    row = {"first_s": _bench.first_call(step)[1]}
    row["second_s"] = _bench.first_call(step)[1]
    return row


def child(args: argparse.Namespace) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    if args.torch_threads:
        import torch
        torch.set_num_threads(args.torch_threads)
    if args.child == "tpudist":
        row = child_tpudist(args.model, steady=args.steady, optimizer=args.optimizer)
    elif args.child == "jax":
        row = child_jax(args.model)
    else:
        row = child_inductor(args.model, args.optimizer)
    print("ROW " + json.dumps(row))


# -- the parent: fresh processes, one table ---------------------------------------------------------

def spawn(kind: str, model: str, env: dict[str, str], threads: int | None, steady: bool = False,
          optimizer: str = "sgd") -> dict[str, Any]:
    """One fresh process's row, or {"error": ...}; its wall time (imports included) as `process_s`."""
    cmd = [sys.executable, __file__, "--child", kind, "--model", model, "--optimizer", optimizer]
    cmd += ["--steady"] if steady else []
    if threads:
        cmd += ["--torch-threads", str(threads)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode or not rows:
        return {"error": (done.stderr.strip().splitlines() or ["rc %d" % done.returncode])[-1][:300]}
    return {**json.loads(rows[-1]), "process_s": time.perf_counter() - start}


def measure(model: str, work: Path, inductor: bool, threads: int | None, optimizer: str = "sgd",
            warm_runs: int = 1) -> dict[str, Any]:
    cache = work / model.replace("@", "_").replace("+", "_")
    cache.mkdir(parents=True)
    env = {"TPUDIST_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    name = model.removesuffix(UNSCANNED)
    if name != model:
        env["TPUDIST_SCAN_LAYERS"] = "0"
    row: dict[str, Any] = {"model": model, "cold": spawn("tpudist", name, env, threads, optimizer=optimizer)}
    warm = [spawn("tpudist", name, env, threads, steady=i == 0, optimizer=optimizer) for i in range(warm_runs)]
    row["warm_runs"] = [w.get("first_s") for w in warm]
    timed = sorted((w for w in warm if w.get("first_s") is not None), key=lambda w: w["first_s"])
    # the median run's phases, the first run's steady step times
    row["warm"] = {**warm[0], **(timed[len(timed) // 2] if timed else {})}
    if name != model:
        return row
    if model in REFERENCE:
        jax_env = {**env, "TPUDIST_CACHE_DIR": str(cache / "jax")}
        row["jax_cold"] = spawn("jax", model, jax_env, threads)
        row["jax_warm"] = spawn("jax", model, jax_env, threads)
    if inductor:
        row["inductor"] = spawn("inductor", model, env, threads)
    return row


def flat(row: dict[str, Any]) -> dict[str, Any]:
    """One table line of a measured model: phases cold, totals warm, the others beside them."""
    cold, warm = row["cold"], row["warm"]
    out = {"model": row["model"], **{p: cold.get(p) for p in PHASES}, "cold_s": cold.get("first_s"),
           "kernels": cold.get("kernels"),
           "warm_s": warm.get("first_s"), "warm_xla": warm.get("xla"), "hits": warm.get("cache_hits"),
           "warm_over_cold": warm["first_s"] / cold["first_s"] if warm.get("first_s") and cold.get("first_s") else None,
           "jax_cold_s": row.get("jax_cold", {}).get("first_s"), "jax_warm_s": row.get("jax_warm", {}).get("first_s"),
           "inductor_s": row.get("inductor", {}).get("first_s"),
           **{k: warm.get(k) for k in ("fused_ms", "eager_ms", "dynamo_ms")}}
    if out["cold_s"] and out["inductor_s"]:
        out["cold_over_inductor"] = out["cold_s"] / out["inductor_s"]
    if out["cold_s"] and out["jax_cold_s"]:
        out["cold_over_jax"] = out["cold_s"] / out["jax_cold_s"]
    errors = {k: v["error"] for k, v in row.items() if isinstance(v, dict) and "error" in v}
    out["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items()) or None
    return out


COLUMNS = [("model", "model", "s"), *[(p, p, ".2f") for p in PHASES], ("kernels", "kernels", "d"),
           ("cold s", "cold_s", ".2f"),
           ("warm s", "warm_s", ".2f"), ("warm/cold", "warm_over_cold", "x"), ("warm xla", "warm_xla", ".2f"),
           ("hits", "hits", ""),
           ("jax cold", "jax_cold_s", ".2f"), ("jax warm", "jax_warm_s", ".2f"),
           ("inductor", "inductor_s", ".2f"), ("cold/ind", "cold_over_inductor", "x"),
           ("cold/jax", "cold_over_jax", "x"), ("fused ms", "fused_ms", ".2f"), ("eager ms", "eager_ms", ".2f"),
           ("dynamo ms", "dynamo_ms", ".2f")]


def depth_ratio(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    by = {r["model"]: r for r in rows}
    if "gpt2" not in by or "gpt2@12" not in by:
        return None
    ratio = {}
    for key in ("cold_s", "warm_s", *PHASES):
        two, twelve = by["gpt2"].get(key), by["gpt2@12"].get(key)
        ratio[key] = twelve / two if two and twelve else None
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=None, help="default: every zoo, reference and depth model")
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile(backend='inductor')")
    parser.add_argument("--inductor", nargs="+", default=None,
                        help="the models torch.compile(backend='inductor') runs for (default: all)")
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads in every process (default: "
                        "torch's own; eager torch's small ops suffer on an oversubscribed host)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                        help="the torch optimizer of the fused, eager, dynamo and inductor steps (default sgd; the "
                        "hand-written JAX models keep theirs)")
    parser.add_argument("--warm-runs", type=int, default=3,
                        help="fresh warm processes per model, the median's first step kept (default 3: one run "
                        "of a process varies by 1.5x on a shared 2-core host)")
    parser.add_argument("--child", choices=("tpudist", "jax", "inductor"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--steady", action="store_true", help=argparse.SUPPRESS)
    _bench.add_output_args(parser, "first_step")
    args = parser.parse_args()
    if args.child:
        return child(args)
    models = args.models or all_models()
    out, raw, rows = _bench.Output.from_args(args), [], []
    with tempfile.TemporaryDirectory(prefix="first_step_") as work:
        for model in models:
            inductor = not args.no_inductor and (args.inductor is None or model in args.inductor)
            raw.append(measure(model, Path(work), inductor, args.torch_threads, args.optimizer, args.warm_runs))
            rows.append(flat(raw[-1]))
            print(_bench.table(rows[-1:], COLUMNS), flush=True)
            out.write({"optimizer": args.optimizer, "rows": rows, "raw": raw, "depth_12_over_2": depth_ratio(rows)})
    print(_bench.table(rows, COLUMNS, title="first step (s): phases of the cold first call; steady step (ms)"))
    for r in rows:
        if r["error"]:
            print(f"{r['model']}: {r['error']}")
    ratio = depth_ratio(rows)
    if ratio:
        print("gpt2 12 layers / 2 layers: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if v))
    out.write({"rows": rows, "raw": raw, "depth_12_over_2": ratio}, announce=True)
    out.picture(lambda png: _plots.time_bars(rows, png, keys=["cold_s", "warm_s", "jax_cold_s", "inductor_s"],
                                             labels=["cold", "warm", "jax.jit cold", "inductor"],
                                             ylabel="first step (s)", log=True, title="first step"))


if __name__ == "__main__":
    main()
