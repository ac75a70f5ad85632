"""`CompiledModule`: what `tpudist.compile(module)` returns for a torch.nn.Module."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from tpudist import _stacks
from tpudist.compile._torch.lowering._capture import autocast_state, capture
from tpudist.compile._torch.lowering._observed import recaptured
from tpudist.compile._torch.module._program import Program
from tpudist.compile._torch._stats import CaptureStats
from tpudist.compile._torch._layout import capturing, layout_of_tensor
from tpudist.compile._torch.lowering._parallel import EXPERT_AXIS
from tpudist.compile._torch._sync import leaf_key, sync_module


@dataclass
class TorchCompileStats(CaptureStats):
    """Counters of one compiled module: `compiles` (input signatures, non-tensor values included,
    captured and lowered), `calls` and `capture_seconds` as in `CaptureStats`, and

    cache_hits: calls served by an already compiled signature.
    executables: XLA executables built so far (forward, forward-with-VJP, backward per signature).
    """

    cache_hits: int = 0
    executables: int = 0


class CompiledModule(torch.nn.Module):
    """A torch.nn.Module whose forward and backward run as XLA executables.

    It wraps (does not copy) the original module, registered as `.module`: parameters, buffers,
    `.grad`s, train/eval mode and optimizers are the original's. Attributes it does not define are
    read from the original, so `cm.fc` is `module.fc`; `state_dict()` keys carry the `module.`
    prefix, so save checkpoints from the original module.

    Example:
        cm = tpudist.compile(model)
        loss = torch.nn.functional.cross_entropy(cm(x), y)
        loss.backward()                         # fills model's .grad, computed by XLA
        optimizer.step()                        # any torch.optim optimizer over model.parameters()
    """

    def __init__(self, module: torch.nn.Module, long_lived: frozenset[int] = frozenset()):
        super().__init__()
        self.module = module
        # flat input positions that hold parameters or buffers (dynamo passes them as inputs): viewed once
        self._long_lived = long_lived
        self._keyed: list[int] | None = None  # the other positions, the only ones in the cache key
        self._stats = TorchCompileStats()
        self._programs: dict[Any, Program] = {}
        self.last_program: Program | None = None  # the program of the latest call
        self._submodules = list(module.modules())

    @property
    def stats(self) -> TorchCompileStats:
        """This module's counters (see TorchCompileStats)."""
        self._stats.executables = sum(p.executables() for p in self._programs.values())
        return self._stats

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sync_module(self.module)  # a fused step training this module may hold newer values
        stats = self._stats
        stats.calls += 1
        _stacks.entered("compiled module")  # progress for the launcher's --hang-timeout
        leaves, key = self._key(args, kwargs)
        program = self._programs.get(key)
        guard = program.captured.guard if program is not None else None
        if guard is not None and not guard.holds(leaves):  # a data-dependent value changed
            program = None
            recaptured(stats, guard, type(self.module).__name__)
        if program is None:
            laid = next(filter(None, map(layout_of_tensor, self.module.parameters())), None)
            with capturing(itertools.chain(self.module.parameters(), leaves)):  # a laid-out model's placeholders
                # laid out over an "expert" axis: transformers' experts modules as one op (expert parallelism)
                captured = capture(self.module, args, kwargs,
                                   experts=laid is not None and EXPERT_AXIS in laid.mesh.axis_names)
            program = self._programs[key] = Program(self.module, captured, self._long_lived)
            stats.compiles += 1
            stats.capture_seconds += captured.seconds
        else:
            stats.cache_hits += 1
        self.last_program = program
        return program(leaves)

    def program_for(self, leaves: list[Any]) -> Program | None:
        """The program a call with dynamo's flat inputs `leaves` would run now, brought up to date
        as a call brings it (`sync_module`), without running it; None where that call would capture."""
        sync_module(self.module)
        leaves, key = self._key(tuple(leaves), {})
        program = self._programs.get(key)
        guard = program.captured.guard if program is not None else None
        return None if guard is not None and not guard.holds(leaves) else program

    def _key(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
        """A call's flat inputs and the key of its program."""
        if self._long_lived and not kwargs:
            # dynamo's flat call: its guards already pin the parameters' and buffers' shapes and dtypes
            leaves, spec = list(args), len(args)
            if self._keyed is None:
                self._keyed = [i for i in range(len(args)) if i not in self._long_lived]
            keyed = [args[i] for i in self._keyed]
        elif not kwargs and all(type(a) is torch.Tensor for a in args):
            # the common call, cm(x) / cm(x, y): no pytree walk (tens of us a call)
            leaves, spec = list(args), len(args)
            keyed = leaves
        else:
            leaves, spec = tree_flatten((args, kwargs))
            keyed = leaves
        key = (tuple(m.training for m in self._submodules), spec, tuple(leaf_key(leaf) for leaf in keyed),
               autocast_state())
        return leaves, key

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("module")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __repr__(self) -> str:
        return f"CompiledModule({self.module!r})"


def compile_module(module: torch.nn.Module, **options: Any) -> CompiledModule:
    """Compiles `module`'s forward and backward through XLA; returns a CompiledModule.

    Capture (torch.export) happens on the first call and again only for a new input signature or
    train/eval mode; `cm.stats` counts it. Called by `tpudist.compile(module)`.

    Example:
        cm = tpudist.compile(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()))
        y = cm(torch.randn(2, 8))
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"compile_module expects a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, CompiledModule):
        return module
    if options:
        # the data-parallel form (mesh=, a fused optimizer step) is tpudist.compile_train_step's job
        raise TypeError(f"tpudist.compile(torch.nn.Module) takes no options yet; got {sorted(options)}. "
                        "For data-parallel training use tpudist.optimizer_step or tpudist.compile_train_step.")
    return CompiledModule(module)
