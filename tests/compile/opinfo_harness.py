"""torch's OpInfo database run through `tpudist.compile`: one outcome per OpInfo and stage.

For each OpInfo that runs on CPU in float32, its first few sample inputs are fed to a module that
calls the op on every sample (the samples' tensors are the module's inputs, everything else is
fixed), once eagerly and once through `tpudist.compile`. Three stages:

- forward: the compiled float32 outputs against eager torch's, judged against float64;
- gradient: `backward()` of a fixed random projection of the outputs (after the OpInfo's own
  `output_process_fn_grad`), the inputs' `.grad` against eager torch's, judged the same way;
- bf16: the forward in bfloat16, where the OpInfo declares it.

"Judged against float64" is the zoo's rule: the same samples in float64 through eager torch are
the reference, and the compiled result must be as close to it as eager torch's own result is
(within a factor of 4), plus rounding noise of the result's size. Integer and boolean outputs must
equal eager torch's. A stage's outcome is `pass`, `n/a` (the stage does not apply), `random`
(the op draws random numbers: shapes and dtypes are checked here, values in test_random.py) or the
reason it raised (an error the user would see, e.g. `no lowering: aten.histc.default`). A wrong
value is never an outcome: it is reported as `WRONG: ...`, which no table entry may expect.
"""

from __future__ import annotations

import csv
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import tpudist
from tpudist.compile import UnsupportedOpError

TABLE = Path(__file__).with_name("opinfo_expected.csv")  # the suite's torch (its header says which): the docs' source
STAGES = ("forward", "gradient", "bf16")
COLUMNS = (*STAGES, "aten")  # aten: the ATen ops of the captured float32 graph, for the docs
SAMPLES = 3           # sample inputs per OpInfo and stage (the first ones torch generates)
SEED = 0

# OpInfos whose values are uninitialized memory: only shapes and dtypes are comparable
UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                           "empty_permuted"})


# OpInfos whose index output torch leaves unspecified among equal values (torch's docs: sort with
# stable=False and topk do not promise an order of ties; kthvalue and mode pick any of them): there
# the compiled index must select an element equal to the one eager torch's index selects. Per
# OpInfo: (position of the index output or None for the whole output, position of `dim` among
# the positional arguments after the input, its default, position of `keepdim` or None)
TIES = {
    "sort": (1, 0, -1, None), "argsort": (None, 0, -1, None), "topk": (1, 1, -1, None),
    "kthvalue": (1, 1, -1, 2), "mode": (1, 0, -1, 1),
}

# OpInfos whose gradient in torch is itself wrong: judged against float64 central differences
# of eager torch's forward instead (torch.autograd.gradcheck fails on them too)
TORCH_GRADIENT_WRONG = {
    "as_strided_scatter": "torch's derivative puts self's gradient on the overwritten elements instead of the "
                          "others (pytorch/pytorch#77128)",
}


class Mismatch(AssertionError):
    """A compiled value that differs from eager torch's beyond rounding: never an accepted outcome."""


