"""`tpudist.generate`: many generation requests of mixed lengths through Hugging Face `generate`,
compiled once per padding bucket.

    model = tpudist.parallelize(LlamaForCausalLM(config).eval(), mesh, "llama")   # optional
    replies = tpudist.generate(model, prompts, max_new_tokens=64, buckets=(32, 128, 512), batch_size=8)

Requests are sorted by length and taken `batch_size` at a time; each batch is left-padded to the
smallest bucket that holds its longest prompt (a padding attention mask keeps the padding out), and
filled up to `batch_size` rows, so every call has one of a few shapes. The model's forward runs
through `torch.compile(backend="tpudist")` (Hugging Face's own recipe for compiled generation,
installed on the model once) with a static KV cache of one size for every bucket
(`max(buckets) + max_new_tokens`): the decode step compiles once per bucket (the prefill too),
whatever the number of requests; the cache stays on the devices between tokens (split over heads
under tensor parallelism). Replies come back in the order of the requests.

Greedy decoding of a decoder-only model (the default generation settings; laid out or not) skips
`generate`'s Python loop: the decode steps run inside one XLA program (`_decode`; one serves every
bucket), with the same tokens. Anything else (sampling, beams, logits processors the model's
generation config turns on, an encoder-decoder) goes through `model.generate`;
`generate_stats().loop` says which ran.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpudist.compile._torch._layout import capturing
from tpudist.compile._torch.serve._decode import DecodeLoop


@dataclass
class GenerateStats:
    """What the last `tpudist.generate` call did: requests, new tokens, batches (one `model.generate`
    call or one device loop each), seconds in all, tokens per second, and which loop decoded."""

    requests: int = 0
    tokens: int = 0
    batches: int = 0
    seconds: float = 0.0
    loop: str = ""  # "device": greedy decode steps inside one XLA program; "generate": Hugging Face's loop
    why: str = ""  # why Hugging Face's loop ran, where it did
    loop_executables: int = 0  # XLA executables of the device loop compiled so far for this model
    # batches whose first decode step ran inside the loop too: those after a bucket's first, where
    # dynamo's own guard of the decode step holds (the first batch's first step goes through dynamo)
    first_steps_on_device: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


last_stats = GenerateStats()


def generate(model: torch.nn.Module, prompts: Iterable[Sequence[int] | torch.Tensor], *, max_new_tokens: int = 32,
             buckets: Sequence[int] = (32, 128, 512), batch_size: int = 8, pad_token_id: int | None = None,
             cache_len: int | None = None, progress: bool | None = None, log: bool = True,
             **generate_kwargs: Any) -> list[list[int]]:
    """Generates a reply to each prompt (a sequence of token ids) with `model.generate` (a Hugging
    Face model), batched and padded to `buckets` (see the module docstring); returns the new token
    ids of each, in the order of `prompts`, without padding (a reply that ends with the end-of-
    sequence token keeps it).

    Greedy by default, decoded inside one XLA loop on the device where the model allows (see the
    module docstring; `generate_stats().loop`); sampling arguments (`do_sample=True, top_k=...,
    temperature=...`) and the rest of `generate`'s go through `generate_kwargs`: seed torch (`torch.manual_seed`) for
    reproducible samples. Under the launcher every process passes the same prompts: a laid-out
    model's mesh runs one program, and each process gets every reply. Progress (rank 0, as `fit`
    shows it) and a final line with tokens/s; `tpudist.generate_stats()` returns the counters.
    `cache_len`: the static cache's length (default `max(buckets) + max_new_tokens`); one length for
    calls with different `max_new_tokens` keeps their compiled steps shared.

        replies = tpudist.generate(model, [[1, 15, 27], [1, 9]], max_new_tokens=16)
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate"):
        raise TypeError(f"tpudist.generate takes a Hugging Face model with a generate() method; got "
                        f"{type(model).__name__}")
    buckets = sorted(set(int(b) for b in buckets))
    if not buckets or buckets[0] < 1:
        raise ValueError(f"buckets={buckets!r}: give one or more positive prompt lengths, e.g. (32, 128, 512)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    requests = [_ids(p, i) for i, p in enumerate(prompts)]
    for i, ids in enumerate(requests):
        if not ids:
            raise ValueError(f"prompt {i} is empty; every request needs at least one token")
        if len(ids) > buckets[-1]:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than the largest bucket ({buckets[-1]}); add "
                             f"a bucket of at least {len(ids)} (buckets={tuple(buckets)})")
    if cache_len is None:
        cache_len = buckets[-1] + max_new_tokens
    elif not isinstance(cache_len, int) or cache_len < buckets[-1] + max_new_tokens:
        raise ValueError(f"cache_len={cache_len!r} cannot hold the largest bucket ({buckets[-1]}) and max_new_tokens="
                         f"{max_new_tokens}: give at least {buckets[-1] + max_new_tokens}, or leave it out")
    pad = _pad_id(model, pad_token_id)
    why = _hugging_face_loop(model, generate_kwargs)
    decode = None
    if why:
        _compiled_forward(model)
    else:
        decode = _decode_loops.get(model)
        if decode is None:
            decode = _decode_loops[model] = DecodeLoop(model)
    eos = _eos_ids(model)
    order = sorted(range(len(requests)), key=lambda i: len(requests[i]))
    replies: list[list[int]] = [[] for _ in requests]
    stats = GenerateStats(requests=len(requests), why=why)
    bar = _Bar(progress, log, len(requests))
    start = time.perf_counter()
    shortcuts = decode.first_steps_on_device if decode is not None else 0
    for first in range(0, len(order), batch_size):
        chosen = order[first:first + batch_size]
        bucket = next(b for b in buckets if b >= max(len(requests[i]) for i in chosen))
        ids = torch.full((batch_size, bucket), pad, dtype=torch.long)
        mask = torch.zeros((batch_size, bucket), dtype=torch.long)
        for row in range(batch_size):
            tokens = requests[chosen[row] if row < len(chosen) else chosen[0]]  # filler rows repeat the first
            ids[row, bucket - len(tokens):] = torch.tensor(tokens)
            mask[row, bucket - len(tokens):] = 1
        # a model initialised on the devices (parallelize on the meta device): dynamo traces its
        # placeholders as the plain tensors they are (their values are the layout's arrays)
        with capturing(model.parameters()):
            if decode is not None:
                new = decode.run(ids, mask, max_new_tokens, cache_len, pad, eos).tolist()
            else:
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                     cache_implementation="static", cache_config={"max_cache_len": cache_len},
                                     **generate_kwargs)
                new = out[:, bucket:].tolist()
        for row, i in enumerate(chosen):
            replies[i] = _strip(new[row], pad, eos)
            stats.tokens += len(replies[i])
        stats.batches += 1
        bar.advance(len(chosen), stats.tokens, time.perf_counter() - start)
    stats.seconds = time.perf_counter() - start
    if decode is not None:
        stats.loop = "device" if decode.on_device else "generate"
        stats.why = "" if decode.on_device else ("the decode step is not one graph on one device (a graph break, "
                                                 "random numbers, or an input that changes per token)")
        stats.loop_executables = decode.executables
        stats.first_steps_on_device = decode.first_steps_on_device - shortcuts
    else:
        stats.loop = "generate"
    global last_stats
    last_stats = stats
    bar.close(stats)
    return replies


