"""scripts/_plots.py draws the benchmarks' PNGs; bench_collectives.py --plot-only redraws a run's
picture from its JSON, beside it, without running anything."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import _plots  # noqa: E402 - scripts/ is not a package


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_ratio_vs_size_draws_one_line_per_collective_and_process_count(tmp_path):
    rows = [{"collective": c, "procs": n, "bytes": b, "ratio": r}
            for c in ("all_reduce", "all_gather") for n in (2, 4)
            for b, r in ((0, 9.0), (4, 1.3), (1 << 10, 0.6), (1 << 20, 0.9), (64 << 20, 1.4))]
    out = _plots.ratio_vs_size(rows, tmp_path / "sub" / "ratio.png")
    assert out == tmp_path / "sub" / "ratio.png"
    width, height = _png_size(out)
    assert width > 600 and height > 400
    with pytest.raises(ValueError, match="no rows with bytes > 0"):
        _plots.ratio_vs_size([{"collective": "x", "procs": 2, "bytes": 0, "ratio": 1.0}], tmp_path / "none.png")


def test_time_bars_groups_bars_per_row_and_leaves_gaps_for_missing_values(tmp_path):
    rows = [{"model": "mlp", "batch": 64, "eager_ms": 1.0, "compiled_ms": 0.5, "jax_ms": 0.4},
            {"model": "conv", "batch": 64, "eager_ms": 3.0, "compiled_ms": None},
            {"model": "transformer", "batch": 8, "eager_ms": 30.0, "compiled_ms": 12.0, "jax_ms": 11.0}]
    out = _plots.time_bars(rows, tmp_path / "bars.png", keys=["eager_ms", "compiled_ms", "jax_ms"],
                           labels=["eager", "compiled", "jax"], group=("model", "batch"), log=True)
    assert _png_size(out)[0] >= 600
    with pytest.raises(ValueError, match="2 labels for 3 keys"):
        _plots.time_bars(rows, tmp_path / "bad.png", keys=["eager_ms", "compiled_ms", "jax_ms"], labels=["a", "b"])


def test_bench_collectives_plot_only_redraws_a_committed_run(tmp_path):
    source = REPO / "docs" / "bench" / "collectives_cpu_run6.json"
    run = shutil.copy(source, tmp_path / "run.json")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_collectives.py"), "--plot-only", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"PNG: {tmp_path / 'run.png'}"
    assert _png_size(tmp_path / "run.png")[0] > 600
    assert json.loads(Path(run).read_text())["rows"], "the JSON is read, not rewritten"
