"""examples/train_llama_fsdp.py through the real launcher: a Hugging Face Llama trained by the sharded
fused step (FSDP, and FSDP x TP) on 2 processes x 2 CPU devices, as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tpudist

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"processes 2, devices 4, (?P<axes>[a-z0-9 ,]+), loss (?P<first>\d+\.\d+) -> (?P<last>\d+\.\d+), "
                     r"params\+optimizer per device (?P<held>\d+\.\d+) KiB of (?P<whole>\d+\.\d+) KiB")


def launch(*args: str) -> re.Match:
    """Runs the example on 2 local processes of 2 CPU devices each; its summary line, parsed."""
    done = subprocess.run(
        [sys.executable, "-m", "tpudist.xla_dist", "--local", "--nproc-per-host", "2", "--cpu-devices", "2", "--",
         sys.executable, "examples/train_llama_fsdp.py", *args],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stderr.replace("[Gloo]", ""), done.stderr
    summary = SUMMARY.search(done.stdout)
    assert summary, done.stdout
    assert done.stdout.count("fused step memory per device") == 2, done.stdout  # each process's table
    return summary


def test_llama_trains_with_fsdp_through_the_launcher(tmp_path):
    """Every linear layer and embedding of the default config is >= 16 KiB, so each device holds
    about a quarter of the parameters and AdamW moments (only the norms are replicated)."""
    summary = launch("--checkpoint", str(tmp_path / "ckpt"))
    assert summary["axes"] == "fsdp 4"
    assert float(summary["last"]) < 0.5 * float(summary["first"]), summary[0]
    held, whole = float(summary["held"]), float(summary["whole"])
    assert whole / 4 <= held <= 1.25 * whole / 4, summary[0]
    assert tpudist.checkpoint.latest_step(tmp_path / "ckpt") == 60


def test_llama_trains_with_fsdp_x_tp_through_the_launcher():
    """The same training under FSDP(2) x TP(2): the projections and the embeddings split over both
    axes, so again each device holds about a quarter."""
    summary = launch("--tp", "2")
    assert summary["axes"] == "fsdp 2, model 2"
    assert float(summary["last"]) < 0.5 * float(summary["first"]), summary[0]
    held, whole = float(summary["held"]), float(summary["whole"])
    assert whole / 4 <= held <= 1.25 * whole / 4, summary[0]
