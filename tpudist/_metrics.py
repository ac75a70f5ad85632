"""TensorBoard scalars from rank 0: `ScalarLog` writes them, `read_scalars` reads them back.

    log = tpudist.ScalarLog("logs/run1")            # on every process; only rank 0 writes
    for step, loss in enumerate(losses):
        log.scalar("train/loss", loss, step)
    log.close()
    tpudist.read_scalars("logs/run1")               # {"train/loss": [(0, 0.69), (1, 0.52), ...]}

The files are TensorBoard's own event files, written by `torch.utils.tensorboard.SummaryWriter`
(the writer PyTorch programs already use) and read by TensorBoard's event accumulator, the reader
behind its dashboards. `tensorboard --logdir logs` shows them.

Values are stored as float32, TensorBoard's scalar type: its default loader (the Rust data
server, `--load_fast`) skips float64 scalars without a word, so a value reads back as
`float(numpy.float32(value))`; a float32 loss reads back exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class ScalarLog:
    """A scalar writer for one job: on rank 0 it writes `log_dir/events.out.tfevents.*`; on every
    other rank each call does nothing and no file is created.

    `rank` defaults to this process's rank (`tpudist.process_index()`, joining the job if needed).
    `flush_secs`: the longest a logged value waits in memory before reaching the file; `flush()`
    and `close()` write at once. Also a context manager that closes on exit.
    """

    def __init__(self, log_dir: str | os.PathLike[str], rank: int | None = None, *,
                 flush_secs: float = 30.0) -> None:
        if rank is None:
            import tpudist._runtime as _runtime
            rank = _runtime.job().rank
        self.log_dir = Path(log_dir)
        self.rank = rank
        self._writer: Any = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=max(1, round(flush_secs)))

    def scalar(self, tag: str, value: Any, step: int) -> None:
        """Logs `value` (a Python number, or a one-element numpy / torch / jax value, or a
        `tpudist.LazyScalar`) as `tag` at `step`; a no-op on ranks other than 0."""
        if self._writer is None:
            return
        try:  # .item(): torch / numpy / jax values and tpudist.LazyScalar, without a 1-d float() warning
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"ScalarLog.scalar({tag!r}): value {value!r} is not a number; log a "
                            "Python number or a one-element array") from None
        self._writer.add_scalar(tag, number, global_step=int(step), new_style=True)

    def flush(self) -> None:
        """Writes every logged value to the event file now."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file; later calls to `scalar` are errors on rank 0."""
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> ScalarLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_scalars(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files of `log_dir` (one TensorBoard run; subdirectories
    are other runs and are not read), as `{tag: [(step, value), ...]}` in the order written.

    Reads with TensorBoard's own event accumulator, keeping every value (TensorBoard's dashboards
    sample), so files written by `ScalarLog`, `SummaryWriter`, tensorboardX or `tf.summary` all
    read the same way. FileNotFoundError if `log_dir` holds no event file.
    """
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    path = Path(log_dir)
    if not any(path.glob("*tfevents*")):
        raise FileNotFoundError(f"no TensorBoard event files (events.out.tfevents.*) in {path}")
    acc = pea.EventAccumulator(str(path), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags()[pea.TENSORS]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto).item())) for e in acc.Tensors(tag)]
    return out
