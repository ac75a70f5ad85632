"""The benchmarks' pictures: PNGs drawn with matplotlib (Agg, no display) from their JSON rows.

    import _plots                                     # from a script in scripts/
    _plots.ratio_vs_size(rows, "bench-results/collectives.png")
    _plots.time_bars(rows, "bench-results/torch_single.png", keys=["eager_ms", "compiled_ms"])

matplotlib is the `bench` extra (`pip install -e .[bench]`; the dev venv of ./scripts/test has it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from _bench import human_bytes

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
           "tab:gray", "tab:olive", "tab:cyan")
_DASHES = ("-", "--", ":", "-.")


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")  # files only: never a window, works without a display
    import matplotlib.pyplot as plt
    return plt


def ratio_vs_size(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str | None = None,
                  reference: str = "gloo") -> Path:
    """One line per (collective, process count): `ratio` (tpudist time / `reference` time) against
    message size `bytes`, log-log, with the 1.0 line where both are as fast. Rows are
    scripts/bench_collectives.py's: {"collective", "procs", "bytes", "ratio", ...}. Returns `path`.
    """
    plt = _pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if r["bytes"] > 0:
            series.setdefault((r["collective"], r["procs"]), []).append((r["bytes"], r["ratio"]))
    if not series:
        raise ValueError("ratio_vs_size: no rows with bytes > 0 to draw")
    collectives = sorted({c for c, _ in series})
    procs = sorted({p for _, p in series})
    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=110)
    for (name, n), points in sorted(series.items()):
        points.sort()
        ax.plot([b for b, _ in points], [q for _, q in points], marker="o", markersize=3.5,
                color=_COLORS[collectives.index(name) % len(_COLORS)],
                linestyle=_DASHES[procs.index(n) % len(_DASHES)], label=f"{name}, {n} processes")
    ax.axhline(1.0, color="black", linewidth=1, alpha=0.7)
    ax.text(1.0, 1.0, f" {reference} ", transform=ax.get_yaxis_transform(), va="bottom", ha="right",
            fontsize=8, alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks_x: list[int] = []
    for b in sorted({b for pts in series.values() for b, _ in pts}):
        if not ticks_x or b >= 4 * ticks_x[-1]:  # labels that do not collide
            ticks_x.append(b)
    ax.xaxis.set_major_locator(FixedLocator(ticks_x))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda b, _: human_bytes(b)))
    ratios = [q for pts in series.values() for _, q in pts]
    ticks = [t for t in (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0)
             if min(ratios) / 1.2 <= t <= max(ratios) * 1.2] or [1.0]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda q, _: f"{q:g}x"))
    ax.set_xlabel("message size (the full buffer, as nccl-tests count it)")
    ax.set_ylabel(f"time, tpudist / {reference} (below 1: tpudist faster)")
    ax.set_title(title or f"tpudist collectives vs {reference}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(series) > 4 else 1)
    fig.tight_layout()
    return _save(fig, plt, path)


def time_bars(rows: Sequence[Mapping[str, Any]], path: str | Path, *, keys: Sequence[str],
              labels: Sequence[str] | None = None,
              group: str | Sequence[str] | Callable[[Mapping[str, Any]], str] = "model",
              title: str | None = None, ylabel: str = "time per step (ms)", log: bool = False) -> Path:
    """Grouped bars: one group per row (named by `group`: a key, several keys joined, or a
    function of the row), one bar per entry of `keys` (e.g. eager_ms, compiled_ms, fused_ms,
    jax_ms), labelled by `labels` (default: the keys). A missing or None value leaves a gap.
    `log=True` for times spanning orders of magnitude. Returns `path`.
    """
    plt = _pyplot()
    if not rows:
        raise ValueError("time_bars: no rows to draw")
    labels = list(labels or keys)
    if len(labels) != len(keys):
        raise ValueError(f"time_bars: {len(labels)} labels for {len(keys)} keys")
    if callable(group):
        name_of = group
    else:
        fields = [group] if isinstance(group, str) else list(group)
        name_of = lambda r: " ".join(f"{r[f]}" if i == 0 else f"{f}={r[f]}" for i, f in enumerate(fields))  # noqa: E731
    names = [name_of(r) for r in rows]
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 0.3 * len(rows) * len(keys) + 2)), 5.2), dpi=110)
    for k, (key, label) in enumerate(zip(keys, labels)):
        xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(rows))]
        values = [r.get(key) for r in rows]
        shown = [(x, v) for x, v in zip(xs, values) if v is not None]
        bars = ax.bar([x for x, _ in shown], [v for _, v in shown], width=width * 0.95,
                      color=_COLORS[k % len(_COLORS)], label=label)
        ax.bar_label(bars, fmt="%.3g", fontsize=7 if len(rows) * len(keys) <= 24 else 6, padding=1)
    ax.set_xticks(range(len(rows)), names, rotation=30 if max(map(len, names)) > 8 else 0, ha="right"
                  if max(map(len, names)) > 8 else "center")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
