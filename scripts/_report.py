"""Plain-text tables for the benchmark scripts' console output."""

from __future__ import annotations


def text_table(rows: list[dict], cols: list[str]) -> str:
    """`rows` as right-aligned columns `cols` (dict keys, also the header), a rule under the header."""
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]

    def line(values: list) -> str:
        return "  ".join(str(v).rjust(w) for v, w in zip(values, widths))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line([r[c] for c in cols]) for r in rows])
