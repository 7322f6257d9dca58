"""What every part of `report.html()`'s page shares: escaping, byte sizes, bars, and
the page's fixed choices (colours, how much is drawn before "Show all")."""

from html import escape
from typing import Any

from .._sharding.describe import describe_bytes


# The mesh axes' colours, in the mesh's order (Google's chart palette).
AXIS_COLORS = ("#1a73e8", "#e8710a", "#188038", "#9334e6", "#d01884", "#12b5cb")
SHOWN_ARRAYS = 12  # arrays drawn before "Show all"
SHOWN_SITES = 10  # lines of code in the collectives panel
# The parts of memory per device, each with the class of its colour (page.css).
MEMORY = (
    ("arguments", "part-args"),
    ("outputs", "part-outs"),
    ("temporaries", "part-temps"),
    ("code", "part-code"),
)


def esc(value: Any) -> str:
    """`value` as HTML text; `None` as nothing."""
    return escape("" if value is None else str(value))


def human(n: Any) -> str:
    """A number of bytes as people read it (`1.5 GiB`); `?` when unknown."""
    return "?" if n is None else describe_bytes(n)


def bar(parts: list[tuple[float, str, str]], cls: str, ident: str = "") -> str:
    """A bar of `parts` side by side, each `(percent of the width, class of its
    colour, tooltip)`, in a `<div class="{cls}">` (with the id `ident`). Drawn in
    SVG, whose geometry is attributes: the page's policy allows no `style`
    attribute."""
    rects, x = [], 0.0
    for width, part, title in parts:
        width = max(0.0, width)
        tip = f"<title>{esc(title)}</title>" if title else ""
        rects.append(
            f'<rect x="{x:.3f}" width="{width:.3f}" height="1" class="{part}">'
            f"{tip}</rect>"
        )
        x += width
    attributes = f'class="{cls}"' + (f' id="{ident}"' if ident else "")
    return (
        f'<div {attributes}><svg viewBox="0 0 100 1" preserveAspectRatio="none">'
        + "".join(rects)
        + "</svg></div>"
    )
