"""scripts/bench_layouts.py end to end at a tiny size: the hand-written JAX expert-parallel layer,
context-parallel decoder and pipelined decoder give tpudist's first loss on the same weights and batch
(the script fails loudly otherwise), and each layout's row lands in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "32", "--intermediate", "64", "--experts", "4", "--tokens", "64", "--width", "32",
        "--vocab", "64", "--seq", "32", "--pipeline-layers", "4", "--microbatches", "4", "--pipeline-rows", "16",
        "--pipeline-seq", "16", "--rounds", "1", "--steps", "1"]


def test_bench_layouts_runs_every_layout_against_jax_by_hand(tmp_path):
    out = tmp_path / "layouts.json"
    env = {**os.environ, "TPUDIST_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_layouts.py"), *TINY, "--no-plot",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"experts", "context", "pipeline"}
    for row in rows.values():
        assert row["tpudist_ms"] > 0 and row["jax_ms"] > 0
        assert abs(row["first_loss"]["jax"] - row["first_loss"]["tpudist"]) <= 1e-4 * row["first_loss"]["tpudist"]
    assert rows["experts"]["shardings"]["experts.gate_up_proj"].startswith("P('expert'")
    assert rows["experts"]["params_per_device"] * 3 < rows["experts"]["params_bytes"]
    pipeline = rows["pipeline"]
    assert pipeline["shardings"]["blocks.*.qkv.weight"].startswith("P('stage'")
    assert pipeline["tpudist_2m_ms"] > 0 and pipeline["jax_2m_ms"] > 0
    assert pipeline["bubble_ticks"] == 3 / (4 + 3)  # S - 1 of the M + S - 1 ticks
    assert all(isinstance(pipeline[f"bubble_{side}"], float) for side in ("tpudist", "jax"))  # timing: any sign
    first = pipeline["first_loss_2m"]
    assert abs(first["jax"] - first["tpudist"]) <= 1e-4 * first["tpudist"]
