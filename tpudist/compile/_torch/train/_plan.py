"""What a captured train step reads: the objective captured, and each graph input classified.

`Objective` is the module torch.export captures for the fused step: the model and the loss
together. `plan(...)` sorts the captured graph's tensor inputs into

- *trainable parameters*: in the optimizer, used by the loss, `requires_grad`; each is a position
  in the step's layout (every optimizer parameter, in param-group order, see `Layout`);
- *updated state*: buffers the graph writes back (BatchNorm's running statistics);
- *fixed state*: everything else it reads (frozen parameters, other buffers, lifted constants);
- *batch leaves*: the user's inputs.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tpudist.compile._torch.train import _optim
from tpudist.compile._torch.lowering._captured import Captured, Slot, resolver
from tpudist.compile._torch._custom_ops import SHARDED_ATTR

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Feed(enum.StrEnum):
    """Which of the step's arguments feeds a graph input (see the module docstring)."""

    PARAM = "param"      # the step's parameters, by layout position
    FIXED = "fixed"      # state read, never written
    UPDATED = "updated"  # buffers the graph writes back
    BATCH = "batch"      # the user's batch leaves


class Source(NamedTuple):
    """Where one graph input comes from: `index` into the argument `kind` names."""

    kind: Feed
    index: int


class StateRead(NamedTuple):
    """A piece of model state a graph reads: its key (the tensor's path in the model) and a getter
    of the torch tensor that holds it."""

    key: str
    get: Callable[[], torch.Tensor]


class Objective(torch.nn.Module):
    """The loss of one batch as one module, so one export captures model and loss together:
    `loss_fn(model(*batch[:-1]), batch[-1])`, or with no loss_fn the loss the model computes itself
    (`model(**batch).loss` for a dict batch, as Hugging Face models do when given `labels`)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # registered as a submodule when it is one (nn.CrossEntropyLoss())

    def forward(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.model(*batch[:-1]), batch[-1])
        return model_loss(call_model(self.model, batch))


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """`model(**batch)` for a mapping, `model(*batch)` for a tuple or list, else `model(batch)`."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model returned: `output.loss` (a Hugging Face `ModelOutput`), `output["loss"]`,
    the first element of a tuple, or the output itself when it is a tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss_fn=None: the model returned {type(output).__name__} with no loss; put the "
                         "targets in the batch (e.g. {'input_ids': ..., 'labels': ...} for a Hugging Face "
                         "model) or pass loss_fn=")
    return loss


@dataclass(frozen=True)
class LayoutEntry:
    """One optimizer parameter: where it sits in the step's state, and how it is updated."""

    param: torch.nn.Parameter
    config: _optim.ParamConfig
    group: int          # index of its param group (its row of the hyperparameter table)
    sharded: bool       # a ShardedEmbedding block: rows split over the devices


class Layout:
    """Every parameter of the optimizer, in param-group order: the order of the step's parameter,
    optimizer-state and step-count arrays, shared by every compiled signature of one step."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: _optim.OptimizerKind):
        entries, seen = [], set()
        for g, group in enumerate(optimizer.param_groups):
            config = _optim.config(kind, optimizer, group)
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    entries.append(LayoutEntry(p, config, g, bool(getattr(p, SHARDED_ATTR, False))))
        self.entries: list[LayoutEntry] = entries
        self.position = {id(e.param): i for i, e in enumerate(entries)}

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class Plan:
    """How one captured graph is fed and read.

    slots: per tensor input of the graph, its `Source` (PARAM: a layout position);
    trainable: layout positions this graph trains (the others pass through unchanged);
    fixed, updated: the state read, and the buffers written back, in the order of the step's
        arguments; update_outputs: graph output positions of the updated buffers, in the same
        order; batch_leaves: positions in the flattened batch;
    loss_output: graph output position of the loss.
    """

    slots: list[Source]
    trainable: list[int]
    fixed: list[StateRead]
    updated: list[StateRead]
    update_outputs: list[int]
    batch_leaves: list[int]
    loss_output: int


def plan(captured: Captured, objective: Objective, layout: Layout) -> Plan:
    """Classifies `captured`'s inputs (see the module docstring); ValueError / TypeError naming
    the parameter and the fix where the step cannot train the graph."""
    losses = [i for i, o in enumerate(captured.outputs) if o.kind == Slot.USER]
    loss_val = captured.output_values[losses[0]] if len(losses) == 1 else None
    if len(losses) != 1 or loss_val is None or math.prod(loss_val[0]) != 1 or not loss_val[1].is_floating_point:
        raise ValueError(f"loss_fn must return one floating scalar (e.g. a mean-reduced loss); it returned "
                         f"{None if loss_val is None else torch.Size(loss_val[0])!r}")
    if any(o.kind == Slot.INPUT for o in captured.outputs):
        raise ValueError("the model writes into its inputs in place; the fused step cannot return that")
    written = {o.target: i for i, o in enumerate(captured.outputs) if o.kind == Slot.BUFFER}
    slots: list[Source] = []
    trainable: list[int] = []
    fixed: list[StateRead] = []
    updated: list[StateRead] = []
    update_outputs: list[int] = []
    batch_leaves: list[int] = []
    for slot in captured.inputs:
        if slot.kind == Slot.LITERAL:
            continue
        if slot.kind == Slot.INPUT:
            slots.append(Source(Feed.BATCH, len(batch_leaves)))
            batch_leaves.append(slot.leaf)
            continue
        resolve = resolver(objective, slot, captured)
        get = lambda resolve=resolve: resolve(None)  # noqa: E731
        tensor = get()
        position = layout.position.get(id(tensor)) if slot.kind == Slot.PARAM else None
        if position is not None and slot.used and tensor.requires_grad:
            if tensor.dtype not in PARAM_DTYPES:
                raise TypeError(f"parameter {slot.name[len('model.'):]} is {tensor.dtype}; the fused step "
                                "trains float32 / bfloat16 / float16 parameters (model.float())")
            slots.append(Source(Feed.PARAM, position))
            trainable.append(position)
            continue
        if getattr(tensor, SHARDED_ATTR, False):
            raise ValueError("a ShardedEmbedding weight is frozen or not in the optimizer; the fused step "
                             "only handles sharded weights it trains")
        if position is not None:  # in the optimizer but not trained here: read from the layout
            slots.append(Source(Feed.PARAM, position))
        elif slot.name in written:
            slots.append(Source(Feed.UPDATED, len(updated)))
            updated.append(StateRead(slot.name, get))
            update_outputs.append(written[slot.name])
        else:
            # parameters and buffers are named by their path; a lifted constant only within its graph
            key = f"constant {id(captured)} {slot.name}" if slot.kind == Slot.CONSTANT else slot.name
            slots.append(Source(Feed.FIXED, len(fixed)))
            fixed.append(StateRead(key, get))
    if not trainable:
        raise ValueError("the fused step found no parameter to train: none of the model's parameters that "
                         "the loss uses is in the optimizer with requires_grad=True")
    return Plan(slots, sorted(set(trainable)), fixed, updated, update_outputs, batch_leaves, losses[0])
