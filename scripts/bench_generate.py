"""Hugging Face generation through tpudist (issue 41): time to first token, decode latency and
throughput, one device and tensor-parallel over 4, against eager torch and a hand-written JAX floor.

    python scripts/bench_generate.py                  # Llama and GPT-2, batches 1 / 8 / 32 (~10 min on 2 cores)
    python scripts/bench_generate.py --quick          # a tiny smoke configuration (well under 2 min)
    python scripts/bench_generate.py --models llama --batches 1 8 --new-tokens 16 --out /tmp/g.json
    python scripts/bench_generate.py --torch-threads 0   # torch's own threads
    JAX_PLATFORMS=tpu,cpu JAX_DEFAULT_MATMUL_PRECISION=highest python scripts/bench_generate.py --skip-tp  # a TPU

Two `transformers` models built from small configs with random weights (seeded, `.eval()`):
`LlamaForCausalLM` (RMSNorm, rotary, grouped-query attention, SwiGLU) and `GPT2LMHeadModel`
(LayerNorm, learned positions, GELU(tanh), Conv1D). Greedy decoding, a prompt of `--prompt` tokens
(no padding), no EOS (every call generates exactly the tokens asked for); torch on one thread by
default (TORCH_THREADS below says why). Contenders:

- tpudist: `model.forward = torch.compile(model.forward, backend="tpudist")`, then
  `model.generate(..., cache_implementation="static", max_cache_len=L)`: one device (JAX's default).
  The static KV cache stays on the device between decode calls.
- tpudist_generate: `tpudist.generate(model, prompts, buckets=(prompt,), batch_size=B)` on the
  same model (one device): greedy decoding with its decode steps inside one XLA loop (no host round
  trip per token, no Hugging Face loop); the prefill and first step as compiled calls.
- tpudist_tp4 / tpudist_generate_tp4: tpudist / tpudist_generate after
  `tpudist.parallelize(model, make_mesh({"model": 4}), "llama"/"gpt2")`, in 2 processes x 2 CPU devices (`tpudist.testing.run_on_mesh`); rank 0's times.
- eager_static / eager_dynamic: eager torch, `cache_implementation="static"` / the default DynamicCache.
- hf_loop: Hugging Face's `generate()` loop alone, on the same model and static cache but with a
  forward that computes nothing (it returns zero logits): what torch and transformers cost per token
  around any model call. No backend under `generate()` goes below jax_floor + hf_loop, so tpudist's
  rows also give their ratio to that sum (`/floor+loop`). Its tokens are not checked (all zeros).
- jax_floor: the same model written by hand in JAX (below: weights copied from the torch model, one
  jitted prefill and one jitted decode step, the KV cache one array per K and V updated with
  `lax.dynamic_update_slice` and donated, greedy argmax on the device, no host sync until the last
  token). What the hardware and XLA can do with no framework in between.
- jax_floor_per_layer: that floor with the cache kept as the torch model's StaticCache keeps it,
  one array per layer for K and one for V: whether the cache's layout, rather than tpudist, costs
  anything against jax_floor.
- jax_floor_device_loop: jax_floor_per_layer's decode steps inside one `lax.while_loop` (one jitted
  call after the prefill, argmax on the device): the floor of tpudist_generate's design, which runs
  its decode the same way. tpudist_generate's rows give their ratio to it too (`/device-loop floor`).
- jax_floor_tp4: that floor with its weights laid out as tpudist_tp4's (the layout's shardings),
  in the same processes and mesh: the tensor-parallel floor, which tpudist_tp4's ratios are over.

Timing: a whole `generate()` call is synchronous (it returns host tensors), so TTFT is the median
time of `generate(max_new_tokens=1)` (prefill + the first token) and the decode time per token is
(median time with N new tokens - median time with 1) / (N - 1). Every side runs each call once
untimed first (compiles), then `--rounds` rounds, the sides (contender x {1, N}) interleaved in a
shuffled order each round (scripts/_bench.py). Throughput at batch B: B / decode time per token.
A steady decode must add no captures: the tpudist sides' `tpudist.dynamo_stats().captures` after
the warm-up must still hold after the timed rounds (the run stops otherwise).

Checks (a random GPT-2 mostly repeats its last token, so tokens alone prove little): every side's
N generated tokens at every batch, and its N steps' logits at the first batch, against
eager_static's; a mismatch is printed loudly and shown in the table. Before anything is timed, the
floor's tokens and every step's logits against eager torch's on a short prompt; where they differ
the floor's ratios are left out.

Memory: bytes per device. tpudist_tp4 reads `tpudist.layout(model).memory()` after a generate at the
largest batch given a user-created `StaticCache` (passed as `cache=`, transformers 5.x's name for
`past_key_values`), kept alive so its arrays are still resident: parameters and cache per device,
against the whole model and cache (`*_total`). One device: the torch model's parameter bytes and
the static cache's tensors, the same numbers whole.

The JSON keeps every timed call (`samples_s_b<batch>`: seconds of the 1- and N-token calls), the
environment switch TPUDIST_SCAN_LAYERS and the torch threads, and each model's `tpudist.dynamo_stats()`
added while it ran (graphs, captures, calls), in this process and on rank 0 of the tensor-parallel run.

Note (transformers 5.25): `generate(cache_config={"max_cache_len": L})` does not size the static
cache; `max_cache_len=L` does. Without it each `max_new_tokens` gets its own cache length and the
compiled forward recompiles for each.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import _bench

CONTENDERS = ("tpudist", "tpudist_generate", "tpudist_tp4", "tpudist_generate_tp4", "eager_static", "eager_dynamic",
              "hf_loop", "jax_floor", "jax_floor_per_layer", "jax_floor_device_loop", "jax_floor_tp4")
UNCHECKED = ("hf_loop",)  # its forward computes nothing: no tokens or logits to compare
TP_SIDES = ("tpudist_tp4", "tpudist_generate_tp4", "jax_floor_tp4")  # the tensor-parallel run's; the last is its floor
TP_DEVICES, TP_PROCESSES = 4, 2
TP_TIMEOUT_S = 1800.0
DEFAULT_OUT = Path("docs/bench/generate.json")
SCAN_ENV = "TPUDIST_SCAN_LAYERS"  # tpudist's switch (0: every layer lowered on its own, no lax.scan); recorded
# name: (sizes of the default run, sizes of --quick)
SIZES = {
    "llama": ({"vocab": 1024, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 8, "kv_heads": 4},
              {"vocab": 256, "hidden": 64, "intermediate": 172, "layers": 2, "heads": 8, "kv_heads": 4}),
    "gpt2": ({"vocab": 1024, "hidden": 256, "layers": 4, "heads": 8},
             {"vocab": 256, "hidden": 64, "layers": 2, "heads": 8}),
}
QUICK = {"prompt": 16, "new_tokens": 4, "batches": [1, 4], "rounds": 1}
# Measured on the 2-core machine shared with other jobs: at torch's default (2 threads) an OpenMP
# region can stall for milliseconds: eager TTFT of the small Llama (prompt 64) varied 6-95 ms at
# random (2 ms at 1 thread), and tpudist's write-back of a batch-32 cache slice took 1-7 ms instead
# of 40 us. At 1 thread both are steady and faster. XLA keeps its own threads either way.
TORCH_THREADS = 1
QUICK_TP_BATCHES = [1]  # the tensor-parallel processes compile for one batch only: most of --quick's time
FLOOR_CHECK_PROMPT, FLOOR_CHECK_TOKENS = 8, 6  # the floor's first check: a short prompt
FLOOR_LOGITS_RTOL = 1e-4  # float32 both sides; a wrong rotary or head order misses this by orders of magnitude
LOGITS_RTOL = 1e-3  # each side's logits against eager_static's, over N steps (a tensor-parallel sum reorders adds)


# -- the models -------------------------------------------------------------------------------------

def build(name: str, sizes: dict[str, int], cache_len: int) -> Any:
    """The seeded random-weight model, `.eval()`, with no EOS (generation never stops early)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    none = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if name == "llama":
        config = LlamaConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
                             intermediate_size=sizes["intermediate"], num_hidden_layers=sizes["layers"],
                             num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
                             max_position_embeddings=cache_len, **none)
        cls = LlamaForCausalLM
    else:
        config = GPT2Config(vocab_size=sizes["vocab"], n_embd=sizes["hidden"], n_layer=sizes["layers"],
                            n_head=sizes["heads"], n_positions=cache_len, **none)
        cls = GPT2LMHeadModel
    torch.manual_seed(0)
    return cls(config).eval()


