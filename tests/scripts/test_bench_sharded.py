"""scripts/bench_sharded.py end to end at a tiny size: the JAX port of Llama, unrolled and with its
layers under lax.scan, matches LlamaForCausalLM's parameters and first loss (the script fails
loudly otherwise), and a row of memory ratios, step times and like-for-like ratios lands in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--vocab", "128", "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--seq", "16", "--rounds", "1", "--steps", "1", "--warmup", "0"]


def test_bench_sharded_runs_fsdp_x_tp_against_the_jax_port_unrolled_and_scanned(tmp_path):
    out = tmp_path / "sharded.json"
    env = {**os.environ, "TPUDIST_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sharded.py"), *TINY, "--layouts", "fsdp_tp",
                           "--no-plot", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    row, = json.loads(out.read_text())["rows"]
    assert row["layout"] == "fsdp_tp" and row["split"] == 4 and row["mesh"] == "fsdp2xmodel2"
    # the same bytes per device as the JAX port, but for the step counts (tpudist's one per parameter)
    assert abs(row["state_max"] - row["jax_state_max"]) < 1024
    assert 1.0 <= row["over_split"] < 2.0
    assert all(row[f"{side}_ms"] > 0 for side in ("tpudist_scan", "tpudist_noscan", "jax_unrolled", "jax_scan"))
    assert row["tpudist_scan_over_jax_scan"] > 0 and row["tpudist_noscan_over_jax_unrolled"] > 0
    losses = row["first_loss"]
    assert abs(losses["jax_scan"] - losses["jax_unrolled"]) <= 1e-4 * losses["jax_unrolled"]
    assert row["shardings"]["model.layers.0.self_attn.q_proj.weight"] == "P('model', 'fsdp')"
