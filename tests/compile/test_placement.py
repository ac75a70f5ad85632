"""Where a compiled module computes: on JAX's default device as it is at each call (on a TPU host,
the TPU: torch's tensors there are CPU tensors), never on a hard-coded CPU device.

Each test runs in a fresh process with 2 XLA CPU devices (the `tpudist` marker) and enters
`jax.default_device(jax.devices()[1])`; every array a call makes, the parameters the module holds
included, must then live on device 1, and values and `.grad`s equal eager torch's. `host_view=False`
runs the accelerator's path on the CPU mesh (`_convert.HOST_VIEW = False`, as
`TPUDIST_TORCH_HOST_VIEW=0`): torch cannot view the device's memory, so parameters are copies kept
resident on the device between calls, and outputs and gradients are copied to the host device
(device 0) for torch, as on a TPU.
"""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys

import pytest

TOL = dict(rtol=1e-4, atol=1e-5)
# distinct shapes, so that a live array's shape says what it holds
PARAM_SHAPES = {(6, 7), (6,), (3, 6), (3,)}


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _force_host_view(host_view: bool) -> None:
    from tpudist.compile._torch import _convert
    _convert.HOST_VIEW = None if host_view else False


class _NewArrays:
    """The JAX arrays made inside the block (`.arrays`), each with its devices; the arrays alive
    before are held, so a new array cannot reuse an old one's id."""

    def __enter__(self):
        import jax
        gc.collect()
        self._before = jax.live_arrays()
        return self

    def __exit__(self, *exc):
        import jax
        old = {id(a) for a in self._before}
        self.arrays = [a for a in jax.live_arrays() if id(a) not in old]
        self._before = None

    def devices(self, shapes=None) -> set:
        return {d for a in self.arrays if shapes is None or a.shape in shapes for d in a.devices()}


def _check_call(run, model, eager, x, device, host_view: bool):
    """One forward+backward of `run` under `jax.default_device(device)`: every array it made is on
    `device` (with host_view False, what crossed to torch is on the host device instead), the
    values and `.grad`s are eager's."""
    import jax
    import torch
    model.zero_grad(), eager.zero_grad()
    with _NewArrays() as new, jax.default_device(device):
        out = run(x)
        out.square().sum().backward()
    eager(x).square().sum().backward()
    torch.testing.assert_close(out, eager(x), **TOL)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name} grad: {m}")
    host = jax.local_devices(backend="cpu")[0]
    assert new.arrays, "the call made no JAX array"
    assert new.devices() <= ({device} if host_view else {device, host}), new.devices()
    return new


@pytest.mark.tpudist(nprocs=1, cpu_devices=2)
@pytest.mark.parametrize("host_view", [True, False], ids=["cpu-view", "accelerator-path"])
def test_the_module_path_computes_on_the_default_device(host_view):
    import jax
    import torch
    import tpudist
    _force_host_view(host_view)
    one, zero = jax.devices()[1], jax.devices()[0]
    model = _model()
    eager = copy.deepcopy(model)
    cm = tpudist.compile(model)
    x = torch.randn(5, 7)
    first = _check_call(cm, model, eager, x, one, host_view)
    assert first.devices(PARAM_SHAPES) == {one}  # the parameters, held for the next calls
    if not host_view:
        again = _check_call(cm, model, eager, x, one, host_view)
        assert not again.devices(PARAM_SHAPES), "unchanged parameters were uploaded again"
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.step()   # in place: torch's version counters move, the resident copies go stale
        eager.load_state_dict(model.state_dict())
        stepped = _check_call(cm, model, eager, x, one, host_view)
        assert stepped.devices(PARAM_SHAPES) == {one}
        with torch.no_grad():
            model[2].weight.data = torch.randn(3, 6)   # a new storage behind the same Parameter
            eager[2].weight.data = model[2].weight.data.clone()
        _check_call(cm, model, eager, x, one, host_view)
    # the placement follows the default device: another one, then back
    _check_call(cm, model, eager, x, zero, host_view)
    _check_call(cm, model, eager, x, one, host_view)
    with _NewArrays() as plain, torch.no_grad():  # no default device set: JAX's first device
        torch.testing.assert_close(cm(x), eager(x), **TOL)
    assert plain.devices() == {jax.local_devices()[0]}


@pytest.mark.tpudist(nprocs=1, cpu_devices=2)
@pytest.mark.parametrize("host_view", [True, False], ids=["cpu-view", "accelerator-path"])
def test_the_dynamo_backend_computes_on_the_default_device(host_view):
    import jax
    import torch
    _force_host_view(host_view)
    torch._dynamo.reset()
    one, zero = jax.devices()[1], jax.devices()[0]
    model = _model()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tpudist")
    x = torch.randn(5, 7)
    first = _check_call(compiled, model, eager, x, one, host_view)
    assert first.devices(PARAM_SHAPES) == {one}
    _check_call(compiled, model, eager, x, zero, host_view)
    _check_call(compiled, model, eager, x, one, host_view)


@pytest.mark.tpudist(nprocs=1, cpu_devices=2)
def test_buffers_updated_by_the_graph_and_no_grad_calls_stay_on_the_default_device():
    """BatchNorm's running statistics (written back into torch each call) and an eval-mode call."""
    import jax
    import torch
    import tpudist
    one = jax.devices()[1]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    eager = copy.deepcopy(model)
    cm = tpudist.compile(model)
    x = torch.randn(5, 7)
    with _NewArrays() as new, jax.default_device(one):
        out = cm(x)
    torch.testing.assert_close(out, eager(x), **TOL)
    torch.testing.assert_close(model[1].running_mean, eager[1].running_mean, **TOL)
    assert new.devices() == {one}
    model.eval(), eager.eval()
    with _NewArrays() as new, jax.default_device(one), torch.no_grad():
        torch.testing.assert_close(cm(x), eager(x), **TOL)
    assert new.devices() == {one}


def test_doctor_names_the_device_each_path_computes_on(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "TPUDIST_TPU_DEVICES": f"{tmp_path}/accel*"}
    r = subprocess.run([sys.executable, "-m", "tpudist", "doctor", "--local"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.strip().split("  ")[0]: line for line in r.stdout.splitlines() if line.startswith("  ")}
    assert "cpu:0" in lines["tpudist.compile(module)"], r.stdout
    assert "cpu:0" in lines["torch.compile(backend='tpudist')"], r.stdout
    assert "2 device(s)" in lines["fused step, default mesh"], r.stdout
    assert "cpu:0" in lines["collectives"], r.stdout
