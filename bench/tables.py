"""Markdown tables of measured numbers, as the scripts of bench/ write them."""

from __future__ import annotations


def cell(value, spec: str = "{:,.0f}") -> str:
    """A number in a table: n/a where nothing was measured."""
    return "n/a" if value is None else spec.format(value)


def percent(share) -> str:
    """A share (0.073) as a percentage (7.3%): n/a where nothing was measured."""
    return "n/a" if share is None else f"{100 * share:.1f}%"


def row(cells: list[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"