# generation settings that leave greedy tokens as they are (the rest: Hugging Face's loop)
_GREEDY_NEUTRAL = {"use_cache", "output_attentions", "output_hidden_states", "output_scores", "output_logits",
                   "return_dict_in_generate", "bos_token_id", "eos_token_id", "pad_token_id", "_from_model_config",
                   "transformers_version", "max_length", "max_new_tokens", "cache_implementation", "cache_config",
                   "compile_config", "do_sample", "num_beams",
                   # sampling's own settings, which greedy decoding ignores
                   "temperature", "top_k", "top_p", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff"}
# each model's DecodeLoop (its compiled steps), as long as the model lives (the loop holds it weakly)
_decode_loops: weakref.WeakKeyDictionary[torch.nn.Module, DecodeLoop] = weakref.WeakKeyDictionary()


def _hugging_face_loop(model: torch.nn.Module, kwargs: dict[str, Any]) -> str:
    """Why this call decodes through `model.generate` rather than the device loop ("": it need not)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    extra = sorted(k for k, v in kwargs.items() if not (k == "do_sample" and v is False or k == "num_beams" and v == 1))
    if extra:
        return f"generate arguments {extra}"
    generation = getattr(model, "generation_config", None)
    if generation is None:
        return "no generation_config"
    if generation.do_sample or (generation.num_beams or 1) != 1:
        return "the generation config samples or searches beams"
    changed = sorted(set(generation.to_diff_dict()) - _GREEDY_NEUTRAL)
    if changed:
        return f"the generation config sets {changed}"
    return ""


def generate_stats() -> GenerateStats:
    """The counters of this process's last `tpudist.generate` call."""
    return last_stats


def _ids(prompt: Any, index: int) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise TypeError(f"prompt {index} is a tensor of shape {tuple(prompt.shape)} and dtype {prompt.dtype}; "
                            "give each prompt as a 1-D tensor or a list of token ids")
        return prompt.tolist()
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise TypeError(f"prompt {index} ({type(prompt).__name__}) is not a sequence of token ids") from None


def _pad_id(model: torch.nn.Module, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    config = getattr(model, "generation_config", None)
    for source in (config, getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    raise ValueError(f"{type(model).__name__}'s config names no pad_token_id or eos_token_id: pass pad_token_id= "
                     "(a token id the padding may use; the attention mask keeps it out)")


def _eos_ids(model: torch.nn.Module) -> set[int]:
    config = getattr(model, "generation_config", None)
    value = getattr(config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _strip(tokens: list[int], pad: int, eos: set[int]) -> list[int]:
    """A reply without what generate appends after it ends: up to and with its first end-of-
    sequence token, else without trailing padding."""
    for n, token in enumerate(tokens):
        if token in eos:
            return tokens[:n + 1]
    while tokens and tokens[-1] == pad:
        tokens = tokens[:-1]
    return tokens


def _compiled_forward(model: torch.nn.Module) -> None:
    """Installs Hugging Face's recipe, `model.forward = torch.compile(model.forward, backend="tpudist")`,
    once (a forward already compiled by the user is kept)."""
    forward = model.__dict__.get("forward")
    if forward is not None and hasattr(forward, "_torchdynamo_orig_callable"):
        return
    # the backend itself, not its name: the name resolves through the package's entry point, which
    # a source checkout on PYTHONPATH (not pip-installed) does not have
    from tpudist.compile._torch.module._dynamo import backend
    model.forward = torch.compile(model.forward, backend=backend)


class _Bar:
    """Rank 0's progress over the requests, as fit shows its steps (see _fit_io.Progress)."""

    def __init__(self, progress: bool | None, log: bool, total: int):
        import jax
        from tpudist.compile._torch.train import _fit_io
        rank0 = jax.process_index() == 0
        terminal = sys.stderr.isatty()
        self.log = log and rank0
        self.progress = _fit_io.Progress(rank0 and _fit_io.shows_progress(progress, terminal), False, terminal)
        self.progress.start("generate", total)
        self.done = 0

    def advance(self, requests: int, tokens: int, seconds: float) -> None:
        rate = tokens / seconds if seconds else 0.0
        progress = self.progress
        if progress.bar is not None:
            progress.bar.update(progress.task, advance=requests, info=f"{rate:,.0f} tokens/s")
        elif progress.lines:
            self.done += requests
            print(f"generate: {self.done} requests, {tokens} tokens, {rate:,.0f} tokens/s", file=sys.stderr,
                  flush=True)

    def close(self, stats: GenerateStats) -> None:
        self.progress.close()
        if self.log:
            print(f"generate: {stats.requests} requests, {stats.tokens} new tokens in {stats.seconds:.2f} s "
                  f"({stats.tokens_per_s:,.0f} tokens/s, {stats.batches} batches)", file=sys.stderr, flush=True)
