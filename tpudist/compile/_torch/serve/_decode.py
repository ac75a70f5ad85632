"""Greedy decoding on the device: `tpudist.generate`'s decode loop as one XLA program.

Hugging Face's `generate()` runs its loop in Python: per token, dynamo's guards, the compiled
call, the logits read back, the argmax and the mask update on the host. At small batches that host
round trip is most of a token. Here the prefill runs as a compiled call (`torch.compile(backend=
"tpudist")` of one forward with a static KV cache, as `generate` would make it), and the decode
steps run inside one `jax.lax.while_loop` around the decode step's own lowered graph: the argmax,
the attention mask, the positions and the cache stay on the device, and the host reads the tokens
once, at the end. A bucket's first batch runs its first decode step as a compiled call too, which
is how the loop learns the step's graph; later batches start inside the loop where dynamo's own
guard of that step holds (serve/_shortcut).

The step is the model's forward as `generate` calls it for a decoder-only model with a static cache:
`input_ids`, a 2-D attention mask over the whole cache (1 for the prompt's tokens and each token fed
so far), `position_ids` counted over that mask as `prepare_inputs_for_generation` counts them
(left padding), `cache_position` and the cache. Rows that produced an end-of-sequence token then get
`pad` tokens, as `generate` gives them. Greedy tokens equal `generate`'s (tested against eager torch).

A model laid out over a mesh (`tpudist.parallelize`, processes included) runs the same loop over
its mesh: the weights and the cache as the layout splits them, the rest replicated, every process
running the one program and reading the same tokens.

Where the decode step cannot run inside the loop (a graph break, random numbers in the graph, an
input of the step that changes per token and is not one of the above), the same compiled step runs
token by token from Python instead: slower, never different.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpudist.compile._torch._convert import jax_dtype, to_jax, where
from tpudist.compile._torch.module._dynamo import backend
from tpudist.compile._torch.module._guards import frame_guard
from tpudist.compile._torch.module._laid_out import whole
from tpudist.compile._torch.module._module import CompiledModule
from tpudist.compile._torch.module._program import long_lived, loop_arrays, loop_graph, slot_tensors
from tpudist.compile._torch.serve._shortcut import Shortcut, sources_of


@dataclass
class _Graph:
    """One graph dynamo handed over for the step, and the flat inputs of its latest call."""

    module: CompiledModule
    calls: int = 0
    last: tuple = ()


@dataclass
class _Loop:
    """The decode step's lowered graph inside a while loop: the slots it feeds per token."""

    jitted: Any
    roles: dict[str, int]  # "ids", "mask", "position_ids", "cache_position" -> input position
    carried: list[tuple[int, int]]  # (output, input) of each input the graph writes (the cache)
    logits: int  # the output position of the last token's logits


