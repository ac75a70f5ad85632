"""The models users bring: third-party `transformers` models through `tpudist.compile` and the fused step.

Each model is built from a tiny config with random weights (no downloads) and called the way its
documentation calls it: keyword inputs with `labels`, a `ModelOutput` back, the default attention
implementation. Three stages per model, each against eager torch in the same process:

- forward + backward: `tpudist.compile(model)(**batch)` gives eager's loss and logits, and every
  parameter's `.grad` after `loss.backward()`;
- fused step: three `compile_train_step(model, None, SGD)` steps (the model's own loss) give eager's
  three `torch.optim` steps: losses, parameters, BatchNorm buffers;
- dropout: with the config's default dropout the fused step runs, stays finite and learns.

The first two stages run with dropout off. The reference is float64 eager torch: compiled fp32 must
be as close to it as eager fp32 is (within a factor), so models where fp32 itself is far from
float64 (BatchNorm over a few values) are judged fairly without a loosened tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Callable

import pytest
import torch

import tpudist

transformers = pytest.importorskip("transformers")
T = transformers
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB, BATCH, SEQ, IMAGE, LABELS, AUDIO = 64, 4, 8, 32, 3, 400


@dataclasses.dataclass(frozen=True)
class Entry:
    build: Callable[[dict], torch.nn.Module]   # config overrides -> model
    kind: str  # "classify" | "causal" | "masked" | "seq2seq" | "image" | "segment" | "ctc"
    no_dropout: dict                           # config overrides that turn every dropout off
    has_dropout: bool = True                   # whether the default config drops out at all


def _text(config_cls, model_cls, **base):
    return lambda extra: model_cls(config_cls(**{**base, **extra}))


def _checkpointed(build, reentrant):
    """The model with `transformers`' gradient checkpointing on (torch.utils.checkpoint per layer)."""
    def make(extra):
        model = build(extra)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    return make


