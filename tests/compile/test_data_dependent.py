"""Models that compute shapes or branches from their inputs: captured with the real values, specialised
on them and guarded (a changed value captures again, counted in `stats.recaptures`); branches on
parameters or random numbers, which no guard can check before the call, are a CaptureError naming
the user's line. And the CTC loss lowering (Wav2Vec2ForCTC's objective) against torch's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tpudist
from tpudist.compile._torch.lowering._captured import CaptureError


class LabelledRows(torch.nn.Module):
    """DeBERTa's loss: only the rows with a label >= 0 count (nonzero, then a branch on their number)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.fc(x)
        index = (labels >= 0).nonzero()
        if index.size(0) > 0:
            picked = torch.gather(logits, 0, index.expand(index.size(0), 3))
            return F.cross_entropy(picked, torch.gather(labels, 0, index.view(-1)))
        return logits.sum() * 0


class SignBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.max() > 0:  # a branch on an input value
            return self.fc(x).sum()
        return self.fc(-x).sum()


class ActivationBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.fc(x).sum() > 0:  # a branch on the parameters: not known before the call
            return x.sum()
        return -x.sum()


class RandomBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if torch.rand(()) < 0.5:  # LayerDrop's pattern
            return self.fc(x).sum()
        return x.sum()


class MaskedLoss(torch.nn.Module):
    """ELECTRA's discriminator loss: only the tokens the attention mask keeps, by x[mask]."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, attention_mask, labels):
        logits = self.fc(x).squeeze(-1)
        active = attention_mask.view(-1) == 1
        return F.binary_cross_entropy_with_logits(logits.view(-1)[active], labels.view(-1)[active].float())


class ActivationMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0].sum()  # which rows: known only after the parameters are applied


def _mask(kept: list[int]) -> torch.Tensor:
    return torch.tensor([[1] * k + [0] * (5 - k) for k in kept])


def test_boolean_mask_indexing_on_inputs_is_specialised_on_the_count_and_matches_eager():
    torch.manual_seed(0)
    model = MaskedLoss()
    eager, compiled = copy.deepcopy(model), tpudist.compile(model)
    x, labels = torch.randn(2, 5, 4), torch.randint(0, 2, (2, 5))
    # same count at other positions: the same executable (the positions are computed in the graph)
    for kept, compiles in (([3, 4], 1), ([4, 3], 1), ([5, 2], 1), ([2, 2], 2)):
        got, want = compiled(x, _mask(kept), labels), eager(x, _mask(kept), labels)
        torch.testing.assert_close(got, want)
        assert compiled.stats.compiles == compiles
    got.backward()
    want.backward()
    torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad)


def _fused_steps_match_eager(model: torch.nn.Module, batches: list[tuple], lr: float) -> "tpudist.TrainStep":
    """A fused SGD step per batch (the model returns its loss) against eager torch's; the step back."""
    eager = copy.deepcopy(model)
    step = tpudist.compile_train_step(model, None, torch.optim.SGD(model.parameters(), lr=lr))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=lr)
    for batch in batches:
        loss = float(step(batch))
        eager_opt.zero_grad()
        want = eager(*batch)
        want.backward()
        eager_opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(model.state_dict()["fc.weight"], eager.fc.weight.detach())  # (state_dict syncs)
    return step


def test_boolean_mask_indexing_trains_in_the_fused_step_as_eager():
    torch.manual_seed(0)
    x, labels = torch.randn(2, 5, 4), torch.randint(0, 2, (2, 5))
    step = _fused_steps_match_eager(MaskedLoss(), [(x, _mask(kept), labels) for kept in ([3, 4], [4, 3], [2, 2])], 0.5)
    assert (step.stats.compiles, step.stats.recaptures) == (2, 1)


@pytest.mark.parametrize("model", ["labelled_rows", "masked_loss"])
def test_data_dependent_lengths_under_bf16_autocast_match_eager_autocast(model):
    # inside torch.autocast the forward is an autocast region (a submodule of the exported graph)
    torch.manual_seed(0)
    if model == "labelled_rows":
        net, inputs = LabelledRows(), (torch.randn(6, 4), _labels(2))
    else:
        net, inputs = MaskedLoss(), (torch.randn(2, 5, 4), _mask([2, 3]), torch.randint(0, 2, (2, 5)))
    eager, compiled = copy.deepcopy(net), tpudist.compile(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(*inputs), eager(*inputs)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 matmuls: XLA's and torch's round apart
    got.backward()
    want.backward()
    torch.testing.assert_close(net.fc.weight.grad, eager.fc.weight.grad, rtol=2e-2, atol=2e-2)


def test_a_boolean_mask_computed_from_parameters_is_refused_with_the_rewrite():
    with pytest.raises(CaptureError, match=r"test_data_dependent.py:\d+ depends on parameter or buffer 'fc.weight'"
                                           r".*a mask instead of x\[mask\]"):
        tpudist.compile(ActivationMask())(torch.randn(3, 4))


def _labels(missing: int) -> torch.Tensor:
    labels = torch.tensor([0, 1, 2, 1, 0, 2])
    labels[:missing] = -100
    return labels


def test_a_data_dependent_length_is_specialised_and_a_new_one_captures_again():
    torch.manual_seed(0)
    model = LabelledRows()
    eager, compiled = copy.deepcopy(model), tpudist.compile(model)
    x = torch.randn(6, 4)
    for missing, compiles, recaptures in ((1, 1, 0), (1, 1, 0), (3, 2, 1), (3, 2, 1)):
        got, want = compiled(x, _labels(missing)), eager(x, _labels(missing))
        torch.testing.assert_close(got, want)
        assert (compiled.stats.compiles, compiled.stats.recaptures) == (compiles, recaptures)
    got.backward()
    want.backward()
    torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad)