def loop_only(name: str, sizes: dict[str, int], cache_len: int) -> Any:
    """The model with a forward that does no work (zero logits of the right shape, the cache handed
    back untouched), its signature kept so that `generate()` prepares the same inputs."""
    import functools

    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast
    model = build(name, sizes, cache_len)
    vocab = sizes["vocab"]

    @functools.wraps(model.forward)
    def forward(input_ids=None, *args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        return CausalLMOutputWithPast(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], vocab),
                                      past_key_values=cache)

    model.forward = forward
    return model


def prompt(batch: int, length: int, vocab: int) -> Any:
    """The same token ids in every process: (batch, length), seeded by the batch."""
    import torch
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))


def generate(model: Any, ids: Any, new_tokens: int, cache_len: int | None, cache: Any = None,
             logits: bool = False) -> Any:
    """The `new_tokens` greedy tokens after `ids`, (batch, new_tokens); a static cache of `cache_len`
    (None: the dynamic cache), `cache` a user-created one. `logits=True`: each step's logits instead,
    (batch, new_tokens, vocab)."""
    kwargs: dict[str, Any] = {}
    if cache is not None:  # transformers 5.25 names it `cache`, earlier releases `past_key_values`
        import inspect
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kwargs[name] = cache
    elif cache_len is not None:
        kwargs.update(cache_implementation="static", max_cache_len=cache_len)
    out = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=new_tokens, do_sample=False,
                         output_logits=logits, return_dict_in_generate=logits, **kwargs)
    if logits:
        import torch
        return torch.stack(out.logits, dim=1)
    out = out[:, ids.shape[1]:]
    if out.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1]} new tokens, not {new_tokens}")
    return out


