"""TPU slices: what an accelerator type means (`topology`) and each process's TPU environment (`env`).

    slice_topology("v4-32").host_bounds                 # (1, 1, 4)
    tpu_process_env(cluster, worker=1, local_rank=0, nproc_per_host=4)["CLOUD_TPU_TASK_ID"]   # '4'

The TPU cluster sources (`tpudist.launch.clusters.tpu_metadata`, `.gcloud`) find the workers; this
package turns the slice they found into the `TPU_*` variables libtpu, JAX and torch_xla read.
See docs/tpu.md.
"""

from __future__ import annotations

from tpudist.launch.tpu.env import (check_nproc_per_host, cluster_slice, coordinator_address,
                                    default_nproc_per_host, tpu_process_env, worker_env)
from tpudist.launch.tpu.topology import GENERATIONS, SliceTopology, slice_topology

__all__ = ["GENERATIONS", "SliceTopology", "check_nproc_per_host", "cluster_slice", "coordinator_address",
           "default_nproc_per_host", "slice_topology", "tpu_process_env", "worker_env"]
