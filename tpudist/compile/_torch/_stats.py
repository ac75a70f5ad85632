"""The counters every compiled torch object keeps, shared by the module and train rooms."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CaptureStats"]


@dataclass
class CaptureStats:
    """What a compiled module and a fused train step both count, so one loop reads either the same way.

    compiles: input signatures (shapes, dtypes, train/eval modes, autocast) captured and compiled;
        a steady training loop stays at 1.
    calls: all calls.
    capture_seconds: time spent in torch.export and decomposition.
    recaptures: captures again because a data-dependent value the capture specialised on changed
        (also counted in `compiles`).
    """

    compiles: int = 0
    calls: int = 0
    capture_seconds: float = 0.0
    recaptures: int = 0
