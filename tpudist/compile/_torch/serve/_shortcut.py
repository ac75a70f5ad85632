"""A batch's whole decode inside the device loop, its first decode step included.

The decode loop (serve/_decode) is built around the graph dynamo traced for one decode step, and a
bucket's first batch learns that graph by running its first decode step through dynamo. A later
batch with the same prefill program need not: if dynamo's own guard of that step's cache entry
holds for the batch's first decode step (module/_guards), dynamo would run the same graph, so the
loop runs it from the first step. What the graph is called with is named once, by where the first
batch's inputs came from: the prefill's inputs (the parameters), the step's own inputs by role
(ids, mask, positions), or the static cache's attributes (the tensors the cache creates inside the
prefill). Where any of that does not hold, the first step goes through dynamo as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tpudist.compile._torch.module._guards import FrameGuard


@dataclass
class Shortcut:
    """How a batch whose prefill ran the program `prefill` decodes from its first step inside
    `loop`: dynamo's guard of the decode step, where each of its flat inputs comes from
    (`sources_of`), its graph (serve/_decode's record of it), program and loop."""

    prefill: Any  # the prefill's program (kept alive: its id is the key)
    guard: FrameGuard
    sources: list[tuple[str, Any]]
    graph: Any
    program: Any
    loop: Any

    def leaves(self, prefill: tuple, roles: dict[str, torch.Tensor], cache: Any) -> list[Any] | None:
        """The decode step's flat inputs in this batch; None where one is not where it was."""
        leaves = []
        for kind, key in self.sources:
            leaf = roles[key] if kind == "role" else prefill[key] if kind == "prefill" else _follow(cache, key)
            if not isinstance(leaf, torch.Tensor):
                return None
            leaves.append(leaf)
        return leaves


def sources_of(decode: tuple, prefill: tuple, roles: dict[str, torch.Tensor],
               cache: Any) -> list[tuple[str, Any]] | None:
    """Where each of the decode step's flat inputs `decode` came from: ("role", name) for a tensor
    of `roles`, ("prefill", position) for one of the prefill's flat inputs `prefill`, ("cache",
    path) for one the cache holds; None where an input is none of these."""
    by_role = {id(t): role for role, t in roles.items()}
    by_prefill = {id(t): j for j, t in enumerate(prefill) if isinstance(t, torch.Tensor)}
    in_cache = _tensor_paths(cache)
    sources: list[tuple[str, Any]] = []
    for leaf in decode:
        if not isinstance(leaf, torch.Tensor):
            return None
        if id(leaf) in by_role:
            sources.append(("role", by_role[id(leaf)]))
        elif id(leaf) in by_prefill:
            sources.append(("prefill", by_prefill[id(leaf)]))
        elif id(leaf) in in_cache:
            sources.append(("cache", in_cache[id(leaf)]))
        else:
            return None  # no way to name it for a later batch
    return sources


def _tensor_paths(root: Any, depth: int = 3) -> dict[int, tuple]:
    """The path (attribute names, list indices, dict keys) to each tensor reachable from `root` in
    at most `depth` steps, by the tensor's id."""
    found: dict[int, tuple] = {}

    def walk(value: Any, path: tuple, left: int) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), path)
        elif left and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, (*path, ("item", i)), left - 1)
        elif left and isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*path, ("item", key)), left - 1)
        elif left and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
            for name, item in vars(value).items():
                walk(item, (*path, ("attr", name)), left - 1)
    walk(root, (), depth)
    return found


def _follow(root: Any, path: tuple) -> Any:
    """What `path` (of `_tensor_paths`) reaches from `root` now; None where it reaches nothing."""
    try:
        for kind, key in path:
            root = getattr(root, key) if kind == "attr" else root[key]
    except (AttributeError, LookupError, TypeError):
        return None
    return root
