"""Integer arithmetic shared by every package (the router imports no engine code)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up: how many ``b``-sized blocks hold ``a`` items."""
    return -(-a // b)
