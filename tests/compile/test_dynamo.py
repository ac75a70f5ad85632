"""`torch.compile(model, backend="tpudist")` against eager torch: values, `.grad`s, optimizer steps,
graph breaks, `fullgraph=True`, the entry point without `import tpudist`, the zoo, a stock Trainer."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tpudist

TOL = dict(rtol=1e-4, atol=1e-5)   # as tests/compile/test_torch_models.py


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Sequential(torch.nn.Linear(8 * 8 * 8, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.head(x.flatten(1))


class Branchy(torch.nn.Module):
    """Python that depends on data: dynamo breaks the graph at the `if` and at `.item()`."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum() > 0:
            h = self.b(h) * 2
        else:
            h = torch.relu(self.b(h))
        scale = 1.0 + abs(h.mean().item())
        return self.c(h) / scale


def _train(model, steps, batches, compiled=None):
    run = model if compiled is None else compiled
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches[:steps]:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(run(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _assert_same_state(model, eager):
    for (name, p), q in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_forward_grads_and_optimizer_steps_match_eager():
    torch.manual_seed(0)
    model = ConvNet()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tpudist")
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(compiled(x), eager(x), **TOL)
    compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name} grad: {m}")
    model.zero_grad(), eager.zero_grad()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(3)]
    for got, want in zip(_train(model, 3, batches, compiled), _train(eager, 3, batches)):
        torch.testing.assert_close(got, want, **TOL)
    _assert_same_state(model, eager)   # parameters and BatchNorm's running statistics
    with torch.no_grad():
        model.eval(), eager.eval()
        torch.testing.assert_close(compiled(x), eager(x), **TOL)   # eval mode: a recompile, same values


def test_parameters_replaced_or_re_pointed_between_calls_are_seen():
    """The parameters' views are reused while nothing about them changed; an in-place update, a new
    tensor behind `p.data`, and a transposed view at the same address each give eager's values."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    compiled = torch.compile(model, backend="tpudist")
    x = torch.randn(3, 6)
    torch.testing.assert_close(compiled(x), model(x), **TOL)
    with torch.no_grad():
        model[0].weight.add_(1.0)                                   # in place: the same storage
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        model[2].weight.data = torch.randn(6, 6)                    # a new storage behind the same Parameter
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        model[2].weight.data = model[2].weight.data.t()             # same address, other strides
        torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_graph_breaks_train_exactly_as_eager_and_are_counted():
    torch.manual_seed(0)
    model = Branchy()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tpudist")
    g = torch.Generator().manual_seed(2)
    # both branches are taken: the inputs' sign decides
    batches = [(torch.randn(8, 6, generator=g) + (2.0 if i % 2 else -2.0), torch.randint(0, 3, (8,), generator=g))
               for i in range(6)]
    before = tpudist.dynamo_stats()
    for got, want in zip(_train(model, 6, batches, compiled), _train(eager, 6, batches)):
        torch.testing.assert_close(got, want, **TOL)
    _assert_same_state(model, eager)
    stats = tpudist.dynamo_stats()
    assert stats.graphs - before.graphs >= 3, stats   # the pieces between the breaks
    assert stats.captures >= stats.graphs - before.graphs and stats.calls >= 6 * 3, stats


def test_fullgraph_raises_on_a_graph_break():
    compiled = torch.compile(Branchy(), backend="tpudist", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(torch.randn(2, 6))


def test_modes_are_accepted_and_options_refused():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    for mode in ("reduce-overhead", "max-autotune"):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(model, backend="tpudist", mode=mode)(x), model(x), **TOL)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="takes no options"):
        torch.compile(model, backend="tpudist", options={"x": 1})(x)


def test_new_shapes_recompile_and_are_counted():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="tpudist")
    before = tpudist.dynamo_stats()
    for batch in (2, 3, 5, 3):
        x = torch.randn(batch, 4)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    stats = tpudist.dynamo_stats()
    # dynamo: the first shape, then one dynamic-shape graph; tpudist captures each batch size once
    assert stats.graphs - before.graphs == 2 and stats.captures - before.captures == 3, stats


def test_the_entry_point_works_without_importing_tpudist():
    code = textwrap.dedent("""
        import sys, torch
        model = torch.nn.Linear(4, 2)
        x = torch.randn(3, 4)
        assert "tpudist" not in sys.modules
        torch.testing.assert_close(torch.compile(model, backend="tpudist")(x), model(x), rtol=1e-4, atol=1e-5)
        print("ok", "tpudist" in sys.modules)
    """)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "True"]


# -- the zoo and a stock Trainer ------------------------------------------------------------------

def _zoo_names():
    pytest.importorskip("transformers")
    from test_zoo import ZOO
    return sorted(ZOO)


@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_forward_and_gradients_match_eager(name):
    from test_zoo import check_forward_and_gradients
    before = tpudist.dynamo_stats()
    check_forward_and_gradients(name, lambda model: torch.compile(model, backend="tpudist"))
    assert tpudist.dynamo_stats().graphs > before.graphs


def test_a_stock_trainer_trains_the_compiled_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_zoo import build, make_batch
    model = build("bert")
    batches = [make_batch("classify", seed) for seed in range(4)]
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["labels"]))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=12,
                                          learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True,
                                          remove_unused_columns=False)  # the compiled forward is (*args, **kwargs)
    # the one-line form: hand the Trainer the compiled model (TrainingArguments(torch_compile_backend=
    # "tpudist") is refused by accelerate's DynamoBackend enum)
    trainer = transformers.Trainer(model=torch.compile(model, backend="tpudist"), args=args, train_dataset=rows)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert tpudist.dynamo_stats().calls >= 12