def test_a_branch_on_an_input_value_is_guarded():
    torch.manual_seed(0)
    model = SignBranch()
    compiled = tpudist.compile(model)
    positive, negative = torch.rand(2, 4), -torch.rand(2, 4)
    torch.testing.assert_close(compiled(positive), model(positive))
    torch.testing.assert_close(compiled(positive + 1), model(positive + 1))
    assert compiled.stats.recaptures == 0
    torch.testing.assert_close(compiled(negative), model(negative))  # the other branch: captured again
    assert (compiled.stats.compiles, compiled.stats.recaptures) == (2, 1)


def test_a_branch_on_parameters_names_the_users_line():
    with pytest.raises(CaptureError, match=r"test_data_dependent.py:\d+.*depends on parameter"):
        tpudist.compile(ActivationBranch())(torch.randn(2, 4))


def test_a_branch_on_a_random_number_is_refused():
    with pytest.raises(CaptureError, match=r"test_data_dependent.py:\d+.*random number"):
        tpudist.compile(RandomBranch())(torch.randn(2, 4))


def test_frequent_recaptures_warn():
    compiled = tpudist.compile(LabelledRows())
    x = torch.randn(6, 4)
    with pytest.warns(UserWarning, match="captured and compiled again 8 times"):
        for i in range(9):
            compiled(x, _labels(i % 5 + (i >= 5)))  # 0..4 labels missing, then 1..4 again: a new count each call


def test_the_fused_step_recaptures_for_a_new_length_and_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    step = _fused_steps_match_eager(LabelledRows(), [(x, _labels(missing)) for missing in (1, 1, 2)], 0.1)
    assert (step.stats.compiles, step.stats.recaptures) == (2, 1)


class Ctc(torch.nn.Module):
    def __init__(self, reduction, zero_infinity=False):
        super().__init__()
        self.reduction, self.zero_infinity = reduction, zero_infinity

    def forward(self, logits, targets, input_lengths, target_lengths):
        return F.ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths, blank=0,
                          reduction=self.reduction, zero_infinity=self.zero_infinity)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("flat", [True, False])
def test_ctc_loss_and_its_gradient_match_torch(reduction, flat):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 3, 6, generator=g)
    padded = torch.tensor([[1, 2, 2, 3], [4, 0, 0, 0], [5, 5, 1, 0]])  # repeats need a blank between them
    target_lengths = torch.tensor([4, 1, 3])
    targets = torch.cat([row[:n] for row, n in zip(padded, target_lengths)]) if flat else padded
    input_lengths = torch.tensor([12, 9, 7])
    inputs = (targets, input_lengths, target_lengths)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, want = tpudist.compile(Ctc(reduction))(a, *inputs), Ctc(reduction)(b, *inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_an_impossible_alignment_is_infinite_or_zero_as_in_torch():
    logits = torch.randn(3, 1, 5)
    args = (torch.tensor([[1, 1, 1]]), torch.tensor([3]), torch.tensor([3]))  # needs 5 frames
    for zero in (False, True):
        got, want = tpudist.compile(Ctc("none", zero))(logits, *args), Ctc("none", zero)(logits, *args)
        torch.testing.assert_close(got, want)


class NumpyMask(torch.nn.Module):
    """SpecAugment's pattern: the mask is drawn with numpy while the forward runs."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        import numpy as np
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5)
        return self.fc(x * keep).sum()


def test_a_draw_from_numpys_generator_while_tracing_is_refused_not_frozen():
    with pytest.raises(CaptureError, match="numpy's global generator"):
        tpudist.compile(NumpyMask())(torch.randn(2, 4))


def test_wav2vec2_with_specaugment_on_is_refused_in_training():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, layerdrop=0.0,
                                         mask_time_prob=0.5, mask_time_length=2)
    model = transformers.Wav2Vec2ForCTC(config).train()
    with pytest.raises(CaptureError, match="SpecAugment|numpy"):
        tpudist.compile(model)(input_values=torch.randn(2, 400))


def test_electra_discriminator_loss_over_the_attended_tokens_matches_eager():
    """transformers' ElectraForPreTraining: `logits.view(-1, n)[attention_mask == 1]` in its loss."""
    transformers = pytest.importorskip("transformers")
    from compiled_check import assert_as_accurate_as_eager

    torch.manual_seed(0)
    config = transformers.ElectraConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    model = transformers.ElectraForPreTraining(config).eval()  # dropout off: values comparable
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    batch = dict(input_ids=torch.randint(0, 64, (4, 8)), attention_mask=(torch.arange(8) < torch.tensor([[8], [6], [3], [5]])).long(),
                 labels=torch.randint(0, 2, (4, 8)))
    got, want, ref = tpudist.compile(model)(**batch), eager(**batch), exact(**batch)
    for out in (got, want, ref):
        out.loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model, eager, exact)]
    assert_as_accurate_as_eager({"loss": got.loss.detach(), **grads[0]}, {"loss": want.loss.detach(), **grads[1]},
                                {"loss": ref.loss.detach(), **grads[2]})
