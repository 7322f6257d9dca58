"""What every part of `report.html()`'s page shares: escaping, byte sizes, and the
page's fixed choices (colours, how much is drawn before "Show all")."""

from html import escape
from typing import Any

from .._sharding.describe import describe_bytes


# The mesh axes' colours, in the mesh's order (Google's chart palette).
AXIS_COLORS = ("#1a73e8", "#e8710a", "#188038", "#9334e6", "#d01884", "#12b5cb")
SHOWN_ARRAYS = 12  # arrays drawn before "Show all"
SHOWN_SITES = 10  # lines of code in the collectives panel
MEMORY = (
    ("arguments", "var(--args)"),
    ("outputs", "var(--outs)"),
    ("temporaries", "var(--temps)"),
    ("code", "var(--code)"),
)


def esc(value: Any) -> str:
    """`value` as HTML text; `None` as nothing."""
    return escape("" if value is None else str(value))


def human(n: Any) -> str:
    """A number of bytes as people read it (`1.5 GiB`); `?` when unknown."""
    return "?" if n is None else describe_bytes(n)
