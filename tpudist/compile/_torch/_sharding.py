"""How the sharded fused step lays out a torch model's parameters over a mesh: FSDP, tensor-parallel
plans and their presets, resolved into one `PartitionSpec` per parameter.

    step = tpudist.compile_train_step(model, loss_fn, opt, mesh=make_mesh({"fsdp": -1}), sharding="fsdp")
    step = tpudist.compile_train_step(model, loss_fn, opt, mesh=make_mesh({"fsdp": 2, "model": 2}),
                                      sharding=tpudist.Sharding(fsdp=True, tp="llama"))

A sharded step is compiled in the global view (`jax.jit` with input and output shardings): XLA's
SPMD partitioner inserts the parameter gathers, gradient reduce-scatters and tensor-parallel
collectives. Any layout computes the same numbers; a layout only decides memory and traffic.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from jax.sharding import PartitionSpec as P

FSDP_AXIS = "fsdp"
MODEL_AXIS = "model"
FSDP_MIN_BYTES = 16 << 10  # a parameter smaller than this stays replicated under FSDP (biases, norms)

COLWISE, ROWWISE = "colwise", "rowwise"
OPTIONAL = "?"  # a preset's "colwise?": applied where the module exists and its dims divide, else left whole

# module path patterns -> style, as torch's parallelize_module plans: attention q/k/v and MLP
# up/gate column-wise (output features split), output and down projections row-wise (input
# features split), so each block needs one reduction of its output
PRESETS: dict[str, dict[str, Any]] = {
    "llama": {  # Llama, Mistral, Qwen2 and their kin (transformers naming)
        "*.self_attn.q_proj": COLWISE, "*.self_attn.k_proj": COLWISE, "*.self_attn.v_proj": COLWISE,
        "*.self_attn.o_proj": ROWWISE,
        "*.mlp.gate_proj": COLWISE, "*.mlp.up_proj": COLWISE, "*.mlp.down_proj": ROWWISE,
        "*embed_tokens": ROWWISE + OPTIONAL, "lm_head": COLWISE + OPTIONAL,  # the vocabulary split
    },
    "gpt2": {  # GPT-2 (transformers' Conv1D layers, weights stored (in, out))
        "*.attn.c_attn": COLWISE, "*.attn.c_proj": ROWWISE, "*.mlp.c_fc": COLWISE, "*.mlp.c_proj": ROWWISE,
        "*.wte": ROWWISE + OPTIONAL, "lm_head": COLWISE + OPTIONAL,
    },
    # expert parallelism: transformers' stacked experts (Mixtral, Qwen-MoE, OLMoE: gate_up_proj
    # (E, 2I, H), down_proj (E, H, I)) split by expert over the "expert" axis (lowering/ops/experts.py)
    "experts": {"*experts.gate_up_proj": P("expert", None, None), "*experts.down_proj": P("expert", None, None)},
}


def tp_plan(name: str) -> dict[str, Any]:
    """A named preset ("llama", "gpt2", "experts") as its plan: module path patterns to
    "colwise" / "rowwise", or parameter name patterns to PartitionSpecs, to extend, merge
    (`{**tp_plan("llama"), **tp_plan("experts")}`) or pass as `Sharding(tp=...)`."""
    if name not in PRESETS:
        raise ValueError(f"no tensor-parallel preset {name!r}; presets: {sorted(PRESETS)} (or pass a plan: "
                         "{'*.q_proj': 'colwise', '*.o_proj.weight': PartitionSpec(None, 'model'), ...})")
    return dict(PRESETS[name])


@dataclass(frozen=True)
class Sharding:
    """How the fused step shards a model's parameters and optimizer state (see docs/sharding.md).

    fsdp: True (axis "fsdp") or a mesh axis name: every parameter of at least `min_bytes` is split
        along one dimension over that axis (its largest dimension the axis size divides that no
        tensor-parallel rule split already), with its optimizer state: ZeRO-3.
    tp: a preset name ("llama", "gpt2", "experts") or a plan: glob patterns over module paths mapped to
        "colwise" / "rowwise" (nn.Linear, transformers' Conv1D, nn.Embedding; over the "model" axis),
        or over parameter names mapped to a `PartitionSpec` naming mesh axes.
    min_bytes: the FSDP size threshold (default 16 KiB).

    `compile_train_step(..., sharding=)` also takes the short forms "fsdp" (= Sharding(fsdp=True)),
    a preset name, or a plan mapping (= Sharding(tp=...)).
    """

    fsdp: bool | str = False
    tp: str | Mapping[str, Any] | None = None
    min_bytes: int = FSDP_MIN_BYTES
    rules: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.fsdp, (bool, str)) or self.fsdp == "":
            raise TypeError(f"Sharding(fsdp={self.fsdp!r}) takes True/False or a mesh axis name")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"Sharding(min_bytes={self.min_bytes!r}) must be a non-negative int")
        tp = self.tp
        rules = tp_plan(tp) if isinstance(tp, str) else dict(tp or {})
        for pattern, rule in rules.items():
            if not isinstance(pattern, str):
                raise TypeError(f"a tensor-parallel plan maps glob patterns (str) to layouts; got key {pattern!r}")
            if not (isinstance(rule, P) or rule.rstrip(OPTIONAL) in (COLWISE, ROWWISE)):
                raise TypeError(f"plan entry {pattern!r}: {rule!r} is neither a PartitionSpec nor 'colwise' / "
                                "'rowwise'")
        object.__setattr__(self, "rules", rules)

    @property
    def fsdp_axis(self) -> str | None:
        return FSDP_AXIS if self.fsdp is True else (self.fsdp or None)

    @classmethod
    def of(cls, sharding: Any) -> Sharding:
        """`sharding` as given to compile_train_step, in full."""
        if isinstance(sharding, Sharding):
            return sharding
        if sharding == "fsdp":
            return cls(fsdp=True)
        if isinstance(sharding, (str, Mapping)):
            return cls(tp=sharding)
        raise TypeError(f"sharding={sharding!r}: pass 'fsdp', a preset name {sorted(PRESETS)}, a plan "
                        "{pattern: PartitionSpec or 'colwise'/'rowwise'}, or tpudist.Sharding(fsdp=..., tp=...)")


def resolve(sharding: Sharding, model: torch.nn.Module, mesh: Any) -> dict[int, P]:
    """Every parameter's layout, by `id`: its `PartitionSpec` (P() replicated). ValueError naming
    the pattern, parameter, dimension and axis where the plan cannot be applied as written."""
    axes = dict(mesh.shape)
    fsdp = sharding.fsdp_axis
    if fsdp is not None and fsdp not in axes:
        raise ValueError(f"sharding asks for FSDP over axis {fsdp!r} but the mesh has axes {tuple(axes)}; build it "
                         f"with tpudist.mesh.make_mesh({{{fsdp!r}: -1}}) (or {{{fsdp!r}: N, 'model': M}})")
    names = dict(model.named_parameters())
    canonical = {id(p): n for n, p in names.items()}  # a tied weight by its first name
    modules = dict(model.named_modules())
    specs: dict[str, tuple] = {}
    origin: dict[str, str] = {}
    for pattern, rule in sharding.rules.items():
        optional = isinstance(rule, str) and rule.endswith(OPTIONAL)
        if isinstance(rule, P):
            hits = {n: tuple(rule) for n in names if fnmatch.fnmatchcase(n, pattern)}
        else:
            hits = {}
            for m in (m for m in modules if fnmatch.fnmatchcase(m, pattern)):
                styled = _styled(m, modules[m], rule.rstrip(OPTIONAL), optional)
                hits.update({canonical[id(p)]: spec for p, spec in styled if id(p) in canonical})
            if optional:
                hits = {n: spec for n, spec in hits.items() if _divides(names[n], spec, axes)}
        if not hits and optional:
            continue
        if not hits:
            some = ", ".join(list(names)[:4])
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no "
                             f"{'parameter' if isinstance(rule, P) else 'module'} of {type(model).__name__} "
                             f"(its parameters are named like {some}, ...); fix the pattern or drop the entry")
        for name, spec in hits.items():
            if name in specs and specs[name] != spec:
                raise ValueError(f"parameter {name} is laid out by two plan entries: {origin[name]!r} gives "
                                 f"{P(*specs[name])}, {pattern!r} gives {P(*spec)}")
            specs[name], origin[name] = spec, pattern
    out: dict[int, P] = {}
    unsplit: list[str] = []
    for name, p in names.items():
        spec = list(specs.get(name, ()))
        if len(spec) > p.dim():
            raise ValueError(f"plan entry {origin[name]!r} gives parameter {name} of shape {tuple(p.shape)} the "
                             f"{len(spec)}-dim layout {P(*spec)}")
        spec += [None] * (p.dim() - len(spec))
        for dim, entry in enumerate(spec):
            for axis in _axes(entry):
                if axis not in axes:
                    raise ValueError(f"plan entry {origin[name]!r} splits parameter {name} over axis {axis!r}, "
                                     f"which the mesh (axes {tuple(axes)}) lacks")
            size = math.prod(axes[a] for a in _axes(entry))
            if p.shape[dim] % size:
                raise ValueError(f"plan entry {origin[name]!r} splits dim {dim} of parameter {name} (size "
                                 f"{p.shape[dim]}) over {P(*spec)}: {size} devices do not divide it; pick "
                                 "another dim or a mesh axis of a size that divides it")
        if fsdp is not None and p.numel() * p.element_size() >= sharding.min_bytes \
                and fsdp not in {a for e in spec for a in _axes(e)}:
            free = [d for d, e in enumerate(spec) if e is None and p.shape[d] % axes[fsdp] == 0]
            if free:
                dim = max(free, key=lambda d: (p.shape[d], -d))
                spec[dim] = fsdp
            elif axes[fsdp] > 1 and not any(spec):
                unsplit.append(f"{name} {tuple(p.shape)}")
        while spec and spec[-1] is None:
            spec.pop()
        out[id(p)] = P(*spec)
    if unsplit:
        warnings.warn(f"FSDP over {fsdp!r} ({axes[fsdp]} devices) keeps these parameters whole on every device: "
                      f"no free dimension is divisible by {axes[fsdp]}: {', '.join(unsplit[:6])}"
                      + (f" and {len(unsplit) - 6} more" if len(unsplit) > 6 else ""), stacklevel=4)
    return out


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _divides(p: torch.Tensor, spec: tuple, axes: dict[str, int]) -> bool:
    return all(p.shape[d] % math.prod(axes.get(a, 0) or 1 for a in _axes(e)) == 0 and
               all(a in axes for a in _axes(e)) for d, e in enumerate(spec))


def _styled(path: str, module: torch.nn.Module, style: str, optional: bool = False) -> list[tuple[Any, tuple]]:
    """(parameter, layout) for each parameter a column-wise or row-wise style lays out in one module."""
    prefix = f"{path}." if path else ""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    colwise = style == COLWISE
    if isinstance(module, torch.nn.Linear):  # weight (out, in)
        out = [(weight, (MODEL_AXIS, None) if colwise else (None, MODEL_AXIS))]
        return out + ([(bias, (MODEL_AXIS,) if colwise else ())] if bias is not None else [])
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 layer: (in, out)
        return [(weight, (None, MODEL_AXIS) if colwise else (MODEL_AXIS, None)),
                (bias, (MODEL_AXIS,) if colwise else ())]
    if isinstance(module, torch.nn.Embedding):  # (rows, dim): column-wise splits the embedding dim
        return [(weight, (None, MODEL_AXIS) if colwise else (MODEL_AXIS, None))]
    if optional:
        return []
    raise ValueError(f"module {path} is a {type(module).__name__}; 'colwise' / 'rowwise' apply to nn.Linear, "
                     "Conv1D and nn.Embedding. Lay its parameters out with PartitionSpecs by parameter name "
                     f"instead ({{'{prefix}weight': PartitionSpec(...)}})")


def describe(model: torch.nn.Module, specs: dict[int, P], rows: P | None = None, pool: Any = None) -> dict[str, P]:
    """Parameter name -> its layout, for `TrainStep.shardings()` (`rows`: a data-parallel step's
    layout of a ShardedEmbedding's rows; `pool`: the step's state, whose stacks of pipelined
    layers are named as one, `train/_stages.py`)."""
    from tpudist.compile._torch._custom_ops import SHARDED_ATTR
    out = {name: rows if rows is not None and getattr(p, SHARDED_ATTR, False) else specs.get(id(p), P())
           for name, p in model.named_parameters()}
    stacking = getattr(pool, "stacking", None)
    return out if stacking is None else stacking.describe(model, pool.layout, out)
