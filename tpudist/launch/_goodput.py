"""The job's goodput across restarts: what `fit` on rank 0 reports (contract.GOODPUT_REPORT, one
line on its stderr at each epoch's end and at its own end), summed over the attempts, over the
launcher's wall time from its start to the job's end.

    goodput = JobGoodput()
    goodput.read(line.data)                 # each rank-0 chatter line (others are ignored)
    print(goodput.summary(wall_s=123.4))    # None where no fit reported
"""

from __future__ import annotations

import json
from typing import Any

from tpudist import contract

_PREFIX = contract.GOODPUT_REPORT.encode()


class JobGoodput:
    """The latest report of each attempt, and the job's summary from them."""

    def __init__(self) -> None:
        self.reports: dict[int, dict[str, Any]] = {}

    def read(self, data: bytes) -> bool:
        """Takes `data` if it is a report (True), else leaves it (False)."""
        if not data.startswith(_PREFIX):
            return False
        try:
            report = json.loads(data[len(_PREFIX):])
            self.reports[int(report["attempt"])] = report
        except (ValueError, KeyError, TypeError):
            return False  # not ours after all: a program printing the prefix
        return True

    def summary(self, wall_s: float) -> str | None:
        """One line: the job's goodput over `wall_s` and where the rest went."""
        if not self.reports or wall_s <= 0:
            return None
        attempts = [self.reports[a] for a in sorted(self.reports)]
        stepping = compile_s = data_s = checkpoint_s = redone = 0.0
        for i, r in enumerate(attempts):
            busy = max(r["wall_s"] - r["compile_s"] - r["data_s"] - r["checkpoint_s"], 0.0)
            steps = r["global_step"] - r["first_step"]
            # steps after the checkpoint the next attempt resumed from are run again: not progress
            later = attempts[i + 1]["first_step"] if i + 1 < len(attempts) else r["global_step"]
            lost = busy * min(max(r["global_step"] - later, 0) / steps, 1.0) if steps > 0 else 0.0
            stepping += busy - lost
            redone += lost
            compile_s, data_s, checkpoint_s = compile_s + r["compile_s"], data_s + r["data_s"], \
                checkpoint_s + r["checkpoint_s"]
        rest = max(wall_s - stepping - compile_s - data_s - checkpoint_s - redone, 0.0)
        n = len(attempts)
        return (f"tpudist: goodput {100 * stepping / wall_s:.0f}% over the job ({n} attempt{'s' if n > 1 else ''}, "
                f"{wall_s:.1f} s): stepping {stepping:.1f} s; compile {compile_s:.1f} s, data {data_s:.1f} s, "
                f"checkpoints {checkpoint_s:.1f} s, steps run again after a restart {redone:.1f} s, startup, "
                f"restarts and the rest {rest:.1f} s")
