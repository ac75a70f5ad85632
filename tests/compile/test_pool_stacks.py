"""A run of layers' weights cut from the one-device pool as one stack each (train/_pool.py).

`stacked_cut` gives each run's parameter and optimizer-state arrays as one (layers, ...) stack read
straight from the pool buffers, and `stacked_pack` writes stacks back. The reference is the plain
per-array cut (`Packing.split`) stacked with numpy, and the pool itself: packing what was cut must
give the pool back bit for bit, whatever the layout (layers at equal steps, a layer's place
running past the buffer's end, arrays too large for the pool, layers not at equal steps).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpudist.compile._torch._pack import Packing
from tpudist.compile._torch.train import _optim
from tpudist.compile._torch.train._plan import Layout
from tpudist.compile._torch.train._pool import POOL_MAX_BYTES, flatten_state, stacked_cut, stacked_pack, unflatten_state


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)


def _model(case: str) -> tuple[torch.nn.Module, list[str]]:
    """A model and the order its parameters reach the optimizer in."""
    model = torch.nn.Module()
    model.embed = torch.nn.Linear(3, 8)
    model.layers = torch.nn.ModuleList(Layer(40 if case == "large" else 8) for _ in range(4))
    model.extra = torch.nn.Linear(2, 5)
    names = [n for n, _ in model.named_parameters()]
    if case == "at_end":  # the layers last in the pool: the last layer's place runs past the buffer's end
        names = [n for n in names if not n.startswith("layers.")] + [n for n in names if n.startswith("layers.")]
    if case == "uneven":  # another parameter between layers 1 and 2: the layers are not at equal steps
        names.remove("extra.weight")
        names.insert(names.index("layers.2.norm.weight"), "extra.weight")
    return model, names


@pytest.mark.parametrize("case", ["between", "at_end", "large", "uneven"])
def test_stacks_cut_from_the_pool_equal_the_stacked_arrays_and_pack_back_to_the_pool(case):
    model, names = _model(case)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([params[n] for n in names], lr=1e-3)
    layout = Layout(optimizer, _optim.kind_of(optimizer))
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(tuple(e.param.shape)).astype(np.float32) for e in layout.entries]
    states = [tuple(rng.standard_normal(v.shape).astype(np.float32) for _ in e.config.state)
              for v, e in zip(values, layout.entries)]
    flat = flatten_state(values, states)
    packing = Packing.of(flat, POOL_MAX_BYTES)
    pool = packing.pack(flat)
    position = {name: i for i, name in enumerate(names)}
    suffixes = ["norm.weight", "norm.bias", "fc.weight", "fc.bias"]
    groups = [[position[f"layers.{k}.{s}"] for k in range(4)] for s in suffixes]

    cut_params, cut_states = stacked_cut(packing, pool, layout, groups)
    want = unflatten_state(packing.split(pool), layout)
    stacked = {i for g in groups for i in g}
    for group in groups:
        np.testing.assert_array_equal(np.asarray(cut_params[group[0]]), np.stack([values[i] for i in group]))
        for k in range(2):
            np.testing.assert_array_equal(np.asarray(cut_states[group[0]][k]), np.stack([states[i][k] for i in group]))
        assert all(cut_states[i] == () for i in group[1:])
    for i in range(len(layout)):
        if i not in stacked:
            np.testing.assert_array_equal(np.asarray(cut_params[i]), np.asarray(want.params[i]))
            for got, expected in zip(cut_states[i], want.states[i]):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

    packed = stacked_pack(packing, layout, cut_params, cut_states, groups)
    assert len(packed) == len(pool)
    for got, expected in zip(packed, pool):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
