"""tpudist.ScalarLog / read_scalars: rank 0's scalars round-trip through real TensorBoard event
files, in the form TensorBoard's default (Rust) loader shows; other ranks write nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tpudist


def test_scalars_read_back_as_logged(tmp_path):
    losses = [np.float32(1.0 / (s + 1)) for s in range(40)]  # more than TensorBoard's sample of 10
    with tpudist.ScalarLog(tmp_path, rank=0) as log:
        for step, loss in enumerate(losses):
            log.scalar("train/loss", loss, step)
        log.scalar("train/lr", 0.1, 0)              # a Python float: stored as float32
        log.scalar("train/lr", torch.tensor(0.05), 10)
        log.scalar("compile_s", np.array([2.5]), 0)
    scalars = tpudist.read_scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/lr", "compile_s"}
    assert scalars["train/loss"] == [(s, float(v)) for s, v in enumerate(losses)]  # float32: exact
    assert scalars["train/lr"] == [(0, float(np.float32(0.1))), (10, float(np.float32(0.05)))]
    assert scalars["compile_s"] == [(0, 2.5)]


def test_values_are_float32_tensors_which_tensorboards_fast_loader_reads(tmp_path):
    # TensorBoard's Rust data server (its default loader) silently skips float64 scalars.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto import types_pb2
    log = tpudist.ScalarLog(tmp_path, rank=0)
    log.scalar("x", 1.5, 1)
    log.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    values = [v for e in EventFileLoader(str(path)).Load() for v in e.summary.value]
    assert [(v.tag, v.tensor.dtype, v.metadata.plugin_data.plugin_name) for v in values] == \
        [("x", types_pb2.DT_FLOAT, "scalars")]


def test_other_ranks_write_nothing(tmp_path):
    log = tpudist.ScalarLog(tmp_path / "logs", rank=1)
    log.scalar("loss", 0.5, 0)
    log.flush()
    log.close()
    assert not (tmp_path / "logs").exists()


def test_bad_values_and_empty_directories_are_errors(tmp_path):
    log = tpudist.ScalarLog(tmp_path, rank=0)
    with pytest.raises(TypeError, match=r"'loss'.*not a number"):
        log.scalar("loss", "high", 0)
    log.close()
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        tpudist.read_scalars(tmp_path / "missing")
