"""`tpudist.compile`: one entry point for JAX functions and torch.nn.Modules."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tpudist.compile._jax_step import CompiledStep
    from tpudist.compile._torch.module._module import CompiledModule


def compile(fn: Callable[..., Any] | torch.nn.Module, *, mesh: Any = None, in_specs: Any = None,
            out_specs: Any = None, donate_argnums: int | Sequence[int] = (),
            static_argnums: int | Sequence[int] = (), per_device: bool = False,
            name: str | None = None) -> CompiledStep | CompiledModule:
    """Compiles a JAX function into an SPMD step over `mesh`, or a torch.nn.Module into a module
    whose forward and backward run as XLA executables.

    A JAX function (`mesh` required, a `jax.sharding.Mesh` from `tpudist.mesh.make_mesh`):

    - `in_specs`: None (every argument replicated), a PartitionSpec for every argument, or a tuple
      with one entry per positional argument (a PartitionSpec, None, or a tree of them). Arguments
      that are not already global arrays on the mesh are this process's local part (its rows for
      `P("data")`) and are assembled into global arrays.
    - `out_specs`: the outputs' layout (a PartitionSpec or a tree of them); None lets XLA choose.
    - `donate_argnums`: arguments whose buffers XLA may reuse for the outputs (params, optimizer
      state); `static_argnums`: hashable Python values baked into the program.
    - `per_device=True` runs `fn` under `jax.shard_map` on each device's block, where in-graph
      collectives by axis name work (`jax.lax.psum(x, "data")`); `out_specs` is then required.
    - `name` labels the step in logs and `compile_stats()`.

    Returns a `CompiledStep`: call it with the same arguments on every process; each new
    signature compiles once (persistent cache on). See docs/mesh_and_compile.md.

    A `torch.nn.Module` takes no options and returns a `CompiledModule`: the same module, its
    forward and backward captured with torch.export and run by XLA; `.grad`s, optimizers and
    train/eval mode work as in eager torch. See docs/torch.md.

        step = tpudist.compile(train_step, mesh=mesh, in_specs=(None, None, P("data")), donate_argnums=(0, 1))
        cm = tpudist.compile(model)
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(fn, torch.nn.Module):
        options = {k: v for k, v in dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                          donate_argnums=donate_argnums, static_argnums=static_argnums,
                                          per_device=per_device, name=name).items()
                   if v not in (None, (), False)}
        from tpudist.compile._torch import compile_module
        return compile_module(fn, **options)
    if not callable(fn):
        raise TypeError(f"tpudist.compile expects a JAX function or a torch.nn.Module, got {type(fn).__name__}")
    from tpudist.compile._jax_step import compile_jax
    return compile_jax(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, donate_argnums=donate_argnums,
                       static_argnums=static_argnums, per_device=per_device, name=name)


# `import tpudist.compile._torch as t` resolves `compile` on `tpudist` (this function) and then, when
# the attribute is missing, looks the submodule up in sys.modules under `<its __name__>._torch`
compile.__name__ = "tpudist.compile"
