"""Text tables of the analysis that keep their layout for any value: every number is formatted to at most 10
characters (fixed point in a normal range, scientific notation outside it) and columns are padded."""

from __future__ import annotations

import math


def finite_or_none(x: float) -> float | None:
    """x, or None for nan/inf (JSON has neither)."""
    return x if math.isfinite(x) else None


def format_number(x: float | None, signed: bool = False) -> str:
    """A table cell of at most 10 characters for any float: fixed point with 3 decimals in [1e-3, 1e4), scientific
    notation outside (1.7e39 -> "1.70e+39"), "inf"/"nan"/"n/a" (None) otherwise."""
    if x is None:
        return "n/a"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return ("+" if signed and x > 0 else "-" if x < 0 else "") + "inf"
    sign = "+" if signed else ""
    if x != 0 and not 1e-3 <= abs(x) < 1e4:
        return f"{x:{sign}.2e}"
    return f"{x:{sign}.3f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table with padded columns: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
