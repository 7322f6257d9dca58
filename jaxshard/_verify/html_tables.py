"""The full tables of `report.html()`'s page, each with a search box above it and
sortable by each column (`page.js`): the contracts, the inputs and outputs, and the
collectives by line of code."""

from typing import Any

from .html_text import esc, human


def all_tables(v: Any) -> str:
    return "\n".join(
        [
            _contracts(v),
            _arrays(v, "inputs", "Inputs"),
            _arrays(v, "outputs", "Outputs"),
            _sites(v),
        ]
    )


def _table(v: Any, name: str, title: str, head: list[str], rows: list[str]) -> str:
    """A searchable, sortable table; `rows` are `<tr>` elements."""
    if not rows:
        return ""
    table = f"{v.root}-{name}"
    heads = "".join(f'<th scope="col">{esc(h)}</th>' for h in head)
    return (
        f'<section class="table"><div class="tools"><h2>{esc(title)} '
        f'<span class="muted small" id="{table}-count">{len(rows)}</span></h2>'
        f'<input type="search" placeholder="Search {esc(title.lower())}" '
        f'aria-label="Search {esc(title.lower())}" data-filter="{table}"></div>'
        f'<div class="scroll"><table class="data" id="{table}"><thead><tr>{heads}'
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div></section>"
    )


def _num(n: Any, text: str) -> str:
    return f'<td class="num" data-sort="{esc(-1 if n is None else n)}">{esc(text)}</td>'


def _contracts(v: Any) -> str:
    rows = []
    for c in v.data.get("contracts", []):
        ok = c.get("ok", True)
        verdict = (
            '<span class="ok">ok</span>' if ok else '<span class="no">VIOLATED</span>'
        )
        rows.append(
            f'<tr class="{"" if ok else "bad"}">'
            f'<td class="mono">{esc(c.get("function"))}</td>'
            f'<td class="mono">{esc(c.get("value"))}</td>'
            f'<td class="mono">{esc(c.get("expected"))}</td>'
            f'<td class="mono">{esc(c.get("actual"))}</td>'
            f'<td class="mono">{esc(_type(c))}</td><td>{verdict}</td></tr>'
        )
    head = ["function", "value", "expected", "actual", "as a JAX type", "verdict"]
    return _table(v, "contracts", "Contracts", head, rows)


def _type(contract: dict) -> str:
    """Inside a shard_map body: the global array's type, and the block's."""
    block = contract.get("block")
    return f"{contract.get('type')}, block {block}" if block else contract.get("type")


def _arrays(v: Any, side: str, title: str) -> str:
    layouts = v.data.get(side) or {}
    # The inputs' bytes beyond an even share over the devices (`report.arrays`).
    beyond = any("replicated_bytes" in a for a in v.arrays[side].values())
    rows = []
    for name, a in v.arrays[side].items():
        spec = a.get("spec")
        shown = (
            "not by mesh axes"
            if spec is None
            else "P(" + ", ".join(_entry(x) for x in spec) + ")"
        )
        rows.append(
            f'<tr><td class="mono">{esc(name)}</td>'
            f'<td class="mono">{esc(a["dtype"])}</td>'
            f'<td class="mono">{esc(a["shape"])}</td><td class="mono">{esc(shown)}</td>'
            f'<td class="mono">{esc(layouts.get(name, ""))}</td>'
            + _num(a["bytes"], human(a["bytes"]))
            + _num(a["device_bytes"], human(a["device_bytes"]))
            + (
                _num(a.get("replicated_bytes"), human(a.get("replicated_bytes")))
                if beyond
                else ""
            )
            + "</tr>"
        )
    head = ["path", "dtype", "shape", "spec", "as a JAX type", "bytes", "per device"]
    head += ["beyond an even share"] if beyond else []
    return _table(v, side, title, head, rows)


def _entry(axes: list) -> str:
    if not axes:
        return "None"
    if len(axes) == 1:
        return repr(axes[0])
    return "(" + ", ".join(repr(a) for a in axes) + ")"


def _sites(v: Any) -> str:
    rows = []
    for s in v.data.get("sites") or []:
        axes = "unknown" if s["axes"] is None else ", ".join(s["axes"]) or "none"
        rows.append(
            f'<tr><td class="mono" title="{esc(s.get("where"))}">{esc(s["line"])}</td>'
            f'<td class="mono">{esc(s["function"])}</td><td>{esc(s["kind"])}</td>'
            f"<td>{esc(axes)}</td>"
            + _num(s["count"], str(s["count"]))
            + _num(s.get("each"), human(s.get("each")))
            + _num(s["bytes"], human(s["bytes"]))
            + f'<td class="mono small">{esc(s.get("where"))}</td></tr>'
        )
    head = ["line", "function", "kind", "axes", "count", "each", "bytes"]
    head += ["called from"]
    return _table(v, "sites", "Collectives by line of code", head, rows)
