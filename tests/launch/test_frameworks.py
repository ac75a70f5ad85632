"""Programs written for JAX alone, launched unchanged (issue 19, item 5): `jax.distributed.initialize()`
with no arguments joins the job the launcher started, over real SSH (tests/launch/conftest.py)."""

from __future__ import annotations

import re
import textwrap

import pytest
from launchutil import launch

pytestmark = pytest.mark.slow

PLAIN_JAX = textwrap.dedent("""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize()          # no arguments: what the launcher set is enough
    assert jax.process_count() == 2, jax.process_count()
    rank = jax.process_index()
    gathered = multihost_utils.process_allgather(np.array([10.0 * (rank + 1)]))
    mesh = jax.make_mesh((jax.device_count(),), ("i",))
    local = np.full((jax.local_device_count(),), rank + 1.0, np.float32)
    x = multihost_utils.host_local_array_to_global_array(local, mesh, P("i"))
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))
    total = float(np.asarray(psum(x).addressable_data(0))[0])
    print("PLAIN", rank, jax.process_count(), jax.device_count(), gathered.ravel().tolist(), total, flush=True)
""")


@pytest.mark.parametrize("cpu_devices", [None, 2])
def test_jax_distributed_initialize_without_arguments_joins_the_launched_job(sshd, tmp_path, cpu_devices):
    script = tmp_path / "plain_jax.py"
    script.write_text(PLAIN_JAX)
    flags = ["--cpu-devices", str(cpu_devices)] if cpu_devices else []
    r = launch(*sshd.launcher_flags(2), *flags, "--", "python", str(script), timeout=180)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    devices_per_process = cpu_devices or 1
    seen = {}
    for line in r.stdout.decode().splitlines():
        m = re.match(r"^\[w(\d) r(\d) 127\.0\.0\.(\d)\] PLAIN (\d) (\d) (\d) \[(.*)\] (\S+)$", line)
        if m:
            assert m[1] == m[2] == m[4] and int(m[3]) == 2 + int(m[1])
            assert (int(m[5]), int(m[6])) == (2, 2 * devices_per_process)
            seen[int(m[4])] = ([float(v) for v in m[7].split(",")], float(m[8]))
    assert sorted(seen) == [0, 1], r.stdout.decode()
    for gathered, total in seen.values():
        assert gathered == [10.0, 20.0]
        assert total == devices_per_process * (1.0 + 2.0)  # every device of rank r holds r + 1
