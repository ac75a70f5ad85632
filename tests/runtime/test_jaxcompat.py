"""The private JAX calls behind tpudist._jaxcompat work on this JAX, not through their fallbacks.

Each fallback keeps tpudist correct but slower (or, for backend_started, blind), so an upgrade
that moves a private API shows up here, named, rather than as a slowdown or a vaguer error later.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import numpy as np
import torch
import torch.utils.dlpack
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpudist import _jaxcompat, contract
from tpudist.testing import run_on_mesh


def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n * 4 + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + n * 4].view(np.float32)


def test_import_buffer_shares_host_memory_without_a_copy():
    device = jax.local_devices(backend="cpu")[0]
    host = _aligned(16)
    host[:] = np.arange(16)
    block = _jaxcompat.import_buffer(host, device)
    assert block is not None, "the private DLPack import is gone: every small collective now copies"
    assert block.unsafe_buffer_pointer() == host.ctypes.data
    np.testing.assert_array_equal(np.asarray(block), np.arange(16, dtype=np.float32))
    tensor = torch.arange(5, dtype=torch.int64)
    from_torch = _jaxcompat.import_buffer(tensor, device)
    assert from_torch is not None and from_torch.unsafe_buffer_pointer() == tensor.data_ptr()


def test_import_buffer_takes_a_dlpack_capsule_as_it_takes_the_tensor():
    device = jax.local_devices(backend="cpu")[0]
    tensor = torch.arange(6, dtype=torch.float32)
    array = _jaxcompat.import_buffer(torch.utils.dlpack.to_dlpack(tensor), device)
    assert array is not None and array.unsafe_buffer_pointer() == tensor.data_ptr()
    np.testing.assert_array_equal(np.asarray(array), np.arange(6, dtype=np.float32))


def test_export_buffer_hands_torch_the_arrays_memory_once_its_computation_is_done():
    x = jax.numpy.arange(1 << 16, dtype=jax.numpy.float32)
    slow = jax.jit(lambda v: jax.lax.fori_loop(0, 200, lambda i, a: jax.numpy.sin(a) + 1.0, v))
    expected = np.asarray(slow(x))
    fresh = slow(x)  # dispatched, not waited for: the export must wait
    capsule = _jaxcompat.export_buffer(fresh)
    assert capsule is not None, "the private DLPack export is gone: every compiled-module output now pays the public path"
    tensor = torch.utils.dlpack.from_dlpack(capsule)
    assert tensor.data_ptr() == fresh.unsafe_buffer_pointer()
    np.testing.assert_array_equal(tensor.numpy(), expected)


def test_import_buffer_returns_none_where_dlpack_cannot_carry_the_value():
    device = jax.local_devices(backend="cpu")[0]
    assert _jaxcompat.import_buffer(np.ones(3, jax.numpy.bfloat16), device) is None  # numpy has no DLPack bfloat16


def test_assemble_builds_the_global_array_without_the_public_checks(monkeypatch):
    device = jax.local_devices(backend="cpu")[0]
    sharding = NamedSharding(Mesh(np.array([[device]]), ("g", "s")), P("g", "s"))
    shard = jax.device_put(np.arange(6, dtype=np.float32).reshape(1, 1, 6), device)

    def public_path(*args, **kwargs):
        raise AssertionError("assemble took the public fallback: the private ArrayImpl constructor moved")
    monkeypatch.setattr(jax, "make_array_from_single_device_arrays", public_path)
    array = _jaxcompat.assemble((1, 1, 6), sharding, [shard])
    assert array.shape == (1, 1, 6) and array.sharding == sharding
    np.testing.assert_array_equal(np.asarray(array), np.arange(6, dtype=np.float32).reshape(1, 1, 6))


_BACKEND = """
from tpudist import _jaxcompat
assert _jaxcompat.backend_started() is False
import jax
assert _jaxcompat.backend_started() is False   # importing jax starts nothing
jax.devices()
assert _jaxcompat.backend_started() is True
assert _jaxcompat.distributed_client() is None  # not in a distributed job
print("ok")
"""


def test_backend_started_and_no_client_outside_a_job():
    env = {k: v for k, v in os.environ.items() if k not in contract.ALL}
    out = subprocess.run([sys.executable, "-c", _BACKEND], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def exchange_through_the_client() -> str:
    import tpudist
    client = _jaxcompat.distributed_client()
    rank = tpudist.process_index()
    client.key_value_set(f"test/{rank}", f"from {rank}")
    return client.blocking_key_value_get(f"test/{1 - rank}", 30_000)


def test_distributed_client_is_the_jobs_key_value_store():
    assert run_on_mesh(exchange_through_the_client, nprocs=2) == ["from 1", "from 0"]


_PRIVATE = re.compile(r"\bjax\._src\b|\bjaxlib\.|\bxla_client\b|\bxla_extension\b")


def test_no_other_module_calls_private_jax():
    """A JAX upgrade touches tpudist/_jaxcompat.py only."""
    package = os.path.dirname(_jaxcompat.__file__)
    found = []
    for directory, _, files in os.walk(package):
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(".py") and path != _jaxcompat.__file__:
                with open(path) as f:
                    found += [f"{os.path.relpath(path, package)}:{i}: {line.strip()}"
                              for i, line in enumerate(f, 1) if _PRIVATE.search(line)]
    assert not found, "private JAX calls outside tpudist/_jaxcompat.py:\n" + "\n".join(found)


def test_every_process_writes_the_compilation_cache_through_the_private_hook():
    """Where the hook moved, processes other than 0 compile everything again after a restart
    (tests/compile/test_jax_step.py shows the hits)."""
    assert _jaxcompat.cache_writes_from_every_process(), "jax._src.compiler._compile_and_write_cache moved"