def key_of(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def opinfos() -> dict[str, Any]:
    """Every OpInfo that declares float32 on CPU, by name ("name.variant" for variants)."""
    from torch.testing._internal import common_methods_invocations as cmi
    # torch's random OpInfos reseed (torch.manual_seed(42)) around every call to make eager runs
    # repeatable; a compiled graph cannot replay that, and their values are not compared anyway
    cmi.wrapper_set_seed = _unseeded
    return {key_of(op): op for op in cmi.op_db if torch.float32 in op.supported_dtypes("cpu")}


def _unseeded(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def torch_minor(version: str = torch.__version__) -> str:
    """"2.14" for torch 2.14.1+cpu: OpInfos and ops change between minor releases, the table with them."""
    return ".".join(version.split("+")[0].split(".")[:2])


def table_torch(path: Path = TABLE) -> str:
    """The torch minor a table was written on (its first line says)."""
    with path.open() as f:
        found = re.search(r"\(torch (\d+\.\d+)", f.readline())
    if found is None:
        raise ValueError(f"{path.name}'s first line names no torch release; regenerate it")
    return found.group(1)


def running_table() -> Path:
    """The expected table of the running torch: opinfo_expected.csv for the suite's torch,
    opinfo_expected_<minor>.csv (e.g. opinfo_expected_2.14.csv) for another release."""
    if not TABLE.exists() or table_torch(TABLE) == torch_minor():
        return TABLE
    return TABLE.with_name(f"opinfo_expected_{torch_minor()}.csv")


def is_wrong(outcome: str) -> bool:
    """A silent mismatch: no table may expect it (see Mismatch)."""
    return outcome.startswith("WRONG")


def read_table(path: Path = TABLE) -> dict[str, dict[str, str]]:
    with path.open() as f:
        rows = [row for row in csv.reader(line for line in f if not line.startswith("#"))]
    header, *body = rows
    table = {row[0]: dict(zip(header[1:], row[1:])) for row in body}
    wrong = [f"{name} ({stage})" for name, row in table.items() for stage in STAGES if is_wrong(row.get(stage, ""))]
    if wrong:
        raise ValueError(f"{path.name} expects a wrong value for {', '.join(wrong[:5])}: a silent mismatch is never "
                         "an expected outcome; fix the lowering or make it raise")
    return table


def write_table(table: dict[str, dict[str, str]], path: Path = TABLE) -> None:
    wrong = sorted(name for name, row in table.items() if any(is_wrong(row[stage]) for stage in STAGES))
    if wrong:
        raise ValueError(f"not writing {path.name}: wrong values for {', '.join(wrong[:5])}")
    with path.open("w", newline="") as f:
        f.write(f"# Expected outcome of every OpInfo (torch {torch.__version__.split('+')[0]}) through "
                "tpudist.compile; see tests/compile/opinfo_harness.py.\n"
                "# Regenerate: TPUDIST_OPINFO_UPDATE=1 ./scripts/test tests/compile/test_opinfo.py (with that torch)\n")
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["op", *COLUMNS])
        for name in sorted(table):
            writer.writerow([name, *(table[name].get(c, "") for c in COLUMNS)])


# -- running one OpInfo ----------------------------------------------------------------------------

class OpModule(torch.nn.Module):
    """Calls `fn` on every sample; the samples' tensors are the forward's inputs, in order."""

    def __init__(self, fn: Callable[..., Any], samples: list[Any]):
        super().__init__()
        self.fn = fn
        self.layouts = []
        # what the OpInfo differentiates of each sample's output (e.g. the real part, one output)
        self.processors = [s.output_process_fn_grad for s in samples]
        for s in samples:
            leaves, spec = tree_flatten((s.input, s.args, s.kwargs))
            self.layouts.append((spec, [None if isinstance(v, torch.Tensor) else (v,) for v in leaves]))

    def forward(self, *tensors: torch.Tensor) -> tuple:
        return tuple(self.fn(inp, *args, **kwargs) for inp, args, kwargs in self.arguments(tensors))

    def arguments(self, tensors: tuple | list) -> list[tuple[Any, tuple, dict]]:
        """Each sample's (input, args, kwargs) with `tensors` in the tensors' places."""
        calls, i = [], 0
        for spec, fixed in self.layouts:
            leaves = []
            for value in fixed:
                if value is None:
                    leaves.append(tensors[i])
                    i += 1
                else:
                    leaves.append(value[0])
            calls.append(tree_unflatten(leaves, spec))
        return calls


def _tensors(samples: list[Any]) -> list[torch.Tensor]:
    return [v for s in samples for v in tree_flatten((s.input, s.args, s.kwargs))[0] if isinstance(v, torch.Tensor)]


def _fresh(tensors: list[torch.Tensor], dtype: torch.dtype | None = None, grad: bool = True) -> list[torch.Tensor]:
    """Independent leaf copies (optionally in another floating dtype), keeping requires_grad."""
    out = []
    for t in tensors:
        floating = t.is_floating_point() or t.is_complex()
        c = t.detach().clone()
        if dtype is not None and floating:
            c = c.to(dtype if t.is_floating_point() else _complex_of(dtype))
        out.append(c.requires_grad_(grad and t.requires_grad and floating))
    return out


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def _samples(op: Any, dtype: torch.dtype, requires_grad: bool) -> list[Any]:
    torch.manual_seed(SEED)
    out = []
    for sample in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
        out.append(sample)
        if len(out) == SAMPLES:
            break
    return out


def _eager(fn: Callable[..., Any], sample: Any, seed: int) -> Any:
    """The sample through eager torch after `torch.manual_seed(seed)`; None if torch raises."""
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        return None


def _same(a: Any, b: Any) -> bool:
    def dense(v: Any) -> Any:  # comparable: strided, and complex32 (which torch.equal lacks) widened
        if not isinstance(v, torch.Tensor):
            return v
        v = v.to_dense() if v.layout != torch.strided else v
        return v.to(torch.complex64) if v.dtype == torch.complex32 else v
    leaves_a, leaves_b = [dense(v) for v in tree_flatten(a)[0]], [dense(v) for v in tree_flatten(b)[0]]
    return len(leaves_a) == len(leaves_b) and all(
        torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(leaves_a, leaves_b))


def reason(exc: BaseException) -> str:
    """The short, stable reason an error gives: what the table records."""
    text = str(exc)
    if isinstance(exc, Mismatch):
        return f"WRONG: {text.splitlines()[0][:300]}"
    found = re.search(r"op (\S+) \(in .*?\) has no XLA lowering", text)
    if found:
        return f"no lowering: {found.group(1)}"
    found = re.search(r"lowering (\S+) \(in .*?\) failed for arguments", text)
    if found:
        return f"lowering fails: {found.group(1)}"
    found = re.search(r"(aten\.\S+) in .*? produces a data-dependent shape", text)
    if found:
        return f"data-dependent shape: {found.group(1)}"
    found = re.search(r"torch's decomposition of (\S+) .*? failed: (\w+)", text)
    if found:
        return f"decomposition fails: {found.group(1)} ({found.group(2)})"
    found = re.search(r"could not trace .*?: (\w+):", text)
    if found:
        return f"capture: {found.group(1)}"
    found = re.search(r"is a tensor of layout (\S+);", text)
    if found:
        return f"layout: {found.group(1)}"
    found = re.search(r"tensors of dtype (\S+) are not supported", text)
    if found:
        return f"dtype: {found.group(1)}"
    if isinstance(exc, UnsupportedOpError) and "torch -> XLA: " in text:
        what = text.split("torch -> XLA: ", 1)[1].splitlines()[0]
        what = re.split(r" ha(?:s|ve) no XLA lowering|; |\. | \(in ", what)[0]
        return f"unsupported: {what[:110]}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = re.sub(r"0x[0-9a-f]+", "0x..", first)[:120]
    return f"error: {type(exc).__name__}: {first}"


@dataclass
class Run:
    """One OpInfo's samples in one dtype: the module, its inputs, and eager torch's results."""

    name: str
    module: OpModule
    inputs: list[torch.Tensor]
    random: bool = False    # every sample draws random numbers


def _build(op: Any, dtype: torch.dtype, requires_grad: bool) -> Run | None:
    """The OpInfo's first samples that eager torch runs. A sample whose eager result changes with
    the seed draws random numbers: values are compared only when no sample of the OpInfo is random,
    else only the deterministic samples are kept; when every sample is random, the run is random."""
    from torch.testing._internal.opinfo.core import gradcheck_wrapper_ctc_loss
    from torch.testing._utils import wrapper_set_seed
    # ctc_loss's wrapper puts a log_softmax before the op, behind which torch's gradient (its own
    # convention, not the derivative of the loss) and the true one agree: the op runs bare here
    bare = (wrapper_set_seed, gradcheck_wrapper_ctc_loss)
    wrapper = _unseeded if op.gradcheck_wrapper in bare else op.gradcheck_wrapper
    fn = lambda *a, **k: wrapper(op.op, *a, **k)  # noqa: E731
    fixed, drawn = [], []
    for sample in _samples(op, dtype, requires_grad):
        first = _eager(fn, sample, 1)
        if first is None:
            continue
        random = key_of(op) not in UNINITIALIZED and not all(_same(first, _eager(fn, sample, seed)) for seed in (2, 3))
        (drawn if random else fixed).append(sample)
    samples = fixed or drawn
    if not samples:
        return None
    return Run(key_of(op), OpModule(fn, samples), _tensors(samples), random=not fixed)


def _call(module: torch.nn.Module, inputs: list[torch.Tensor]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module(*inputs)


def check(op: Any) -> dict[str, str]:
    """The outcome of each stage for one OpInfo (see the module docstring)."""
    name = key_of(op)
    grad_applies = op.supports_autograd
    run = _build(op, torch.float32, grad_applies)
    if run is None:
        return {**{s: "n/a: eager torch fails on every sample" for s in STAGES}, "aten": ""}
    kind = "random" if run.random else "uninitialized" if name in UNINITIALIZED else "values"
    outcome = {}
    compiled = tpudist.compile(run.module)
    has_grad = grad_applies and any(t.requires_grad for t in run.inputs)
    if has_grad:
        outcome.update(_forward_and_gradient(run, compiled, kind))
    else:
        try:
            outcome["forward"] = _stage(_forward(run, compiled, kind, torch.float32))
        except Exception as exc:
            outcome["forward"] = reason(exc)
        outcome["gradient"] = "n/a"
    outcome["aten"] = " ".join(sorted({op for program in compiled._programs.values()
                                       for op in program.captured.op_counts if op != "<built-in function getitem>"}))
    if torch.bfloat16 not in op.supported_dtypes("cpu"):
        outcome["bf16"] = "n/a"
    else:
        bf = _build(op, torch.bfloat16, False)
        if bf is None:
            outcome["bf16"] = "n/a: eager torch fails on every sample"
        else:
            try:
                judged = _forward(bf, tpudist.compile(bf.module), "random" if bf.random else kind, torch.bfloat16)
                outcome["bf16"] = "random" if judged == "random" else "pass"
            except Exception as exc:
                outcome["bf16"] = reason(exc)
    return outcome


def _stage(kind: str) -> str:
    return "random" if kind == "random" else "pass"


def _forward_and_gradient(run: Run, compiled: Any, kind: str) -> dict[str, str]:
    """Both float32 stages from one differentiable call (one executable and its backward): its
    outputs judged as the forward, then backward() as the gradient. If that call fails, a plain
    forward tells whether the forward itself works."""
    inputs = _fresh(run.inputs)
    try:
        got = _call(compiled, inputs)
    except Exception as exc:
        try:
            return {"forward": _stage(_forward(run, compiled, kind, torch.float32)), "gradient": reason(exc)}
        except Exception as plain:
            return {"forward": reason(plain), "gradient": "n/a: forward fails"}
    try:
        kind = _forward(run, compiled, kind, torch.float32, got=torch.utils._pytree.tree_map(_detached, got))
    except Exception as exc:
        return {"forward": reason(exc), "gradient": "n/a: forward fails"}
    try:
        _gradient(run, kind, got, inputs)
        return {"forward": _stage(kind), "gradient": _stage(kind)}
    except _NoGradient:
        return {"forward": _stage(kind), "gradient": "n/a: no differentiable output"}
    except Exception as exc:
        return {"forward": _stage(kind), "gradient": reason(exc)}


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _draws(compiled: Any) -> bool:
    """Whether the compiled graph draws random numbers (a random op whose samples happened to give
    the same eager result for every seed, e.g. bernoulli of small probabilities)."""
    return any(program.captured.has_random for program in compiled._programs.values())


def _forward(run: Run, compiled: Any, kind: str, dtype: torch.dtype, got: Any = None) -> str:
    """Runs (unless `got` is its result already) and judges the forward; returns the kind it was
    judged as."""
    if got is None:
        got = _call(compiled, _fresh(run.inputs, grad=False))
    if kind == "values" and _draws(compiled):
        kind = "random"
    inputs = _fresh(run.inputs, grad=False)
    eager = _call(run.module, inputs)
    if run.name in TIES and kind == "values":
        got = _ties_as_eager(run, inputs, got, eager)
    exact = _exact(run, kind)
    _judge("output", got, eager, exact, kind, dtype)
    return kind


def _ties_as_eager(run: Run, inputs: list[torch.Tensor], got: tuple, eager: tuple) -> tuple:
    """`got` with each index output replaced by eager torch's wherever both select equal elements
    (see TIES); a differing selection stays, to be reported."""
    position, dim_at, dim_default, keepdim_at = TIES[run.name]
    fixed = []
    for (inp, args, kwargs), mine, theirs in zip(run.module.arguments(inputs), got, eager):
        dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else dim_default)
        keepdim = kwargs.get("keepdim", args[keepdim_at] if keepdim_at is not None and len(args) > keepdim_at
                             else False)
        mine_index = mine if position is None else mine[position]
        theirs_index = theirs if position is None else theirs[position]
        if inp.ndim and mine_index.shape == theirs_index.shape:
            expand = (lambda i: i) if keepdim or mine_index.ndim == inp.ndim else (lambda i: i.unsqueeze(dim))
            picked = lambda i: inp.gather(dim, expand(i).to(torch.int64))  # noqa: E731
            if torch.equal(picked(mine_index).isnan(), picked(theirs_index).isnan()) and torch.equal(
                    picked(mine_index).nan_to_num(), picked(theirs_index).nan_to_num()):
                if position is None:
                    mine = theirs_index
                else:
                    items = list(mine)
                    items[position] = theirs_index
                    mine = type(mine)(items)  # a torch.return_types structseq, as eager's
        fixed.append(mine)
    return tuple(fixed)


def _exact(run: Run, kind: str) -> Any:
    """Eager torch in float64 on the same samples; None where the op has no float64 kernel."""
    if kind != "values":
        return None
    try:
        return _call(run.module, _fresh(run.inputs, torch.float64, grad=False))
    except Exception:
        return None


def _gradient(run: Run, kind: str, compiled_outputs: Any, compiled_inputs: list[torch.Tensor]) -> None:
    """backward() of the projection of the compiled outputs, against eager torch's (float32, float64)."""
    grads = []
    for module, dtype in ((None, None), (run.module, None), (run.module, torch.float64)):
        if dtype is torch.float64 and kind != "values":
            grads.append(None)
            continue
        inputs = compiled_inputs if module is None else _fresh(run.inputs, dtype)
        try:
            outputs = compiled_outputs if module is None else _call(module, inputs)
            loss = _projection(run, outputs)
        except Exception:
            if dtype is torch.float64:
                grads.append(None)
                continue
            raise
        if module is not None and loss is None and grads[0] is not None:
            raise Mismatch("gradient: eager torch's outputs are not differentiable, the compiled module's are")
        if loss is None:
            if module is not None:
                raise _NoGradient()
            grads.append(None)  # the compiled outputs are not differentiable: eager's must be, if at all, zero
            continue
        loss.backward()
        grads.append([t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.requires_grad])
        if module is not None and grads[0] is None:
            if any(bool(g.count_nonzero()) for g in grads[-1]):
                raise Mismatch("gradient: the compiled module's outputs are not differentiable, eager torch's are "
                               "(with a gradient that is not zero)")
            raise _NoGradient()  # (bernoulli: torch's derivative is zero, the compiled output has none)
    got, eager, exact = grads
    if run.name in TORCH_GRADIENT_WRONG:
        exact = _numerical_gradient(run)
        eager = [g.to(torch.float32) for g in exact]  # the float32 reference rounds it once
    _judge("gradient", got, eager, exact, kind, torch.float32)


def _numerical_gradient(run: Run, step: float = 1e-6) -> list[torch.Tensor]:
    """The projection's gradient by float64 central differences of eager torch's forward."""
    inputs = _fresh(run.inputs, torch.float64, grad=False)
    wanted = [t for t, original in zip(inputs, run.inputs) if original.requires_grad and t.is_floating_point()]

    def loss() -> float:
        outputs = _call(run.module, inputs)
        marked = tuple(tree_flatten(o)[0] for o in outputs)  # every floating output counts, as requires_grad would
        for leaves in marked:
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    leaf.requires_grad_(True)
        return float(_projection(run, outputs).detach())

    grads = []
    for t in wanted:
        g = torch.zeros_like(t)
        flat, out = t.view(-1), g.view(-1)
        for i in range(flat.numel()):
            keep = float(flat[i])
            flat[i] = keep + step
            up = loss()
            flat[i] = keep - step
            down = loss()
            flat[i] = keep
            out[i] = (up - down) / (2 * step)
        grads.append(g)
    return grads


class _NoGradient(Exception):
    pass


def _projection(run: Run, outputs: tuple) -> torch.Tensor | None:
    """A fixed random linear function of every differentiable output: its backward() gives each
    input's vector-Jacobian product."""
    total = None
    generator = torch.Generator().manual_seed(SEED + 1)
    for sample_out, process in zip(outputs, run.module.processors):
        for value in tree_flatten(process(sample_out))[0]:
            if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
                continue
            real = torch.view_as_real(value.resolve_conj()) if value.is_complex() else value
            # drawn for every floating output, so compiled and eager runs weigh each output alike even
            # where one marks an output differentiable and the other not (native_layer_norm's rstd)
            weights = torch.randn(real.shape, generator=generator, dtype=torch.float64).to(real.dtype)
            if not value.requires_grad:
                continue
            term = (real * weights).sum()
            total = term if total is None else total + term
    return total


# -- judging ---------------------------------------------------------------------------------------

def _judge(what: str, got: Any, eager: Any, exact: Any, kind: str, dtype: torch.dtype) -> None:
    got_leaves, got_spec = tree_flatten(got)
    eager_leaves, eager_spec = tree_flatten(eager)
    if got_spec != eager_spec:
        raise Mismatch(f"{what}: structure {got_spec} != eager torch's {eager_spec}")
    exact_leaves = tree_flatten(exact)[0] if exact is not None else [None] * len(eager_leaves)
    if len(exact_leaves) != len(eager_leaves):
        exact_leaves = [None] * len(eager_leaves)
    for i, (g, e, x) in enumerate(zip(got_leaves, eager_leaves, exact_leaves)):
        where = f"{what} {i}"
        if not isinstance(e, torch.Tensor):
            if g != e:
                raise Mismatch(f"{where}: {g!r} != eager torch's {e!r}")
            continue
        if not isinstance(g, torch.Tensor):
            raise Mismatch(f"{where}: {type(g).__name__}, eager torch a tensor")
        if g.shape != e.shape or g.dtype != e.dtype:
            raise Mismatch(f"{where}: {tuple(g.shape)} {g.dtype}, eager torch {tuple(e.shape)} {e.dtype}")
        if kind == "uninitialized":
            continue
        if kind == "random":
            if (g.is_floating_point() or g.is_complex()) and not bool(torch.isfinite(g).all()) \
                    and bool(torch.isfinite(e).all()):
                raise Mismatch(f"{where}: non-finite random draws")
            continue
        _close(where, g.detach(), e.detach(), x.detach() if isinstance(x, torch.Tensor) else None, dtype)


def _close(where: str, got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor | None,
           dtype: torch.dtype) -> None:
    if not (eager.is_floating_point() or eager.is_complex()):
        if not torch.equal(got, eager):
            bad = (got != eager).nonzero()[:3].tolist()
            raise Mismatch(f"{where}: {eager.dtype} values differ from eager torch's at {bad}")
        return
    if got.is_complex():
        got, eager = torch.view_as_real(got.resolve_conj()), torch.view_as_real(eager.resolve_conj())
        exact = torch.view_as_real(exact.resolve_conj()) if exact is not None and exact.is_complex() else None
    got, eager = got.double(), eager.double()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(test(got), test(eager)):
            bad = (test(got) != test(eager)).nonzero()[:3].tolist()
            raise Mismatch(f"{where}: {test.__name__} differs from eager torch's at {bad}")
    finite = torch.isfinite(eager)
    got, eager = got[finite], eager[finite]
    if exact is None or exact.shape != finite.shape:
        exact, floor_scale = eager, 0.0
    else:
        exact = exact.double()[finite]
        if not bool(torch.isfinite(exact).all()):
            exact, floor_scale = eager, 0.0
        else:
            floor_scale = 4.0
    relative = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 2e-6 if floor_scale else 1e-5
    error, floor = float((got - exact).norm()), float((eager - exact).norm())
    size = float(exact.norm())
    noise = relative * size + (1e-7 if relative < 1e-3 else 1e-4) * exact.numel() ** 0.5
    if not error <= floor_scale * floor + noise:
        raise Mismatch(f"{where}: compiled is {error:.3e} from float64, eager torch {floor:.3e} "
                       f"(norm {size:.3e}, {exact.numel()} values)")


# -- the docs generated from the table ---------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs"
BEGIN = "<!-- generated from tests/compile/opinfo_expected.csv by tests/compile/test_opinfo.py; do not edit -->"
END = "<!-- end of the generated table -->"
_LABELS = {"forward": "forward (float32)", "gradient": "gradient (float32)", "bf16": "forward (bfloat16)"}


def _category(outcome: str) -> str:
    return outcome.split(":", 1)[0]


def render_summary(table: dict[str, dict[str, str]]) -> str:
    """docs/torch.md's Ops section: counts per stage and the expected failures grouped by reason."""
    lines = [BEGIN, "", "| stage | pass | random (shape here, distribution tested) | expected failure | n/a |",
             "|---|---:|---:|---:|---:|"]
    for stage in STAGES:
        values = [row[stage] for row in table.values()]
        count = lambda c: sum(_category(v) == c for v in values)  # noqa: E731
        failing = len(values) - count("pass") - count("random") - count("n/a")
        lines.append(f"| {_LABELS[stage]} | {count('pass')} | {count('random')} | {failing} | {count('n/a')} |")
    proven = {a for row in table.values() if row["forward"] in ("pass", "random") for a in row["aten"].split()}
    lines += ["", f"{len(table)} OpInfos run on CPU in float32; the graphs of those passing forward reach "
              f"{len(proven)} distinct ATen ops. Expected failures by reason (every one an error the user sees, "
              "never a wrong value; the full table per OpInfo is [docs/ops.md](ops.md)):", "",
              "| reason | OpInfos (stage) |", "|---|---|"]
    by_reason: dict[str, list[str]] = {}
    for name, row in sorted(table.items()):
        for stage in STAGES:
            value = row[stage]
            if _category(value) not in ("pass", "random", "n/a"):
                by_reason.setdefault(value, []).append(name if stage == "forward" else f"{name} ({stage})")
    for value, names in sorted(by_reason.items(), key=lambda item: (_category(item[0]), item[0])):
        lines.append(f"| {value.replace('|', '/')} | {', '.join(f'`{n}`' for n in names)} |")
    return "\n".join(lines + ["", END])


def render_full(table: dict[str, dict[str, str]]) -> str:
    """docs/ops.md: every OpInfo's outcome per stage and the ATen ops its graph holds."""
    head = ["# Ops: every OpInfo through `tpudist.compile`", "",
            "Generated from `tests/compile/opinfo_expected.csv`, which `tests/compile/test_opinfo.py` checks on "
            "every run (see docs/torch.md, \"What is supported\"). `pass`: the compiled result is as close to "
            "float64 as eager torch's; `random`: values are random draws (shape and dtype checked here, the "
            "distribution in `tests/compile/test_random.py`); anything else is the error a user gets.", "",
            BEGIN, "", "| OpInfo | forward | gradient | bf16 forward | ATen ops in the graph |", "|---|---|---|---|---|"]
    rows = [f"| `{name}` | {row['forward']} | {row['gradient']} | {row['bf16']} | {row['aten']} |".replace("\n", " ")
            for name, row in sorted(table.items())]
    return "\n".join(head + rows + ["", END, ""])


def splice(text: str, generated: str) -> str:
    """`text` with the part between BEGIN and END (inclusive) replaced by `generated`."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + generated + text[end:]


if __name__ == "__main__":
    # python tests/compile/opinfo_harness.py NAME [NAME ...]: the outcomes of the OpInfos whose names
    # start with any NAME (no table involved)
    import sys
    import time
    everything = opinfos()
    for name in sorted(n for n in everything if any(n == p or n.startswith(p) for p in sys.argv[1:])):
        start = time.perf_counter()
        result = check(everything[name])
        result.pop("aten")
        print(f"{name} ({time.perf_counter() - start:.1f} s): {result}", flush=True)
