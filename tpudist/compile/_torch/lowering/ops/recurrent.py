"""Recurrent layers (`nn.LSTM`, `nn.GRU`, `nn.RNN`) kept whole by capture and lowered to one
`lax.scan` per layer and direction, so compile time does not grow with the sequence length
(torch's decomposition unrolls every time step: one LSTM layer compiled in 13.6 s at length 16 and
85.9 s at 64). The input projection of every step is one matmul before the scan; the scan carries
the hidden (and cell) state. Gates and their order are torch's (LSTM i, f, g, o; GRU r, z, n with
b_hn inside the reset gate); dropout between layers draws from the graph's key, as torch's
`dropout=` does in training. LSTMs with `proj_size` are refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpudist.compile._torch.lowering._table import keep_whole, register
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _has_dropout(node) -> bool:
    return float(node.args[5]) > 0.0 and bool(node.args[6])


def _lstm_cell(w_hh, b_hh):
    def cell(carry, gx):
        h, c = carry
        i, f, g, o = jnp.split(gx + h @ w_hh.T + b_hh, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h
    return cell


def _gru_cell(w_hh, b_hh):
    def cell(h, gx):
        r_x, z_x, n_x = jnp.split(gx, 3, axis=-1)
        r_h, z_h, n_h = jnp.split(h @ w_hh.T + b_hh, 3, axis=-1)
        r, z = jax.nn.sigmoid(r_x + r_h), jax.nn.sigmoid(z_x + z_h)
        n = jnp.tanh(n_x + r * n_h)
        h = (1 - z) * n + z * h
        return h, h
    return cell


def _rnn_cell(activation):
    def make(w_hh, b_hh):
        def cell(h, gx):
            h = activation(gx + h @ w_hh.T + b_hh)
            return h, h
        return cell
    return make


def _recurrent(kind: str, key, x, states, params, has_biases, num_layers, dropout, train, bidirectional,
               batch_first):
    """(output, final states per state kind) of a multi-layer, maybe bidirectional recurrence;
    `states` is [h0] or [h0, c0], each (layers * directions, batch, hidden)."""
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if len(params) != num_layers * directions * per:
        raise NotImplementedError(f"{kind} with proj_size (projected hidden states) has no lowering; use proj_size=0 "
                                  "or keep the layer outside the compiled module")
    unbatched = x.ndim == 2
    if unbatched:
        x, states = x[:, None], [s[:, None] for s in states]
    elif batch_first:
        x = x.swapaxes(0, 1)  # (time, batch, features) from here on
    make = {"lstm": _lstm_cell, "gru": _gru_cell, "rnn_tanh": _rnn_cell(jnp.tanh),
            "rnn_relu": _rnn_cell(jax.nn.relu)}[kind]
    finals: list[list[jax.Array]] = [[] for _ in states]
    for layer in range(num_layers):
        outs = []
        for d in range(directions):
            at = (layer * directions + d) * per
            w_ih, w_hh = params[at], params[at + 1]
            b_ih, b_hh = (params[at + 2], params[at + 3]) if has_biases else (0, 0)
            xs = x if d == 0 else x[::-1]
            gates = xs @ w_ih.T + b_ih  # every step's input projection: one matmul
            start = tuple(s[layer * directions + d] for s in states)
            carry, ys = lax.scan(make(w_hh, b_hh), start if kind == "lstm" else start[0], gates)
            carry = carry if kind == "lstm" else (carry,)
            for final, value in zip(finals, carry):
                final.append(value)
            outs.append(ys if d == 0 else ys[::-1])
        x = outs[0] if directions == 1 else jnp.concatenate(outs, axis=-1)
        if key is not None and layer < num_layers - 1:  # torch drops between layers, not after the last
            kept = jax.random.bernoulli(jax.random.fold_in(key, layer), 1.0 - dropout, x.shape)
            x = jnp.where(kept, x / (1.0 - dropout), 0).astype(x.dtype)
    stacked = [jnp.stack(f) for f in finals]
    if unbatched:
        return x[:, 0], [s[:, 0] for s in stacked]
    return (x.swapaxes(0, 1) if batch_first else x), stacked


def _split(args, count):
    """(key, the op's own arguments): a random node's key comes first."""
    return (args[0], args[1:]) if len(args) == count + 1 else (None, args)


@register(aten.lstm.input, random=_has_dropout)
def lstm(*args):
    key, (x, hx, params, *rest) = _split(args, 9)
    out, (h, c) = _recurrent("lstm", key, x, list(hx), list(params), *rest)
    return out, h, c


def _single_state(kind):
    def lower(*args):
        key, (x, h0, params, *rest) = _split(args, 9)
        out, (h,) = _recurrent(kind, key, x, [h0], list(params), *rest)
        return out, h
    return lower


register(aten.gru.input, random=_has_dropout)(_single_state("gru"))
register(aten.rnn_tanh.input, random=_has_dropout)(_single_state("rnn_tanh"))
register(aten.rnn_relu.input, random=_has_dropout)(_single_state("rnn_relu"))
keep_whole(aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)