def register_backend() -> None:
    """`backend="tpudist"` where tpudist is not pip-installed (a source checkout on PYTHONPATH has
    no entry point naming it): registered by hand."""
    from torch._dynamo import list_backends, register_backend as register
    if "tpudist" not in list_backends(exclude_tags=()):
        from tpudist.compile._torch.module._dynamo import backend
        register(backend, name="tpudist")


def device_loop(model: Any, ids: Any, new_tokens: int, cache_len: int) -> Any:
    """`new_tokens` greedy tokens after `ids` through `tpudist.generate` (one bucket: the prompt's
    length; the cache as long as `generate`'s above), (batch, new_tokens)."""
    import torch
    import tpudist
    replies = tpudist.generate(model, list(ids), max_new_tokens=new_tokens, buckets=(ids.shape[1],),
                               batch_size=ids.shape[0], cache_len=cache_len, pad_token_id=0, log=False,
                               progress=False)
    if tpudist.generate_stats().loop != "device":
        raise SystemExit(f"tpudist.generate did not decode on the device: {tpudist.generate_stats().why}")
    out = torch.zeros((ids.shape[0], new_tokens), dtype=torch.long)  # the trailing pad tokens it strips: 0
    for row, reply in enumerate(replies):
        out[row, :len(reply)] = torch.tensor(reply, dtype=torch.long)
    return out


def param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def cache_bytes(cache: Any) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


# -- the floor: the same decode by hand in JAX ------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    """One model family in JAX: `embed(p, ids, positions)`, `layer(p, i, x, positions, cache)`
    (cache: `_Cache`), `head(p, x)` -> logits; the cache's (layers, kv_heads, head_dim)."""

    embed: Callable[..., Any]
    layer: Callable[..., Any]
    head: Callable[..., Any]
    cache_dims: tuple[int, int, int]


@dataclass
class _Cache:
    """The KV cache while tracing: k, v (layers, batch, kv_heads, L, head_dim); tokens go in at `start`."""

    k: Any
    v: Any
    start: Any
    decode: bool

    def attend(self, i: int, q: Any, k: Any, v: Any) -> Any:
        """Writes layer i's new k, v (batch, kv_heads, s, d) at `start` and attends q (batch, kv_heads,
        group, s, d) over them (prefill: the s new keys, causal) or the whole cache (decode: the
        keys up to `start`). Returns (batch, s, heads * d)."""
        import jax
        import jax.numpy as jnp
        if isinstance(self.k, list):  # one array per layer, as Hugging Face's StaticCache keeps them
            self.k[i] = jax.lax.dynamic_update_slice(self.k[i], k, (0, 0, self.start, 0))
            self.v[i] = jax.lax.dynamic_update_slice(self.v[i], v, (0, 0, self.start, 0))
        else:
            self.k = jax.lax.dynamic_update_slice(self.k, k[None], (i, 0, 0, self.start, 0))
            self.v = jax.lax.dynamic_update_slice(self.v, v[None], (i, 0, 0, self.start, 0))
        s = q.shape[3]
        if self.decode:
            k, v = self.k[i], self.v[i]
            valid = jnp.arange(k.shape[2])[None, :] <= self.start
        else:
            valid = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.einsum("bhgsd,bhtd->bhgst", q, k) * q.shape[-1] ** -0.5
        scores = jnp.where(valid, scores, jnp.finfo(jnp.float32).min)
        out = jnp.einsum("bhgst,bhtd->bhgsd", jax.nn.softmax(scores, axis=-1), v)
        b, h, g, _, d = out.shape
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h * g * d)