ZOO = {
    "bert": Entry(_text(T.BertConfig, T.BertForSequenceClassification, vocab_size=VOCAB, hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=32, num_labels=LABELS), "classify",
                  dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "distilbert": Entry(_text(T.DistilBertConfig, T.DistilBertForSequenceClassification, vocab_size=VOCAB,
                              dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32,
                              num_labels=LABELS), "classify",
                        dict(dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)),
    "roberta": Entry(_text(T.RobertaConfig, T.RobertaForSequenceClassification, vocab_size=VOCAB,
                           hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=40, num_labels=LABELS), "classify",
                     dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "gpt2": Entry(_text(T.GPT2Config, T.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                        n_positions=32, bos_token_id=0, eos_token_id=0), "causal",
                  dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": Entry(_text(T.LlamaConfig, T.LlamaForCausalLM, vocab_size=VOCAB, hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=32), "causal",
                   dict(), has_dropout=False),
    "t5": Entry(_text(T.T5Config, T.T5ForConditionalGeneration, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                      num_layers=2, num_heads=4, decoder_start_token_id=0), "seq2seq",
                dict(dropout_rate=0.0)),
    "bart": Entry(_text(T.BartConfig, T.BartForConditionalGeneration, vocab_size=VOCAB, d_model=32,
                        encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32), "seq2seq",
                  dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    "resnet": Entry(_text(T.ResNetConfig, T.ResNetForImageClassification, embedding_size=8,
                          hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS), "image",
                    dict(), has_dropout=False),
    "convnext": Entry(_text(T.ConvNextConfig, T.ConvNextForImageClassification, num_stages=2,
                            hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS), "image",
                      dict(), has_dropout=False),
    "vit": Entry(_text(T.ViTConfig, T.ViTForImageClassification, image_size=IMAGE, patch_size=8, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=LABELS,
                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1), "image",
                 dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "mobilenet_v2": Entry(_text(T.MobileNetV2Config, T.MobileNetV2ForImageClassification, image_size=IMAGE,
                                depth_multiplier=0.25, num_labels=LABELS), "image",
                          dict(classifier_dropout_prob=0.0)),
    "mixtral": Entry(_text(T.MixtralConfig, T.MixtralForCausalLM, vocab_size=VOCAB, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                           max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
                           attention_dropout=0.1, router_jitter_noise=0.05), "causal",
                     dict(attention_dropout=0.0, router_jitter_noise=0.0)),
    "segformer": Entry(_text(T.SegformerConfig, T.SegformerForSemanticSegmentation, num_encoder_blocks=2,
                             depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2],
                             num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16,
                             num_labels=LABELS, drop_path_rate=0.1), "segment",
                       dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                            drop_path_rate=0.0)),
    "swin": Entry(_text(T.SwinConfig, T.SwinForImageClassification, image_size=IMAGE, patch_size=4, embed_dim=16,
                        depths=[2, 2], num_heads=[2, 2], window_size=4, num_labels=LABELS, drop_path_rate=0.2),
                  "image", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)),
    "gpt2_checkpointed": Entry(_checkpointed(_text(T.GPT2Config, T.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32,
                                                   n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
                                                   eos_token_id=0), reentrant=True), "causal",
                               dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert_checkpointed": Entry(_checkpointed(_text(T.BertConfig, T.BertForSequenceClassification, vocab_size=VOCAB,
                                                   hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=64, max_position_embeddings=32,
                                                   num_labels=LABELS), reentrant=False), "classify",
                               dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "mpnet": Entry(_text(T.MPNetConfig, T.MPNetForMaskedLM, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=40), "masked",
                   dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    # data-dependent: CTC's feature lengths and label count come from the inputs (specialised, guarded)
    "wav2vec2": Entry(_text(T.Wav2Vec2Config, T.Wav2Vec2ForCTC, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                            feat_extract_norm="layer", do_stable_layer_norm=True, pad_token_id=0,
                            layerdrop=0.0, mask_time_prob=0.0), "ctc",  # (random branches: see test_data_dependent)
                      dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                           final_dropout=0.0)),
    # data-dependent: the loss counts the labelled rows (nonzero) and branches on it
    "deberta_v2": Entry(_text(T.DebertaV2Config, T.DebertaV2ForSequenceClassification, vocab_size=VOCAB,
                              hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=32, relative_attention=True, pos_att_type=["p2c", "c2p"],
                              num_labels=LABELS), "classify",
                        dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "efficientnet": Entry(_text(T.EfficientNetConfig, T.EfficientNetForImageClassification, image_size=IMAGE,
                                width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128,
                                num_labels=LABELS), "image",
                          dict(dropout_rate=0.0, drop_connect_rate=0.0)),
}


def make_batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                "labels": torch.randint(0, LABELS, (BATCH,), generator=g)}
    if kind == "segment":  # a class per pixel
        return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                "labels": torch.randint(0, LABELS, (BATCH, IMAGE, IMAGE), generator=g)}
    if kind == "ctc":  # 400 samples: 39 frames; one padded recording, one shorter transcript
        mask = torch.ones(BATCH, AUDIO, dtype=torch.int64)
        mask[0, -100:] = 0
        labels = torch.randint(1, VOCAB, (BATCH, 6), generator=g)
        labels[0, -2:] = -100
        return {"input_values": torch.randn(BATCH, AUDIO, generator=g), "attention_mask": mask, "labels": labels}
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[0, -3:] = 0  # one padded sequence: the attention mask matters
    if kind == "classify":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, LABELS, (BATCH,), generator=g)}
    if kind in ("causal", "masked"):
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(1, VOCAB, (BATCH, 5), generator=g)}


def build(name: str, dropout: bool = False) -> torch.nn.Module:
    entry = ZOO[name]
    torch.manual_seed(0)
    return entry.build({} if dropout else entry.no_dropout)


