"""The optimizer's param groups as the fused step reads them on every step, at the cost of one tuple compare.

Each step reads every group's values once; while they are plain Python values equal to the last
step's, nothing else happens. When one changed (an LR schedule, a hand edit) the hyperparameter
table (`_optim.hyper_row`) is sent to the devices again if its numbers differ, and the groups'
structure (membership and switches) is compared with the one the step's layout was built for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from tpudist.compile._torch.train import _optim
from tpudist.compile._torch.train._plan import Layout

if TYPE_CHECKING:
    from tpudist.compile._torch._placement import Placement

# what a param group holds besides its parameters (any optimizer the fused step implements)
_GROUP_FIELDS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "betas", "eps", "amsgrad",
                 "decoupled_weight_decay", "differentiable")


class ParamGroups:
    """One fused step's watch on `optimizer.param_groups` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: _optim.OptimizerKind, placement: "Placement"):
        self.optimizer, self.kind, self.placement = optimizer, kind, placement
        self._hyper: jax.Array | None = None
        self._hyper_rows: list[list[float]] | None = None
        self._hyper_stale = True
        self._values: tuple | None = None  # the param groups' values at the last step
        self._plain = False  # ... all plain Python values (a tensor may change in place)
        self._laid_out = self.structure()  # the structure the current layout was built for

    def new_layout(self) -> Layout:
        """The step's layout for the groups as they are now (their structure is then the one
        `restructured` compares with)."""
        self._laid_out = self.structure()
        return Layout(self.optimizer, self.kind)

    def changed(self) -> bool:
        """Whether any param group's values changed since the last step (one read of each; then the
        hyperparameter table is rebuilt and the optimizer's structure checked)."""
        values = tuple((id(g["params"]), len(g["params"]), *map(g.get, _GROUP_FIELDS))
                       for g in self.optimizer.param_groups)
        if self._plain and values == self._values:
            return False
        self._values = values
        self._plain = all(_plain(v) for row in values for v in row)
        self._hyper_stale = True
        return True

    def structure(self) -> tuple:
        """What fixes the step's layout and update rules: param groups' membership and switches
        (read every step: kept to plain values, no objects built)."""
        return tuple((id(g["params"]), len(g["params"]), g.get("momentum", 0) != 0, g.get("nesterov"),
                      g.get("maximize"), g.get("amsgrad"), g.get("decoupled_weight_decay"), g.get("differentiable"))
                     for g in self.optimizer.param_groups)

    def restructured(self) -> bool:
        """Whether parameters were added to or moved between groups, or a switch flipped, since
        the layout was built (then the step needs a new one)."""
        return self.structure() != self._laid_out

    def hyperparameters(self) -> jax.Array:
        """Every param group's row of hyperparameters on the devices, re-sent only when one changed
        (an LR schedule, a hand edit)."""
        if self._hyper_stale or self._hyper is None:
            rows = [_optim.hyper_row(self.kind, g) for g in self.optimizer.param_groups]
            if rows != self._hyper_rows:
                self._hyper_rows = rows
                self._hyper = self.placement.put(np.asarray(rows, np.float32).reshape(len(rows), _optim.FIELDS),
                                                 False)
            self._hyper_stale = False
        return self._hyper


def _plain(value: Any) -> bool:
    """A value that compares by value and cannot change in place (not a tensor)."""
    if type(value) is tuple:
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float)
