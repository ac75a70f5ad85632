"""nn.LSTM / nn.GRU / nn.RNN lowered as one lax.scan per layer and direction: outputs, final states
and gradients against eager torch; dropout between layers draws new masks every call."""

from __future__ import annotations

import pytest
import torch

import tpudist

CASES = {
    "lstm": (torch.nn.LSTM, {}),
    "lstm_2_layers_bidirectional_batch_first": (torch.nn.LSTM, dict(num_layers=2, bidirectional=True,
                                                                     batch_first=True)),
    "lstm_no_bias": (torch.nn.LSTM, dict(bias=False)),
    "gru_2_layers_bidirectional": (torch.nn.GRU, dict(num_layers=2, bidirectional=True)),
    "rnn_tanh": (torch.nn.RNN, {}),
    "rnn_relu_batch_first": (torch.nn.RNN, dict(nonlinearity="relu", batch_first=True)),
}


def grads(module: torch.nn.Module, outputs) -> list[torch.Tensor]:
    module.zero_grad()
    out, state = outputs
    states = state if isinstance(state, tuple) else (state,)
    (out.square().sum() + sum(s.sum() for s in states)).backward()
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("unbatched", [False, True])
def test_recurrent_layers_equal_eager_torch(name, unbatched):
    cls, kwargs = CASES[name]
    torch.manual_seed(0)
    layer = cls(5, 7, **kwargs)
    x = torch.randn(6, 5) if unbatched else torch.randn(3, 6, 5)
    eager = layer(x)
    eager_grads = grads(layer, eager)
    compiled = tpudist.compile(layer)(x)
    compiled_grads = grads(layer, compiled)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for c, e in zip(compiled[1] if isinstance(compiled[1], tuple) else (compiled[1],),
                    eager[1] if isinstance(eager[1], tuple) else (eager[1],)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)


def test_initial_states_are_used():
    torch.manual_seed(0)
    layer = torch.nn.LSTM(4, 6, num_layers=2)
    x, h0, c0 = torch.randn(5, 2, 4), torch.randn(2, 2, 6), torch.randn(2, 2, 6)
    eager = layer(x, (h0, c0))
    compiled = tpudist.compile(layer)(x, (h0, c0))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1][1], eager[1][1], rtol=1e-5, atol=1e-6)


def test_dropout_between_layers_draws_new_masks_and_eval_equals_eager():
    torch.manual_seed(0)
    layer = torch.nn.GRU(4, 64, num_layers=2, dropout=0.5)
    x = torch.randn(5, 3, 4)
    compiled = tpudist.compile(layer)
    first, second = compiled(x)[0], compiled(x)[0]
    assert not torch.equal(first, second)
    layer.eval()
    torch.testing.assert_close(compiled(x)[0], layer(x)[0], rtol=1e-5, atol=1e-6)


def test_a_projected_lstm_is_refused_by_name():
    layer = torch.nn.LSTM(4, 6, proj_size=3)
    with pytest.raises(Exception, match="proj_size"):
        tpudist.compile(layer)(torch.randn(5, 2, 4))
