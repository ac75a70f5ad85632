"""`predict`: a loader's batches through the compiled model, equal to eager torch on each batch, in
loader order, on every process: split over 2 processes (a last, partial round included), and run
together by both for a model laid out over a mesh spanning them."""

from __future__ import annotations

import pytest
import torch
from jax.sharding import PartitionSpec as P
from torch import nn

import tpudist
from tpudist.compile._torch.serve import _predict
from tpudist.compile._torch.serve._predict import _compiled, predict
from tpudist.testing import run_on_mesh

SIZES = [2, 3, 1, 4, 2]  # 5 batches over 2 processes: the third round has one batch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


class TwoHeads(nn.Module):
    """Returns a tuple holding a dict: outputs of some structure, not one tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden = torch.tanh(self.body(x))
        return self.head(hidden), {"hidden": hidden, "norm": hidden.norm(dim=-1)}


def tp_mlp() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batches(sizes: list[int], features: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, features, generator=g) for n in sizes]


def eager(model: nn.Module, data: list) -> list:
    model.eval()
    with torch.no_grad():
        return [model(**b) if isinstance(b, dict) else model(b) for b in data]


def assert_outputs_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, msg=lambda m, i=i: f"batch {i}: {m}")


# -- one process ----------------------------------------------------------------------------------


def test_predict_equals_eager_on_each_batch_in_order_and_concat_joins_them(capfd, monkeypatch):
    from tpudist.compile._torch.train import _fit_io
    monkeypatch.setattr(_fit_io, "LINE_EVERY_S", 0.0)
    data = batches([3, 5, 1, 5], 6)
    model = mlp()
    got = predict(model, data, progress=True)
    want = eager(mlp(), data)
    assert_outputs_equal(got, want)   # eval mode: the dropout is off
    torch.testing.assert_close(predict(model, data, concat=True, log=False), torch.cat(want))
    err = capfd.readouterr().err
    assert err.count("predict: compiling the model") == 1
    assert "predict: step 4/4, " in err and "examples/s" in err
    assert "predict: 14 examples in " in err and "of which compiling" in err


def test_a_structured_output_comes_back_as_the_model_returned_it_and_concat_joins_each_tensor():
    data = batches([2, 4], 6)
    got = predict(TwoHeads(), data, log=False)
    want = eager(TwoHeads(), data)
    assert [type(o) for o in got] == [tuple, tuple] and set(got[0][1]) == {"hidden", "norm"}
    assert_outputs_equal(got, want)
    joined = predict(TwoHeads(), data, concat=True, log=False)
    torch.testing.assert_close(joined, (torch.cat([w[0] for w in want]),
                                        {k: torch.cat([w[1][k] for w in want]) for k in ("hidden", "norm")}))


def test_a_hugging_face_model_predicts_its_model_output_from_dict_batches():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(4)
    data = []
    for rows, length in [(3, 8), (2, 8), (3, 5)]:
        ids = torch.randint(1, 50, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, length - 2:] = 0  # padding in the first row
        data.append({"input_ids": ids, "attention_mask": mask})
    got = predict(bert, data, log=False)
    want = eager(bert, data)
    assert all(type(o).__name__ == "SequenceClassifierOutput" for o in got)
    assert_outputs_equal([o.logits for o in got], [w.logits for w in want])
    joined = predict(bert, data, concat=True, log=False)
    assert list(joined) == ["logits"]  # a ModelOutput joins into a dict of its fields
    torch.testing.assert_close(joined["logits"], torch.cat([w.logits for w in want]))


def test_training_modes_are_restored_and_a_second_call_compiles_nothing_new():
    model = mlp().train()
    model[0].eval()  # mixed modes come back as they were
    data = batches([3, 5, 3], 6)
    predict(model, data, log=False)
    assert [m.training for m in model.modules()] == [True, False, True, True, True]
    stats = _compiled(model).stats
    assert stats.compiles == 2  # one per batch shape
    again = predict(model, data, log=False)
    assert stats.compiles == 2 and stats.calls == 6
    assert_outputs_equal(again, eager(mlp(), data))
    cm = tpudist.compile(model)   # a CompiledModule is used as it is
    predict(cm, data[:1], log=False)
    assert cm.stats.calls == 1 and [m.training for m in model.modules()] == [True, False, True, True, True]


def test_errors_and_an_empty_loader():
    with pytest.raises(TypeError, match=r"torch.nn.Module; got function \(wrap the function in an nn.Module"):
        predict(lambda x: x, [torch.ones(1)])
    assert predict(mlp(), [], log=False) == []
    assert predict(mlp(), [], concat=True, log=False) == []

    class Widen(nn.Module):
        def forward(self, x):
            return {"doubled": 2 * x}

    with pytest.raises(ValueError,
                       match=r"the output\[.doubled.\] has shape \(2, 3\) in batch 0 and \(2, 4\) in batch 1"):
        predict(Widen(), [torch.ones(2, 3), torch.ones(2, 4)], concat=True, log=False)


# -- two processes --------------------------------------------------------------------------------


def on_rank() -> dict:
    """Every multi-process case in one 2-process job (a job's start costs seconds)."""
    out: dict = {}
    model = TwoHeads()
    out["split"] = predict(model, batches(SIZES, 6), log=False)
    out["split_calls"] = _compiled(model).stats.calls   # the batches this process ran itself
    laid_out = tpudist.parallelize(tp_mlp(), tpudist.mesh.make_mesh({"model": 2}), {"0": "colwise", "2": "rowwise"})
    out["sharding"] = tpudist.layout(laid_out).shardings()["0.weight"]
    out["together"] = predict(laid_out, batches([3, 1, 2], 16, seed=5), log=False)
    out["together_calls"] = _compiled(laid_out).stats.calls
    out["empty"] = predict(TwoHeads(), [], log=False)
    _predict.MIN_CHUNK = _predict.MAX_CHUNK = 512   # outputs of a few KiB: several chunks each
    out["chunked"] = predict(TwoHeads(), batches(SIZES, 6), log=False)
    rank = tpudist.process_index()
    for name, loader in [("sized", batches([2] * (3 - rank), 6)),   # rank 0: 3 batches, rank 1: 2
                         ("unsized", iter(batches([2] * (3 - rank), 6)))]:
        try:
            predict(TwoHeads(), loader, log=False)
        except ValueError as e:
            out[name] = str(e)
    return out


def test_two_processes_split_the_batches_and_each_returns_every_output_in_loader_order():
    results = run_on_mesh(on_rank, nprocs=2, cpu_devices=1, timeout=300)
    want = eager(TwoHeads(), batches(SIZES, 6))
    want_together = eager(tp_mlp(), batches([3, 1, 2], 16, seed=5))
    for rank, result in enumerate(results):
        assert_outputs_equal(result["split"], want)   # all 5, the last round's single batch included
        assert result["split_calls"] == [3, 2][rank]
        # the laid-out model: one program over both processes, every batch run by both
        assert result["sharding"] == P("model")   # split over both processes' devices
        assert_outputs_equal(result["together"], want_together)
        assert result["together_calls"] == 3
        assert result["empty"] == []
        assert_outputs_equal(result["chunked"], want)
        assert "different lengths on different processes ([3, 2], by rank)" in result["sized"]
        assert "different numbers of batches on different processes ([3, 2], by rank)" in result["unsized"]
