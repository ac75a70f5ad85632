"""`fit(log_dir=..., profile_steps=...)`: TensorBoard scalars that read back equal to the returned
history, and a trace of the chosen steps holding the fused step's named span."""

from __future__ import annotations

import jax
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tpudist
from tpudist import _profile


def test_fit_writes_the_history_as_scalars_and_traces_the_chosen_steps(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    history = tpudist.fit(model, loader, opt, F.cross_entropy, epochs=2, lr_scheduler=schedule, log_dir=str(tmp_path),
                          profile_steps=(2, 4), log=False)
    scalars = tpudist.read_scalars(tmp_path)
    # TensorBoard's loader keeps float32: compare through it
    assert [v for _, v in scalars["epoch/loss"]] == [float(np.float32(r["loss"])) for r in history]
    assert [s for s, _ in scalars["epoch/loss"]] == [1, 2]
    assert [v for _, v in scalars["epoch/examples_per_s"]] == [float(np.float32(r["examples_per_s"])) for r in history]
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 17))   # every step, numbered from 1
    np.testing.assert_allclose(np.mean([v for _, v in scalars["train/loss"][:8]]), history[0]["loss"], rtol=1e-6)
    lrs = [v for _, v in scalars["train/lr"]]
    assert lrs[:4] == [float(np.float32(0.1))] * 3 + [float(np.float32(0.05))]  # the schedule, step by step
    assert scalars["epoch/compile_s"][0][1] > 0
    for name in ("goodput", "flops_per_step"):  # the efficiency report (test_efficiency.py)
        assert [v for _, v in scalars[f"epoch/{name}"]] == [float(np.float32(r[name])) for r in history]
    assert "epoch/mfu" not in scalars and "epoch/tokens_per_s" not in scalars  # a CPU has no peak; no token ids
    # the trace of steps 2..3: the fused step's span, two calls of it
    traces = list((tmp_path / "rank0" / "plugins" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    data = jax.profiler.ProfileData.from_file(str(traces[0]))
    names = [e.name for plane in data.planes for line in plane.lines for e in line.events]
    assert names.count("tpudist.torch_step[Sequential]") == 2, sorted(set(names))[:40]
    assert not _profile.profiling()


def test_fit_announces_its_compile_and_prints_progress_lines_where_stderr_is_a_pipe(capfd, monkeypatch):
    """Under the launcher stderr is a pipe: progress comes as whole lines (throttled; here every
    step), the first call says it compiles, and each epoch's line and record hold its compile time."""
    from tpudist.compile._torch.train import _fit_io
    monkeypatch.setattr(_fit_io, "LINE_EVERY_S", 0.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    history = tpudist.fit(model, torch.utils.data.DataLoader(data, batch_size=8),
                          torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, epochs=2, progress=True)
    err = capfd.readouterr().err
    assert err.count("fit: compiling the step") == 1
    assert "epoch 1/2: step 4/4, " in err and "examples/s" in err and "epoch 2/2: step 1/4, " in err
    assert history[0]["compile_seconds"] > 0 and history[1]["compile_seconds"] == 0
    assert f"of which compiling {history[0]['compile_seconds']:.2f} s" in err
    assert history[0]["compile_seconds"] < history[0]["seconds"]


def test_progress_by_default_where_the_launchers_console_is_a_terminal(capfd, monkeypatch):
    """stderr a pipe and TPUDIST_CONSOLE=tty (the launcher at a terminal): progress lines with no
    `progress=` given, the first once the first step has run, then at most one every LINE_EVERY_S;
    without it, or with progress=False, none."""
    import time
    from tpudist import contract
    from tpudist.compile._torch.train import _fit_io
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    monkeypatch.setenv(contract.CONSOLE, "tty")
    start = time.monotonic()
    tpudist.fit(model, loader, opt, F.cross_entropy, epochs=2, log=False)
    seconds = time.monotonic() - start
    lines = [line for line in capfd.readouterr().err.splitlines() if ": step " in line]
    assert lines[0].startswith("epoch 1/2: step 1/4, ") and lines[0].endswith(" examples/s"), lines
    assert len(lines) <= 1 + seconds // _fit_io.LINE_EVERY_S, lines
    tpudist.fit(model, loader, opt, F.cross_entropy, progress=False, log=False)
    monkeypatch.delenv(contract.CONSOLE)
    tpudist.fit(model, loader, opt, F.cross_entropy, log=False)
    assert ": step " not in capfd.readouterr().err