class DecodeLoop:
    """Greedy generation for one decoder-only Hugging Face model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)  # tpudist.generate keeps one loop per model while the model lives
        parameters = inspect.signature(model.forward).parameters
        self._cache_name = "cache" if "cache" in parameters else "past_key_values"  # transformers 5.25 renamed it
        self._position_ids = "position_ids" in parameters
        self._cache_position = "cache_position" in parameters
        self._graphs: list[_Graph] = []
        # by id of the decode graph's program: (that program, its loop or None where it runs from Python)
        self._loops: dict[int, tuple[Any, _Loop | None]] = {}
        self._shortcuts: dict[int, Shortcut] = {}  # by id of the prefill's program (see _shortcut)
        self._arguments = list(inspect.signature(DecodeLoop._forward).parameters)  # the step frame's locals
        self.on_device = True  # whether the last batch's decode ran inside the loop
        self.first_steps_on_device = 0  # batches whose first decode step ran inside the loop too (see _shortcut)
        self._step = torch.compile(self._forward, backend=self._record, dynamic=False)

    @property
    def executables(self) -> int:
        """How many XLA executables of the loop have been compiled so far."""
        loops = [loop for _, loop in self._loops.values() if loop is not None]
        return sum(getattr(loop.jitted, "_cache_size", lambda: 0)() for loop in loops)

    # -- the compiled step ---------------------------------------------------------------------

    def _forward(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                 cache_position: torch.Tensor, cache: Any) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, self._cache_name: cache,
                                  "use_cache": True}
        if self._position_ids:
            kwargs["position_ids"] = position_ids
        if self._cache_position:
            kwargs["cache_position"] = cache_position
        # a forward the user compiled already (Hugging Face's recipe): its own Python, traced here
        forward = getattr(model.__dict__.get("forward"), "_torchdynamo_orig_callable", model)
        return forward(**kwargs).logits[:, -1, :]

    def _record(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        forward = backend(gm, example_inputs)
        graph = _Graph(forward.__self__)
        self._graphs.append(graph)

        def call(*args: Any) -> Any:
            graph.calls += 1
            graph.last = args
            return forward(*args)
        call.graph = graph  # how the step frame's cache entry names its graph (see _guards)
        return call

    def _called(self, before: list[int]) -> list[_Graph]:
        """The graphs called since their call counts were `before`."""
        return [g for g, n in zip(self._graphs, before) if g.calls != n] + self._graphs[len(before):]

    # -- one batch -----------------------------------------------------------------------------

    def run(self, ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int, cache_len: int, pad: int,
            eos: set[int]) -> torch.Tensor:
        """The `new_tokens` greedy tokens after each row of `ids` (left-padded, `prompt_mask` 0 at the
        padding): (batch, new_tokens), `pad` after a row's end-of-sequence token."""
        from transformers import StaticCache
        batch, length = ids.shape
        model = self._model()
        cache = StaticCache(config=model.config, max_cache_len=cache_len)  # this batch's alone
        mask = torch.zeros((batch, cache_len), dtype=torch.long)
        mask[:, :length] = prompt_mask
        eos_ids = torch.tensor(sorted(eos), dtype=torch.long)
        done = torch.zeros(batch, dtype=torch.bool)
        tokens: list[torch.Tensor] = []
        self.on_device = True

        def pick(logits: torch.Tensor) -> torch.Tensor:
            nonlocal done
            token = logits.argmax(-1).masked_fill(done, pad)
            done = done | torch.isin(token, eos_ids)
            tokens.append(token)
            return token[:, None]

        def inputs_at(token: torch.Tensor) -> dict[str, torch.Tensor]:
            """The decode step's inputs by role, feeding `token` at `position`."""
            mask[:, position] = 1
            return {"ids": token, "mask": mask, "position_ids": mask.sum(-1, keepdim=True) - 1,
                    "cache_position": torch.tensor([position])}

        def decode(token: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            """One decode step from Python (its inputs by role made here where not given): the next
            token, and those inputs."""
            nonlocal position
            inputs = inputs_at(token) if inputs is None else inputs
            position += 1
            return pick(self._step(model, *inputs.values(), cache)), inputs

        try:
            with torch.no_grad():
                position_ids = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
                before = [g.calls for g in self._graphs]
                token = pick(self._step(model, ids, mask, position_ids, torch.arange(length), cache))
                prefill = self._called(before)
                position = length
                if new_tokens > 1 and not done.all():
                    inputs = inputs_at(token)
                    found = self._shortcut(prefill, inputs, model, cache)
                    if found is not None:  # the whole decode inside the loop, from its first step
                        shortcut, leaves = found
                        tokens.extend(_run_loop(shortcut.loop, shortcut.program, leaves, token, mask, done,
                                                position, new_tokens - 1, new_tokens - 1, pad, eos))
                        self.first_steps_on_device += 1
                    else:
                        before = [g.calls for g in self._graphs]
                        token, inputs = decode(token, inputs)
                        called = self._called(before)
                        leaves = [g.last for g in called]
                        rest = new_tokens - 2
                        loop = self._loop_of(called, leaves, inputs) if rest > 0 else None
                        self.on_device = loop is not None or rest <= 0
                        if loop is not None:
                            self._remember(prefill, called[0], inputs, model, cache, loop)
                        if loop is not None and not done.all():
                            tokens.extend(_run_loop(loop, called[0].module.last_program, leaves[0], token,
                                                    mask, done, position, rest, new_tokens - 1, pad, eos))
                        else:
                            for _ in range(rest):
                                if done.all():
                                    break
                                token, _ = decode(token)
        finally:
            for graph in self._graphs:
                graph.last = ()  # the flat inputs hold the cache: not kept past this batch
        out = torch.full((batch, new_tokens), pad, dtype=torch.long)
        joined = torch.stack(tokens, 1)[:, :new_tokens]
        out[:, :joined.shape[1]] = joined
        return out

    # -- a batch's decode on the device from its first step --------------------------------------

    def _frame(self, inputs: dict[str, torch.Tensor], model: torch.nn.Module, cache: Any) -> dict[str, Any]:
        """The decode step frame's arguments by name (what dynamo's guards read)."""
        return dict(zip(self._arguments, (self, model, *inputs.values(), cache)))

    def _remember(self, prefill: list[_Graph], decode: _Graph, inputs: dict[str, torch.Tensor],
                  model: torch.nn.Module, cache: Any, loop: _Loop) -> None:
        """After a batch's first decode step ran through dynamo (graph `decode`, inputs `inputs` by
        role) and its loop was built: how a later batch with the same prefill program starts inside
        the loop (see `_shortcut`). Only one graph each, on one device, and every input of the step
        one of the prefill's, a role's or the cache's (serve/_shortcut)."""
        if len(prefill) != 1 or prefill[0] is decode:
            return
        program, first = decode.module.last_program, prefill[0].module.last_program
        if first is None or program is None or loop_graph(first)[2] or loop_graph(program)[2]:
            return  # laid out over a mesh: every process must take the same path; it keeps dynamo's
        sources = sources_of(decode.last, prefill[0].last, inputs, cache)
        if sources is None:
            return
        guard = frame_guard(DecodeLoop._forward, lambda f: getattr(f, "graph", None) is decode)
        if guard is None or not guard.holds(self._frame(inputs, model, cache)):
            return
        self._shortcuts[id(first)] = Shortcut(first, guard, sources, decode, program, loop)

    def _shortcut(self, prefill: list[_Graph], inputs: dict[str, torch.Tensor], model: torch.nn.Module,
                  cache: Any) -> tuple[Shortcut, list[Any]] | None:
        """The loop that runs this batch's decode from its first step, and that step's flat inputs,
        where an earlier batch with the same prefill program remembered one and dynamo's own guard
        of its decode graph holds for this batch's first decode step (`inputs`): the step dynamo
        would run. None: the first step goes through dynamo."""
        if len(prefill) != 1:
            return None
        shortcut = self._shortcuts.get(id(prefill[0].module.last_program))
        if shortcut is None or shortcut.prefill is not prefill[0].module.last_program:
            return None
        if not shortcut.guard.holds(self._frame(inputs, model, cache)):
            return None
        leaves = shortcut.leaves(prefill[0].last, inputs, cache)
        if leaves is None or shortcut.graph.module.program_for(leaves) is not shortcut.program:
            return None
        return shortcut, leaves

    # -- the loop around the decode graph -----------------------------------------------------

    def _loop_of(self, called: list[_Graph], leaves: list[tuple], known: dict[str, torch.Tensor]) -> _Loop | None:
        """The loop around the decode graph that just ran (its flat inputs `leaves`), or None where
        it cannot run in one."""
        if len(called) != 1:
            return None  # a graph break: the step is several graphs with Python between them
        program = called[0].module.last_program
        kept = self._loops.get(id(program))
        if kept is not None and kept[0] is program:
            return kept[1]
        loop = _build(program, leaves[0], known)
        self._loops[id(program)] = (program, loop)  # the program kept alive: its id names no other
        return loop


# -- building and running the loop -----------------------------------------------------------

def _build(program: Any, leaves: tuple, known: dict[str, torch.Tensor]) -> _Loop | None:
    """The loop around `program`'s decode step (called with the flat inputs `leaves`, `known`: its
    inputs by role), or None where the step cannot run in one."""
    if program is None or program.captured.has_random:
        return None
    tensors = slot_tensors(program, list(leaves))
    infer, written, _ = loop_graph(program)  # written: output -> input position
    carried = sorted(written.items())
    writes = set(written.values())
    by_id = {id(t): role for role, t in known.items()}
    roles: dict[str, int] = {}
    for i, tensor in enumerate(tensors):
        if long_lived(program, i) or i in writes:
            continue
        role = by_id.get(id(tensor))
        if role is None:
            return None  # an input that may change per token and is none of the step's own
        roles[role] = i
    if "ids" not in roles:
        return None
    users = [j for j, o in enumerate(program.captured.outputs) if o.kind == "user"]
    if len(users) != 1:
        return None
    logits = users[0]

    def loop(fixed: list[Any], cache: list[jax.Array], token: jax.Array, mask: jax.Array, done: jax.Array,
             position: jax.Array, steps: jax.Array, pad: jax.Array, eos: jax.Array, width: int) -> jax.Array:
        out = jnp.full((token.shape[0], width), pad, token.dtype)  # steps <= width: one executable for both

        def running(carry):
            i, _, _, _, done, _ = carry
            return (i < steps) & ~jnp.all(done)

        def step(carry):
            i, token, mask, cache, done, out = carry
            here = position + i
            mask = mask.at[:, here].set(1)
            full = list(fixed)
            full[roles["ids"]] = token[:, None].astype(fixed_dtypes["ids"])
            if "mask" in roles:
                full[roles["mask"]] = mask.astype(fixed_dtypes["mask"])
            if "position_ids" in roles:
                full[roles["position_ids"]] = (mask.sum(-1, keepdims=True) - 1).astype(fixed_dtypes["position_ids"])
            if "cache_position" in roles:
                full[roles["cache_position"]] = jnp.reshape(here, (1,)).astype(fixed_dtypes["cache_position"])
            for (_, position_in), value, shape in zip(carried, cache, shapes):
                full[position_in] = value.reshape(shape)
            outs = infer(full, None)
            token = jnp.where(done, pad, jnp.argmax(outs[logits], -1).astype(token.dtype))
            done = done | jnp.isin(token, eos)
            return i + 1, token, mask, [_squeezed(outs[o]) for o, _ in carried], done, out.at[:, i].set(token)

        shapes = [value.shape for value in cache]
        start = (jnp.int32(0), token, mask, [_squeezed(value) for value in cache], done, out)
        end = jax.lax.while_loop(running, step, start)
        return end[5], [value.reshape(shape) for value, shape in zip(end[3], shapes)]  # donated: the new cache

    fixed_dtypes = {role: jax_dtype(tensors[i].dtype) for role, i in roles.items()}  # (int64 -> int32)
    return _Loop(jax.jit(loop, static_argnums=9, donate_argnums=1), roles, carried, logits)


def _squeezed(value: jax.Array) -> jax.Array:
    """A cache array as the loop carries it: without its leading dims of size 1 (a batch of one),
    the shape in which ops/index.py writes its row and XLA's dots read it (a carry of another
    shape makes XLA:CPU write the row twice a step and copy the array around it)."""
    lead = [n for n in value.shape[:-2] if n != 1]
    return value.reshape(*lead, *value.shape[-2:]) if len(lead) < value.ndim - 2 else value


def _run_loop(loop: _Loop, program: Any, leaves: tuple | list, token: torch.Tensor, mask: torch.Tensor,
              done: torch.Tensor, position: int, steps: int, width: int, pad: int, eos: set[int]) -> list[torch.Tensor]:
    """`steps` decode steps inside `loop` from `token` at `position`: their tokens (`width`: the
    most steps any batch of these new tokens runs, which sizes the loop's output)."""
    layout = loop_graph(program)[2]
    device = where(None).device
    fixed, cache = loop_arrays(program, list(leaves), device, [i for _, i in loop.carried],
                               frozenset(loop.roles.values()))  # (the roles: fed by the loop)
    # replicated over a layout's mesh (every process passes the same), else on the device
    put = layout.put if layout else (lambda tensor: to_jax(tensor, device=device))
    out, _ = loop.jitted(fixed, cache, put(token[:, 0].to(torch.int32)), put(mask.to(torch.int32)), put(done),
                         np.int32(position), np.int32(steps), np.int32(pad),
                         np.asarray(sorted(eos) or [-1], np.int32), width)
    out = np.asarray(whole(out, layout) if layout else out)  # (whole: a host array of JAX's)
    return list(torch.from_numpy(out[:, :steps].astype(np.int64)).unbind(1))
