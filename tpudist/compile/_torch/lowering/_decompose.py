"""Decomposing an exported program to core ATen, without torch's fixed cost per call.

`ExportedProgram.run_decompositions(table)` pays a setup on every call, however small the graph,
that costs several times the tracing of a small one: it sorts the table into CompositeImplicitAutograd
(CIA) ops and the rest by walking every registered op of every namespace, then patches the Python
kernels of all ~500 CIA ops it found (to decompose below autograd, or to keep the op whole) and
restores them afterwards.

`decompose` sorts the table once (again only when ops have been registered since) and patches only
the CIA ops whose patch can change the graph: the ones the graph itself calls (patched, they
decompose below autograd, where a CIA kernel may choose otherwise: `matmul` of a weight that needs
a gradient becomes `bmm` there and a folded `mm` above) and the ones the table keeps whole or
decomposes its own way. A CIA op reached only from inside another op's decomposition runs below
autograd either way. The graph is the one `run_decompositions` gives (tests/compile/
test_decompose.py compares the two on models and OpInfo samples). Where torch's internals are not
the ones this was written against (torch 2.13 and 2.14), it calls `run_decompositions`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tpudist.compile._torch.lowering._registry import torch_decompositions


@functools.lru_cache(maxsize=1)
def decompositions() -> dict[Any, Any]:
    """The table: torch.export's core-ATen decompositions, tpudist's own added, the ops it lowers
    whole removed (building it costs ~0.4 s per export when left to run_decompositions)."""
    table = torch.export.default_decompositions()
    extra, kept = torch_decompositions()
    table.update(extra)
    for op in kept:
        table.pop(op, None)
    return table


def decompose(program: torch.export.ExportedProgram,
              table: dict[Any, Any] | None = None) -> torch.export.ExportedProgram:
    """`program.run_decompositions(table)` (default: `decompositions()`), the same graph, without
    the per-call setup."""
    table = decompositions() if table is None else table
    internals = _internals()
    if internals is None:
        return program.run_decompositions(table)
    split, decompose_program = internals
    special, own_kernel, python_table = _sorted(split, table)
    cia = {**special, **{op: own_kernel[op] for op in _graph_ops(program) if op in own_kernel}}
    return decompose_program(program, cia_to_decomp=cia, python_decomp_table=dict(python_table),
                             joint_loss_index=None, decompose_custom_triton_ops=False)


def _graph_ops(program: torch.export.ExportedProgram) -> set[Any]:
    """The ops the program calls, in its graph and in the subgraphs of its higher-order ops."""
    return {node.target for module in program.graph_module.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes if node.op == "call_function"}


def _internals() -> tuple[Any, Any] | None:
    """torch's two halves of run_decompositions (checked on torch 2.13 and 2.14), or None."""
    from torch.export import exported_program as ep
    split = getattr(ep, "_split_decomp_table_to_cia_and_python_decomp", None)
    decompose_program = getattr(ep, "_decompose_exported_program", None)
    return None if split is None or decompose_program is None else (split, decompose_program)


def _registered() -> tuple[int, int]:
    """Changes when ops are registered (what the sorted table depends on); ~0.2 ms."""
    return (len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
            len(torch.ops._dir))


_SORTED: dict[tuple[int, tuple[int, int]], tuple[dict, ...]] = {}  # (id(table), _registered()) -> (table, ...)


def _sorted(split: Any, table: dict[Any, Any]) -> tuple[dict, dict, dict]:
    """The table sorted as run_decompositions sorts it, its CIA part in two: the ops it keeps whole
    or decomposes its own way, and those it hands back to their own CIA kernel. Kept per table (by
    identity; the table is held so that its id stays its own) and per set of registered ops."""
    key = (id(table), _registered())
    if key not in _SORTED:
        if len(_SORTED) >= 4:
            _SORTED.clear()
        cia, python_table = split(dict(table))
        own = {op: fn for op, fn in cia.items() if _own_kernel(fn)}
        special = {op: fn for op, fn in cia.items() if op not in own}
        _SORTED[key] = (table, special, own, python_table)
    return _SORTED[key][1:]


def _own_kernel(fn: Any) -> bool:
    """Whether `fn` is torch's "decompose with the op's C++ CIA kernel" (`_get_decomp_for_cia`)."""
    return isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "_special_op_to_decompose_cia"