def _llama(config: Any) -> Arch:
    import jax
    import jax.numpy as jnp
    import _jax_llama
    spec = _jax_llama.Spec.of(config)
    d, kvh, group = spec.head_dim, spec.kv_heads, spec.heads // spec.kv_heads
    inv_freq = 1.0 / spec.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)

    def norm(x: Any, w: Any) -> Any:
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + spec.eps)

    def rotate(x: Any, cos: Any, sin: Any) -> Any:
        half = d // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin

    def layer(p: dict, i: int, x: Any, positions: Any, cache: _Cache) -> Any:
        pre, (b, s, _) = f"model.layers.{i}.", x.shape
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = jnp.cos(jnp.concatenate([angles, angles], -1)), jnp.sin(jnp.concatenate([angles, angles], -1))
        h = norm(x, p[pre + "input_layernorm.weight"])
        # query head j*group + g reads key/value head j, as transformers' repeat_kv has it
        q = (h @ p[pre + "self_attn.q_proj.weight"].T).reshape(b, s, kvh, group, d).transpose(0, 2, 3, 1, 4)
        k = (h @ p[pre + "self_attn.k_proj.weight"].T).reshape(b, s, kvh, d).transpose(0, 2, 1, 3)
        v = (h @ p[pre + "self_attn.v_proj.weight"].T).reshape(b, s, kvh, d).transpose(0, 2, 1, 3)
        x = x + cache.attend(i, rotate(q, cos, sin), rotate(k, cos, sin), v) @ p[pre + "self_attn.o_proj.weight"].T
        h = norm(x, p[pre + "post_attention_layernorm.weight"])
        gate = jax.nn.silu(h @ p[pre + "mlp.gate_proj.weight"].T)
        return x + (gate * (h @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T

    return Arch(embed=lambda p, ids, positions: p["model.embed_tokens.weight"][ids], layer=layer,
                head=lambda p, x: norm(x, p["model.norm.weight"]) @ p["lm_head.weight"].T,
                cache_dims=(spec.layers, kvh, d))


def _gpt2(config: Any) -> Arch:
    import jax
    import jax.numpy as jnp
    heads, d, eps = config.n_head, config.n_embd // config.n_head, config.layer_norm_epsilon

    def norm(x: Any, p: dict, name: str) -> Any:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]

    def conv1d(x: Any, p: dict, name: str) -> Any:
        return x @ p[name + ".weight"] + p[name + ".bias"]  # Conv1D stores its weight (in, out)

    def layer(p: dict, i: int, x: Any, positions: Any, cache: _Cache) -> Any:
        pre, (b, s, _) = f"transformer.h.{i}.", x.shape
        qkv = conv1d(norm(x, p, pre + "ln_1"), p, pre + "attn.c_attn").reshape(b, s, 3, heads, d)
        q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
        x = x + conv1d(cache.attend(i, q[:, :, None], k, v), p, pre + "attn.c_proj")
        h = jax.nn.gelu(conv1d(norm(x, p, pre + "ln_2"), p, pre + "mlp.c_fc"), approximate=True)
        return x + conv1d(h, p, pre + "mlp.c_proj")

    def embed(p: dict, ids: Any, positions: Any) -> Any:
        return p["transformer.wte.weight"][ids] + p["transformer.wpe.weight"][positions]

    return Arch(embed=embed, layer=layer, head=lambda p, x: norm(x, p, "transformer.ln_f") @ p["transformer.wte.weight"].T,
                cache_dims=(config.n_layer, heads, d))


def _forward(arch: Arch, p: dict, ids: Any, cache: _Cache) -> tuple[Any, Any, Any, Any]:
    """(greedy next token (batch,), its logits (batch, vocab), k, v) after `ids` (batch, s) at
    positions start.."""
    import jax.numpy as jnp
    positions = cache.start + jnp.arange(ids.shape[1])
    x = arch.embed(p, ids, positions)
    for i in range(arch.cache_dims[0]):
        x = arch.layer(p, i, x, positions, cache)
    logits = arch.head(p, x[:, -1])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, cache.k, cache.v


class Floor:
    """The hand-written JAX decode of a torch model: `generate(ids, n)` -> (batch, n) tokens (and
    with `logits=True` each step's logits, (batch, n, vocab), for the check against torch)."""

    def __init__(self, model: Any, cache_len: int, per_layer: bool = False):
        import jax
        import jax.numpy as jnp
        arch = _llama(model.config) if type(model).__name__.startswith("Llama") else _gpt2(model.config)
        self.params = {n: jnp.asarray(t.detach().numpy()) for n, t in model.state_dict().items()}
        layers, kvh, d = arch.cache_dims

        def prefill(p: dict, ids: Any) -> Any:
            shape = (ids.shape[0], kvh, cache_len, d)
            if per_layer:
                return _forward(arch, p, ids, _Cache([jnp.zeros(shape)] * layers, [jnp.zeros(shape)] * layers, 0,
                                                     decode=False))
            zeros = jnp.zeros((layers, *shape), jnp.float32)
            return _forward(arch, p, ids, _Cache(zeros, zeros, 0, decode=False))

        def decode(p: dict, token: Any, start: Any, k: Any, v: Any) -> Any:
            return _forward(arch, p, token[:, None], _Cache(k, v, start, decode=True))

        def decode_loop(p: dict, token: Any, start: Any, k: Any, v: Any, steps: Any, width: int) -> Any:
            def step(carry: tuple) -> tuple:
                i, token, k, v, out = carry
                token, _, k, v = _forward(arch, p, token[:, None], _Cache(k, v, start + i, decode=True))
                return i + 1, token, k, v, out.at[:, i].set(token)

            out = jnp.zeros((token.shape[0], width), jnp.int32)
            _, _, k, v, out = jax.lax.while_loop(lambda carry: carry[0] < steps, step, (jnp.int32(0), token, k, v, out))
            return out, k, v  # the cache too: its donated buffers hold the new one

        self.prefill = jax.jit(prefill)
        self.decode = jax.jit(decode, donate_argnums=(3, 4))
        self.decode_loop = jax.jit(decode_loop, static_argnums=6, donate_argnums=(3, 4))
        self.cache_bytes = 0
        self.put = lambda ids: jnp.asarray(ids.numpy(), jnp.int32)  # the prompt onto the devices

    def lay_out(self, layout: Any, model: Any) -> None:
        """The same weights laid out as a tpudist layout lays the torch model's out (the tensor-
        parallel floor: the same jitted functions, XLA's SPMD partitioner, the same mesh); a tied
        weight as the tensor it is."""
        specs = layout.shardings()
        named = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.params = {n: layout.put(t.detach(), specs[named.get(id(t), n)])
                       for n, t in model.state_dict(keep_vars=True).items()}
        self.put = lambda ids: layout.put(ids)

    def generate(self, ids: Any, new_tokens: int, logits: bool = False) -> Any:
        import jax
        import jax.numpy as jnp
        import numpy as np
        token, step_logits, k, v = self.prefill(self.params, self.put(ids))
        self.cache_bytes = sum(a.nbytes for a in jax.tree.leaves((k, v)))
        tokens, kept = [token], [step_logits]
        for start in range(ids.shape[1], ids.shape[1] + new_tokens - 1):
            token, step_logits, k, v = self.decode(self.params, token, start, k, v)
            tokens.append(token)
            if logits:
                kept.append(step_logits)
        out = _host(jnp.stack(tokens, axis=1))  # the one wait: the last token's (a writable copy, for torch)
        return (out, _host(jnp.stack(kept, axis=1))) if logits else out

    def generate_in_loop(self, ids: Any, new_tokens: int) -> Any:
        """`generate(ids, new_tokens)` with the decode steps inside one `lax.while_loop` (one call)."""
        import jax.numpy as jnp
        import numpy as np
        token, _, k, v = self.prefill(self.params, self.put(ids))
        if new_tokens == 1:
            return _host(token[:, None])
        rest, _, _ = self.decode_loop(self.params, token, np.int32(ids.shape[1]), k, v, np.int32(new_tokens - 1),
                                      new_tokens - 1)
        return _host(jnp.concatenate([token[:, None], rest], axis=1))


def _host(array: Any) -> Any:
    """A (possibly multi-process) array's whole value as a writable numpy array."""
    import numpy as np
    if array.is_fully_addressable:
        return np.array(array)
    from jax.experimental import multihost_utils
    return np.array(multihost_utils.process_allgather(array, tiled=True))


# -- timing -----------------------------------------------------------------------------------------

def time_generation(runs: dict[str, Callable[[int], Any]], new_tokens: int, rounds: int,
                    captures: Callable[[], int] = lambda: 0) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """({side: {"ttft_ms", "decode_ms"}}, {side: its last N-token output}) of each `runs[side](n)`,
    a call generating n tokens (see the module docstring). `captures()` (tpudist's capture count)
    must not move during the timed rounds."""
    last: dict[str, Any] = {}
    sides = {}
    for name, run in runs.items():
        last[name] = run(new_tokens)  # warm-up: compiles the prefill and the decode step
        run(1)
        sides[f"{name}:1"] = _bench.Side(partial(run, 1))
        sides[f"{name}:N"] = _bench.Side(partial(run, new_tokens), wait=partial(last.__setitem__, name))
    before = captures()
    times = _bench.interleave(sides, rounds=rounds, shuffle=True)
    if captures() != before:
        raise SystemExit(f"tpudist captured {captures() - before} new graph(s) during the timed rounds: the decode "
                         "is not steady (a recompile per call or per token); its times include compiles")
    out = {}
    for name in runs:
        one, many = times[f"{name}:1"], times[f"{name}:N"]
        out[name] = {"ttft_ms": one.median * 1e3, "decode_ms": (many.median - one.median) / (new_tokens - 1) * 1e3,
                     "samples_s": {"1": one.wall, "N": many.wall}}
    return out, last


def tpudist_captures() -> int:
    import tpudist
    return tpudist.dynamo_stats().captures


def dynamo_since(before: dict[str, Any]) -> dict[str, Any]:
    """What `tpudist.dynamo_stats()` added since `before` (its fields then): one model's graphs and captures."""
    import tpudist
    now = vars(tpudist.dynamo_stats())
    return {k: v - before.get(k, 0) for k, v in now.items()}


def tp_rank(models: list[str], setup: dict[str, Any]) -> dict[str, Any]:
    """One rank of the tensor-parallel run (`run_on_mesh`): each model laid out over
    {"model": 4}, timed at each batch, then its memory per device at the largest batch."""
    import torch
    import tpudist
    from transformers import StaticCache
    if setup["torch_threads"]:
        torch.set_num_threads(setup["torch_threads"])
    register_backend()
    mesh = tpudist.mesh.make_mesh({"model": TP_DEVICES})
    out = {}
    for name in models:
        torch._dynamo.reset()  # the other model's graphs share transformers' wrapper functions
        before = vars(tpudist.dynamo_stats()).copy()
        model = build(name, setup["sizes"][name], setup["cache_len"])
        model = tpudist.parallelize(model, mesh, name)
        floor = Floor(model, setup["cache_len"])
        floor.lay_out(tpudist.layout(model), model)
        model.forward = torch.compile(model.forward, backend="tpudist")
        row: dict[str, Any] = {"times": {}, "tokens": {}}
        for batch in setup["tp_batches"]:
            ids = prompt(batch, setup["prompt"], setup["sizes"][name]["vocab"])
            runs = {"tpudist_tp4": partial(lambda n, ids: generate(model, ids, n, setup["cache_len"]), ids=ids),
                    "tpudist_generate_tp4": partial(lambda n, ids: device_loop(model, ids, n, setup["cache_len"]),
                                                    ids=ids),
                    "jax_floor_tp4": partial(lambda n, ids: torch.from_numpy(floor.generate(ids, n)), ids=ids)}
            times, last = time_generation(runs, setup["new_tokens"], setup["rounds"], tpudist_captures)
            row["times"][batch] = times
            row["tokens"][batch] = {side: out.numpy() for side, out in last.items()}
            if batch == setup["batches"][0]:
                row["logits"] = {"tpudist_tp4": generate(model, ids, setup["new_tokens"], setup["cache_len"],
                                                         logits=True).numpy(),
                                 "jax_floor_tp4": floor.generate(ids, setup["new_tokens"], logits=True)[1]}
        cache = StaticCache(config=model.config, max_cache_len=setup["cache_len"])
        largest = prompt(max(setup["tp_batches"]), setup["prompt"], setup["sizes"][name]["vocab"])
        generate(model, largest, 2, None, cache)
        row["memory"] = tpudist.layout(model).memory()  # read while `cache` lives: its arrays are still resident
        row["dynamo"] = dynamo_since(before)
        out[name] = row
    return out


# -- one model, one process -------------------------------------------------------------------------

def loud(message: str) -> None:
    bar = "!" * 100
    print(f"\n{bar}\n!! {message}\n{bar}\n", flush=True)


def check_floor(name: str, eager: Any, floor: Floor, vocab: int) -> bool:
    """The floor's greedy tokens against eager torch's on a short prompt, before anything is timed,
    and its logits at every step (prefill and decode through the cache) against eager torch's
    forward over the whole sequence: a random GPT-2 repeats its last token, which alone proves little."""
    import numpy as np
    import torch
    ids = prompt(2, FLOOR_CHECK_PROMPT, vocab)
    want = generate(eager, ids, FLOOR_CHECK_TOKENS, None).numpy()
    got, logits = floor.generate(ids, FLOOR_CHECK_TOKENS, logits=True)
    with torch.no_grad():
        sequence = torch.cat([ids, torch.from_numpy(got[:, :-1]).to(ids.dtype)], dim=1)
        reference = eager(sequence).logits[:, FLOOR_CHECK_PROMPT - 1:].numpy()
    error = float(np.abs(logits - reference).max())
    bound = FLOOR_LOGITS_RTOL * max(1.0, float(np.abs(reference).max()))
    if (want != got).any() or error > bound:
        loud(f"{name}: the JAX floor is not eager torch's function: tokens {got.tolist()} vs {want.tolist()}, "
             f"logits differ by up to {error:.3g} (bound {bound:.3g}); its ratios are left out")
        return False
    print(f"  {name}: the JAX floor's {FLOOR_CHECK_TOKENS} greedy tokens equal eager torch's, logits within "
          f"{error:.2g}", flush=True)
    return True


def measure_here(name: str, setup: dict[str, Any]) -> dict[str, Any]:
    """Every contender of one model but the tensor-parallel one, in this process."""
    import torch
    import tpudist
    from transformers import StaticCache
    sizes, cache_len, new_tokens = setup["sizes"][name], setup["cache_len"], setup["new_tokens"]
    torch._dynamo.reset()  # the other model's graphs share transformers' wrapper functions
    before = vars(tpudist.dynamo_stats()).copy()
    eager = build(name, sizes, cache_len)
    compiled = build(name, sizes, cache_len)
    compiled.forward = torch.compile(compiled.forward, backend="tpudist")
    looped = build(name, sizes, cache_len)  # tpudist.generate's own decode loop
    loop = loop_only(name, sizes, cache_len)
    floor = Floor(eager, cache_len)
    per_layer = Floor(eager, cache_len, per_layer=True)  # the floor with the torch model's own cache layout
    floor_ok = check_floor(name, eager, floor, sizes["vocab"])
    result: dict[str, Any] = {"times": {}, "tokens": {}, "floor_ok": floor_ok}
    for batch in setup["batches"]:
        ids = prompt(batch, setup["prompt"], sizes["vocab"])
        runs = {"tpudist": lambda n: generate(compiled, ids, n, cache_len),
                "eager_static": lambda n: generate(eager, ids, n, cache_len),
                "eager_dynamic": lambda n: generate(eager, ids, n, None),
                "tpudist_generate": lambda n: device_loop(looped, ids, n, cache_len),
                "hf_loop": lambda n: generate(loop, ids, n, cache_len),
                "jax_floor": lambda n: torch.from_numpy(floor.generate(ids, n)),
                "jax_floor_per_layer": lambda n: torch.from_numpy(per_layer.generate(ids, n)),
                "jax_floor_device_loop": lambda n: torch.from_numpy(per_layer.generate_in_loop(ids, n))}
        result["times"][batch], last = time_generation(runs, new_tokens, setup["rounds"], tpudist_captures)
        result["tokens"][batch] = {side: out.numpy() for side, out in last.items()}
        if batch == setup["batches"][0]:
            result["logits"] = {"tpudist": generate(compiled, ids, new_tokens, cache_len, logits=True).numpy(),
                                "eager_static": generate(eager, ids, new_tokens, cache_len, logits=True).numpy(),
                                "eager_dynamic": generate(eager, ids, new_tokens, None, logits=True).numpy(),
                                "jax_floor": floor.generate(ids, new_tokens, logits=True)[1],
                                "jax_floor_per_layer": per_layer.generate(ids, new_tokens, logits=True)[1]}
        print(f"  {name} batch {batch}: " + ", ".join(f"{s} {t['decode_ms']:.2f} ms/token"
                                                       for s, t in result["times"][batch].items()), flush=True)
    cache = StaticCache(config=eager.config, max_cache_len=cache_len)
    generate(eager, prompt(max(setup["batches"]), setup["prompt"], sizes["vocab"]), 2, None, cache)
    result["memory"] = {"parameters": param_bytes(eager), "cache": cache_bytes(cache)}
    result["floor_cache"] = floor.cache_bytes  # of its last call: at the largest batch (batches are sorted)
    result["dynamo"] = dynamo_since(before)
    return result


# -- rows and the table -----------------------------------------------------------------------------

def ratio(a: float, b: float) -> float | None:
    """a / b of two decode times; None where either is not positive (t(N) - t(1) below 0: noise)."""
    return a / b if a > 0 and b > 0 else None


def rows_of(name: str, here: dict[str, Any], tp: dict[str, Any] | None, batches: list[int]) -> list[dict[str, Any]]:
    """One row per contender: times at each batch, ratios to the floor and to eager_static, memory;
    its tokens (every batch) and logits (the first batch) checked against eager_static's."""
    import numpy as np
    times = {side: {b: here["times"][b][side] for b in batches} for side in here["times"][batches[0]]}
    tokens = {side: {b: here["tokens"][b][side] for b in batches} for side in times}
    logits = dict(here["logits"])
    if tp is not None:
        for side in TP_SIDES:
            times[side] = {b: tp["times"][b][side] for b in tp["times"]}
            tokens[side] = {b: tp["tokens"][b][side] for b in tp["tokens"]}
            if side in tp["logits"]:  # (tpudist_generate_tp4 returns tokens only)
                logits[side] = tp["logits"][side]
    whole = here["memory"]
    rows = []
    for side in (c for c in CONTENDERS if c in times):
        differ = [b for b in tokens[side] if (tokens[side][b] != tokens["eager_static"][b]).any()]
        if differ and side not in UNCHECKED:
            loud(f"{name} {side}: generated tokens differ from eager_static's at batch(es) {differ}")
        error = float(np.abs(logits[side] - logits["eager_static"]).max()) if side in logits else float("nan")
        if error > LOGITS_RTOL * max(1.0, float(np.abs(logits["eager_static"]).max())):
            loud(f"{name} {side}: logits at batch {batches[0]} differ from eager_static's by up to {error:.3g}")
        row: dict[str, Any] = {"model": name, "contender": side,
                               "tokens_match": None if side in UNCHECKED else not differ, "logits_error": error}
        for b in (b for b in batches if b in times[side]):
            ms = times[side][b]["decode_ms"]
            row[f"ttft_ms_b{b}"] = times[side][b]["ttft_ms"]
            row[f"decode_ms_b{b}"] = ms
            row[f"tokens_per_s_b{b}"] = b / ms * 1e3 if ms > 0 else None
            floor = "jax_floor_tp4" if side in TP_SIDES else "jax_floor"  # each against the floor of its layout
            row[f"over_floor_b{b}"] = ratio(ms, times[floor][b]["decode_ms"]) if here["floor_ok"] else None
            row[f"over_eager_static_b{b}"] = ratio(ms, times["eager_static"][b]["decode_ms"])
            if side == "tpudist" and here["floor_ok"]:  # the floor any backend under HF's generate() has
                row[f"over_floor_loop_b{b}"] = ratio(ms, times["jax_floor"][b]["decode_ms"]
                                                     + times["hf_loop"][b]["decode_ms"])
            if side == "tpudist_generate" and here["floor_ok"]:  # the floor of a decode inside one loop
                row[f"over_device_loop_b{b}"] = ratio(ms, times["jax_floor_device_loop"][b]["decode_ms"])
            row[f"samples_s_b{b}"] = times[side][b]["samples_s"]
        if side in TP_SIDES:
            memory = tp["memory"]
            row.update(params_per_device=memory["parameters"], cache_per_device=memory["cache"],
                       params_total=memory["parameters_total"], cache_total=memory["cache_total"])
        elif side in ("jax_floor", "jax_floor_per_layer", "jax_floor_device_loop"):
            row.update(params_per_device=whole["parameters"], cache_per_device=here["floor_cache"])
        else:
            row.update(params_per_device=whole["parameters"], cache_per_device=whole["cache"])
        row.setdefault("params_total", whole["parameters"])
        row.setdefault("cache_total", whole["cache"])
        row["memory_over_total"] = (row["params_per_device"] + row["cache_per_device"]) / (
            row["params_total"] + row["cache_total"])
        rows.append(row)
    return rows


def columns(batches: list[int]) -> list[tuple]:
    first, last = batches[0], batches[-1]
    cols = [("model", "model", "s"), ("contender", "contender", "s"),
            (f"TTFT ms b{first}", f"ttft_ms_b{first}", ".1f"), (f"ms/token b{first}", f"decode_ms_b{first}", ".2f")]
    cols += [(f"tok/s b{b}", f"tokens_per_s_b{b}", ".0f") for b in batches[1:]]
    cols += [(f"/floor b{first}", f"over_floor_b{first}", "x"), (f"/floor b{last}", f"over_floor_b{last}", "x"),
             (f"/floor+loop b{first}", f"over_floor_loop_b{first}", "x"),
             (f"/device-loop floor b{first}", f"over_device_loop_b{first}", "x"),
             (f"/eager-static b{first}", f"over_eager_static_b{first}", "x"),
             (f"/eager-static b{last}", f"over_eager_static_b{last}", "x"),
             ("params/dev", "params_per_device", "bytes"), ("cache/dev", "cache_per_device", "bytes"),
             ("mem/dev / total", "memory_over_total", "x"),
             ("tokens", lambda r: {True: "same", False: "DIFFER", None: "-"}[r["tokens_match"]], "s"),
             ("max |logit diff|", "logits_error", ".1e")]
    return cols


def setup_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes as a plain dict (it crosses to the tensor-parallel processes)."""
    return {"sizes": {m: SIZES[m][1 if args.quick else 0] for m in args.models}, "prompt": args.prompt,
            "new_tokens": args.new_tokens, "batches": args.batches, "rounds": args.rounds,
            "cache_len": args.cache_len or args.prompt + args.new_tokens,
            "tp_batches": QUICK_TP_BATCHES if args.quick else args.batches, "torch_threads": args.torch_threads,
            SCAN_ENV: os.environ.get(SCAN_ENV)}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (the prefill)")
    parser.add_argument("--new-tokens", type=int, default=32, help="N: tokens of the long generate call")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                        help="the first gives TTFT and latency, the others throughput")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per side and length (the median is kept)")
    parser.add_argument("--cache-len", type=int, default=None, help="static cache length (default prompt + N)")
    parser.add_argument("--torch-threads", type=int, default=TORCH_THREADS,
                        help=f"torch.set_num_threads in every process, eager torch's and tpudist's host side "
                             f"(default {TORCH_THREADS}; 0: torch's own, one per core)")
    parser.add_argument("--skip-tp", action="store_true", help="leave out the 2-process tensor-parallel run")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny models and {QUICK}: a smoke run, well under 2 minutes")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON (default {DEFAULT_OUT})")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.batches = sorted(set(args.batches))
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: the decode time needs at least 2")
    return args


def main() -> None:
    args = parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU mesh; on an accelerator say JAX_PLATFORMS=tpu,cpu
    import jax
    import torch
    import transformers
    from tpudist.testing import run_on_mesh
    setup = setup_of(args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    start = time.perf_counter()
    out = _bench.Output(args.out, plot=False)
    about = {"torch": torch.__version__, "transformers": transformers.__version__, "jax": jax.__version__,
             "torch_threads": torch.get_num_threads(), "jax_devices": [str(d) for d in jax.devices()]}
    register_backend()
    here, phases = {}, {}
    for name in args.models:
        began = time.perf_counter()
        here[name] = measure_here(name, setup)
        phases[name] = time.perf_counter() - began
    tp: dict[str, Any] = {}
    if not args.skip_tp:
        print(f"  tensor-parallel: {TP_PROCESSES} processes x {TP_DEVICES // TP_PROCESSES} devices ...", flush=True)
        began = time.perf_counter()
        tp = run_on_mesh(tp_rank, nprocs=TP_PROCESSES, cpu_devices=TP_DEVICES // TP_PROCESSES,
                         kwargs={"models": args.models, "setup": setup}, timeout=TP_TIMEOUT_S)[0]
        phases["tp"] = time.perf_counter() - began
    print("  seconds per phase: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()), flush=True)
    rows = [row for name in args.models for row in rows_of(name, here[name], tp.get(name), args.batches)]
    wall = time.perf_counter() - start
    title = (f"Greedy generation, prompt {args.prompt}, N = {args.new_tokens} new tokens, static cache "
             f"{setup['cache_len']}, {args.rounds} rounds (medians); ms/token = (t(N) - t(1)) / (N - 1); tok/s = "
             f"batch / that; /floor (tp4 rows: the tp4 floor) and /eager-static: ms/token over theirs (targets: tpudist <= 1.20x the floor, "
             f"< 1x eager-static); memory per device (tp4: over {TP_DEVICES} devices), cache at batch "
             f"{max(args.batches)} (tp4: {max(setup['tp_batches'])}). {wall:.0f} s")
    print(_bench.table(rows, columns(args.batches), title=title))
    dynamo = {name: {"here": here[name]["dynamo"], "tp_rank0": tp.get(name, {}).get("dynamo")} for name in args.models}
    out.write({"config": setup, "machine": about, "rows": rows, "dynamo_stats": dynamo, "wall_s": wall,
               "phase_s": phases}, announce=True)


if __name__ == "__main__":
    main()