def as_float64(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of `model`, the reference. Mixture-of-experts layers run their per-expert loop
    ("eager" experts): torch's grouped matmul, their default, has no float64 kernel."""
    exact = copy.deepcopy(model).double()
    if getattr(exact.config, "_experts_implementation", None) not in (None, "eager"):
        exact.set_experts_implementation("eager")
    return exact


def as_double(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def assert_as_accurate(what: str, got: torch.Tensor, eager, exact: torch.Tensor) -> None:
    """`got` (compiled fp32) is as close to the float64 result as eager fp32 is, within a factor of 4,
    plus what is rounding noise for either: 2e-6 of the result's size, and 2e-7 per element for
    results that are zero but for rounding (a BatchNorm mean over a centred input, where eager fp32
    lands at ~1e-7 per element and XLA, summing in another order, at 3-4e-7). `eager` is one eager
    fp32 result or several (eager torch at other thread counts): the farthest of them is eager's error."""
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    eagers = eager if isinstance(eager, (tuple, list)) else (eager,)
    got, exact = got.detach().double(), exact.detach().double()
    error = float((got - exact).norm())
    floor = max(float((e.detach().double() - exact).norm()) for e in eagers)
    noise = 2e-6 * float(exact.norm()) + 2e-7 * exact.numel() ** 0.5
    assert error <= 4 * floor + noise, (f"{what}: compiled is {error:.2e} from float64, eager fp32 "
                                        f"{floor:.2e} (norm of the result {float(exact.norm()):.2e})")


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Eager torch on `n` threads (None: as it is). Its float32 sums take another order per thread
    count, and training steps amplify that: eager's own error against float64 after three steps
    changes severalfold with the thread count (docs/bench/HISTORY.md), so one thread count gives one
    sample of it, and the fused-step test takes the larger of two."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tied(model: torch.nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(pname)
    return [names for names in groups.values() if len(names) > 1]


def named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def check_forward_and_gradients(name: str, compile_model: Callable[[torch.nn.Module], Callable]) -> Callable:
    """`compile_model(model)(**batch)` gives eager's type, loss and logits, and every parameter's `.grad`
    after `loss.backward()`, each as close to float64 as eager fp32 is. Returns the compiled callable."""
    model = build(name)
    model.train()
    eager, exact = copy.deepcopy(model), as_float64(model)
    batch = make_batch(ZOO[name].kind, 1)
    compiled = compile_model(model)
    out = compiled(**batch)
    want, want64 = eager(**batch), exact(**as_double(batch))
    assert type(out) is type(want), f"{name}: returned {type(out).__name__}, eager {type(want).__name__}"
    assert_as_accurate(f"{name} loss", out.loss, want.loss, want64.loss)
    assert_as_accurate(f"{name} logits", out.logits, want.logits, want64.logits)
    out.loss.backward()
    want.loss.backward()
    want64.loss.backward()
    got, eager_grads, exact_grads = named_grads(model), named_grads(eager), named_grads(exact)
    for pname, g in got.items():
        assert (g is None) == (eager_grads[pname] is None), f"{name}: .grad of {pname} is {g}, eager's " \
                                                           f"{eager_grads[pname]}"
        if g is not None:
            assert_as_accurate(f"{name} grad {pname}", g, eager_grads[pname], exact_grads[pname])
    return compiled


@pytest.mark.parametrize("name", sorted(ZOO))
def test_forward_and_gradients_match_eager(name):
    compiled = check_forward_and_gradients(name, tpudist.compile)
    assert compiled.stats.compiles == 1


@pytest.mark.parametrize("name", sorted(ZOO))
def test_three_fused_steps_match_eager_torch_optim(name):
    entry = ZOO[name]
    model = build(name)
    eager, eager1, exact = copy.deepcopy(model), copy.deepcopy(model), as_float64(model)
    # a rate at which every model descends: where the loss climbs (MobileNetV2 at 0.05: 1.0 -> 4.0 -> 6.1)
    # rounding differences grow ~200x a step, and the comparison measures luck, not the bridge
    make = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)
    step = tpudist.compile_train_step(model, None, make(model.parameters()))
    # eager fp32 at torch's default thread count and at one thread (torch_threads), and float64
    refs = [(m, make(m.parameters()), threads) for m, threads in ((eager, None), (eager1, 1), (exact, None))]
    for i in range(3):
        batch = make_batch(entry.kind, 10 + i)
        loss = step(batch)
        losses = []
        for m, opt, threads in refs:
            with torch_threads(threads):
                opt.zero_grad()
                value = m(**(as_double(batch) if m is exact else batch)).loss
                value.backward()
                opt.step()
            losses.append(value)
        assert_as_accurate(f"{name} loss of step {i + 1}", loss, losses[:2], losses[2])
    # state_dict(): the door through which torch sees the values the step keeps on the devices
    got, eager_state, exact_state = model.state_dict(), eager.state_dict(), exact.state_dict()
    eager1_state = eager1.state_dict()
    assert name != "mpnet" or _tied(eager), "MPNet's output projection is no longer tied to its embeddings"
    for names in _tied(eager):  # parameters tied in eager torch (one tensor, several names) stay one tensor
        assert all(torch.equal(got[names[0]], got[n]) for n in names[1:]), f"{name}: the tie {names} broke"
    assert got.keys() == eager_state.keys()
    for key, value in got.items():
        if value.is_floating_point():
            assert_as_accurate(f"{name} {key} after 3 steps", value, (eager_state[key], eager1_state[key]),
                               exact_state[key])
        else:
            assert torch.equal(value, eager_state[key]), f"{name} {key}: {value} != {eager_state[key]}"
    assert step.stats.compiles == 1


# MobileNetV2's only dropout is its classifier's nn.Dropout, the op the other models drop out with, and
# its 16 blocks cost ~20 s of XLA:CPU compile per program: its forward, gradients and fused steps are
# tested above
DROPOUT_AS_OTHERS = {"mobilenet_v2"}


@pytest.mark.parametrize("name", sorted(n for n, e in ZOO.items() if e.has_dropout and n not in DROPOUT_AS_OTHERS))
def test_with_default_dropout_the_fused_step_learns(name):
    entry = ZOO[name]
    model = build(name, dropout=True)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = model.config.to_dict()
    assert dropouts or any(v for k, v in config.items() if "drop" in k and isinstance(v, float)), \
        f"{name}'s default config has no dropout to test"
    eager = copy.deepcopy(model)
    step = tpudist.compile_train_step(model, None, torch.optim.AdamW(model.parameters(), lr=3e-3))
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    batch = make_batch(entry.kind, 3)  # one batch, memorized: the loss must fall despite the noise
    losses, eager_losses = [], []
    for _ in range(30):
        losses.append(float(step(batch)))
        eager_opt.zero_grad()
        loss = eager(**batch).loss
        loss.backward()
        eager_opt.step()
        eager_losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    fall = lambda ls: sum(ls[:5]) / 5 - sum(ls[-5:]) / 5
    # it learns, as fast as eager torch with its own dropout masks does (within noise)
    assert fall(eager_losses) > 0.01, f"{name}: eager torch itself does not learn here: {eager_losses}"
    assert fall(losses) > 0.5 * fall(eager_losses), (f"{name}: loss fell {fall(losses):.3f} in 30 steps, eager "
                                                     f"{fall(eager_losses):.3f}: {losses}")
    # dropout really is on: with the learning rate at 0 (read every step, no recompile), the same
    # batch gives another loss at every step: each step draws new masks
    for group in step.optimizer.param_groups:
        group["lr"] = 0.0
    repeated = [float(step(batch)) for _ in range(2)]
    assert repeated[0] != repeated[1], f"{name}: two steps on one batch gave the same loss {repeated}"
    assert step.stats.compiles == 1


def _cache_tensors(cache) -> list[torch.Tensor]:
    if hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache
        return _cache_tensors(cache.self_attention_cache) + _cache_tensors(cache.cross_attention_cache)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_key_value_caches_come_back_as_in_eager(name):
    """Causal LMs and seq2seq models return their key/value cache (a DynamicCache or
    EncoderDecoderCache, not a tensor): the compiled model returns the same kind of object holding
    the same tensors, and eager torch can continue decoding from it."""
    entry = ZOO[name]
    model = build(name).eval()
    batch = make_batch(entry.kind, 2)
    with torch.no_grad():
        got, want = tpudist.compile(model)(**batch), model(**batch)
    assert type(got.past_key_values) is type(want.past_key_values)
    mine, theirs = _cache_tensors(got.past_key_values), _cache_tensors(want.past_key_values)
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # one more decoding step in eager torch, from either cache
    step = {"input_ids": batch["input_ids"][:, :1] if name != "t5" else None,
            "decoder_input_ids": batch["labels"][:, -1:] if name == "t5" else None}
    step = {k: v for k, v in step.items() if v is not None}
    if name == "t5":
        step["encoder_outputs"] = (want.encoder_last_hidden_state,)
    with torch.no_grad():
        continued = model(**step, past_key_values=got.past_key_values).logits
        expected = model(**step, past_key_values=want.past_key_values).logits
    torch.testing.assert_close(continued, expected, rtol=1e-4, atol=1e-5)


def test_bert_trains_under_fit_through_the_launcher():
    """examples/train_bert.py: a default-config BertForSequenceClassification (dropout on, its own
    loss), `tpudist.fit(model, loader, optimizer)`, 2 processes started by the real launcher."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tpudist.xla_dist", "--local", "--nproc-per-host", "2", "--",
         sys.executable, "examples/train_bert.py", "--epochs", "2", "--examples", "512"],
        cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"processes 2, 2 epochs, loss (\d\.\d+) -> (\d\.\d+); accuracy (\d\.\d+) -> (\d\.\d+)",
                      done.stdout)
    assert found, done.stdout
    first, last, before, after = map(float, found.groups())
    assert last < first - 0.03 and after > max(0.8, before + 0.2), done.stdout
    # the efficiency report (test_efficiency.py), from rank 0: tokens/s of its input_ids, MFU (n/a on a
    # CPU, and why), goodput
    output = done.stdout + done.stderr
    assert re.search(r"epoch 2/2: .* examples/s, [\d,]+ tokens/s, MFU n/a, goodput \d+%", output), output
    assert "MFU n/a: a CPU has no published peak" in output and "fit: goodput " in output, output
