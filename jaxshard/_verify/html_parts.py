"""The sections of `report.html()`'s page (`html._View.body` puts them in order):
the verdict and the violations, memory per device, the collectives by line of code,
the changes since the snapshot, each array's layout over the mesh, and the tables.
Each takes the page's `_View` and returns HTML, every text escaped."""

import math
from html import escape
from typing import Any

from .._version import __version__
from .html_text import bar, esc, human, MEMORY, SHOWN_ARRAYS, SHOWN_SITES


def header(v: Any) -> str:
    d = v.data
    mesh = " ".join(v.axis(a, n) for a, n in v.axes) or esc(d.get("mesh"))
    types = "/".join(sorted(set(d.get("axis_types") or ()))) or "?"
    flops = (d.get("program") or {}).get("flops")
    flops = (
        f'<span class="chip">{flops:.3g} FLOPs/device</span>'
        if isinstance(flops, (int, float))
        else ""
    )
    return (
        '<header><span class="brand">jaxshard.verify</span>'
        f"<h1><code>{esc(d.get('function'))}</code></h1>"
        f'<span class="muted small">mesh</span> {mesh}'
        f'<span class="chip">{esc(types)} axes</span>'
        f'<span class="chip">{esc(d.get("devices"))}</span>{flops}</header>'
    )


def verdict(v: Any) -> str:
    contracts = v.data.get("contracts", [])
    if v.ok:
        text = f"All {len(contracts)} sharding contracts hold"
        if v.data.get("against"):
            text += ", and nothing changed since the snapshot"
        mark = '<span class="mark">✓</span>'
        return f'<div class="verdict good">{mark}{esc(text)}.</div>'
    count = {k: sum(x["kind"] == k for x in v.violations) for k in _KINDS}
    of = {"contract": len(contracts)}  # as `str(report)` says it: 2 of 9 ...
    parts = [
        f"{n} {f'of {of[k]} ' if of.get(k) else ''}{_KINDS[k][0]}"
        f"{'s' if max(n, of.get(k, 0)) > 1 else ''} {_KINDS[k][1]}"
        for k, n in count.items()
        if n
    ]
    items = "\n".join(_violation(x) for x in v.violations)
    return (
        f'<div class="verdict bad" id="verdict"><span class="mark">✗</span>'
        f"{esc(', '.join(parts))}</div>\n"
        f'<ol class="violations" id="violations">{items}</ol>'
    )


def error(v: Any) -> str:
    return (
        '<div class="verdict bad" id="verdict"><span class="mark">✗</span>The '
        "function failed to trace or compile: no contract was checked</div>"
        f'<pre class="violation reason mono">{esc(v.data["error"])}</pre>'
    )


_KINDS = {
    "contract": ("sharding contract", "violated"),
    "budget": ("budget", "exceeded"),
    "snapshot": ("difference", "from the snapshot"),
}


def _violation(x: dict) -> str:
    kind = x.get("kind", "contract")
    if kind == "contract":
        who = ", ".join(filter(None, [x.get("call") or x.get("function"), x["value"]]))
        layout = (
            f'<div class="layout small">expected <code>{esc(x["expected"])}</code>, '
            f"found <code>{esc(x['actual'])}</code>"
            + (f" · <code>{esc(x['type'])}</code>" if x.get("type") else "")
            + (f", block <code>{esc(x['block'])}</code>" if x.get("block") else "")
            + "</div>"
        )
    else:
        who = x["value"].removeprefix("snapshot: ")
        layout = (
            f'<div class="layout small">limit <code>{esc(x["expected"])}</code>, '
            f"found <code>{esc(x['actual'])}</code></div>"
            if kind == "budget"
            else ""
        )
    source = x.get("source")
    source = f'<code class="source">{esc(source)}</code>' if source else ""
    cls = kind if kind in _KINDS else "other"  # a class of page.css, never the data
    return (
        f'<li class="violation"><div class="title"><span class="kind {cls}">'
        f"{esc(kind)}</span><strong>{esc(who)}</strong>{source}</div>{layout}"
        f'<div class="reason">{esc(x.get("reason"))}</div></li>'
    )


def memory(v: Any) -> str:
    m = v.data.get("memory")
    program = v.data.get("program") or {}
    if not m:
        why = (
            "XLA refused to compile the program: it does not fit in a device's HBM."
            if program.get("fits") is False
            else "The compiler gave no memory analysis."
        )
        return _panel("Memory per device", f'<p class="muted">{why}</p>')
    hbm = program.get("hbm_bytes")
    used = dict(m, code=program.get("code") or 0)
    used["outputs"] = max(0, m["outputs"] - m.get("aliased", 0))
    whole = sum(used[k] for k, _ in MEMORY) or 1
    parts = [(100 * used[k] / whole, c, f"{k} {human(used[k])}") for k, c in MEMORY]
    rows = "".join(
        f'<span class="swatch {c}"></span><span>{k}'
        + (
            f" (aliased {human(m['aliased'])})"
            if k == "outputs" and m.get("aliased")
            else ""
        )
        + f'</span><span class="num">{human(used[k] if k != "outputs" else m[k])}'
        + (f' <span class="muted">{used[k] / hbm:.1%} of HBM</span>' if hbm else "")
        + "</span>"
        for k, c in MEMORY
    )
    return _panel(
        "Memory per device",
        _hbm_meter(m["total"], hbm)
        + bar(parts, "bar", "memory-bar")
        + f'<div class="legend">{rows}</div>',
    )


def _hbm_meter(total: int, hbm: int | None) -> str:
    """How much of a device's HBM the program fills, as a meter and a sentence."""
    if not hbm:
        return (
            f'<div class="fit">{human(total)} in all; the HBM of these devices is '
            "unknown (not a TPU mesh).</div>"
        )
    full = min(1.0, total / hbm)
    part = "part-bad" if total > hbm else "part-good"
    meter = [(max(100 * full, 0.6), part, f"{total / hbm:.2%} of HBM")]
    return bar(meter, "bar thin") + _fit(total, hbm)


def _fit(total: int, hbm: int) -> str:
    if total <= hbm:
        return (
            f'<div class="fit good">Fits: {human(total)} of {human(hbm)} of HBM '
            f"({total / hbm:.1%}), {human(hbm - total)} to spare. The program's parts:"
            "</div>"
        )
    return (
        f'<div class="fit bad">Does not fit: {human(total)}, more than the '
        f"{human(hbm)} of HBM by {human(total - hbm)}. The program's parts:</div>"
    )


def collectives(v: Any) -> str:
    sites = v.data.get("sites")
    if sites is None:  # an older snapshot: per kind and function only
        sites = [
            {"line": "", "function": f, "kind": kind, "axes": None, "count": n,
             "bytes": None}
            for kind, entry in sorted((v.data.get("collectives") or {}).items())
            for f, n in sorted(entry.get("functions", {}).items())
        ]  # fmt: skip
    checks = _checks_note(v.data.get("check_collectives"))
    if not sites:
        return _panel(
            "Collectives",
            '<p class="muted">None: no device talks to another.</p>' + checks,
        )
    most = max((s["bytes"] or 0 for s in sites), default=0) or 1
    rows = "".join(
        f'<tr><td><span class="chip">{esc(s["kind"])}</span></td>'
        f"<td>{_axes(v, s['axes'])}</td>"
        f'<td class="num" title="{esc(_each(s))}">×{esc(s["count"])}</td>'
        f'<td class="num">{human(s["bytes"])}</td>'
        f"<td>{bar([(100 * (s['bytes'] or 0) / most, 'part-accent', '')], 'meter')}"
        "</td>"
        f'<td title="{esc(s.get("where"))}">{_where(s)}</td></tr>'
        for s in sites[:SHOWN_SITES]
    )
    total = sum(s["bytes"] or 0 for s in sites)
    more = len(sites) - SHOWN_SITES
    tail = f"; {more} more lines in the table below" if more > 0 else ""
    count = _count(sum(s["count"] for s in sites))
    return _panel(
        "Collectives by line of code, most bytes first",
        f'<table class="sites" id="top-lines">{rows}</table><p class="muted small">'
        f"{count}, {human(total)} per device{tail}.</p>{checks}",
    )


def _checks_note(found: dict | None) -> str:
    """The collectives of jaxshard's value checks, apart from the model's."""
    if not found:
        return ""
    kinds = ", ".join(
        f"{kind} {e['count']} ({human(e['bytes'])})"
        for kind, e in sorted(found.items())
    )
    return (
        '<p class="muted small" id="check-collectives">Besides, from jaxshard\'s '
        f"value checks (left out of the budgets and the snapshot): {esc(kinds)}.</p>"
    )


def _each(site: dict) -> str:
    """`4 of 16.0 MiB each`: a site is `count` collectives alike."""
    each = site.get("each")
    if each is None and site["bytes"] is not None and site["count"]:
        each = site["bytes"] // site["count"]  # an older snapshot's site
    return f"{site['count']} of {human(each)} each"


def _where(site: dict) -> str:
    if not site["line"]:  # made for an input, or by XLA: JAX's name for it
        return f'<code class="small">{esc(site["function"])}</code>'
    return (
        f'<code class="source">{esc(site["line"])}</code> '
        f'<span class="muted">{esc(site["function"])}</span>'
    )


def _axes(v: Any, axes: list | None) -> str:
    if axes is None:
        return '<span class="muted small">axes unknown</span>'
    return " ".join(v.axis(a) for a in axes) or '<span class="muted small">none</span>'


def changes(v: Any) -> str:
    found = [x for x in v.violations if x.get("kind") == "snapshot"]
    against = v.data.get("against")
    if not found and not against:
        return ""
    if not found:
        return _panel(
            "Since the snapshot",
            f'<p class="ok">Nothing changed since <code>{esc(against)}</code>.</p>',
            wide=True,
        )
    rows = "".join(
        f"<tr><td><strong>{esc(x['value'].removeprefix('snapshot: '))}</strong></td>"
        f'<td class="mono"><span class="was">{esc(x["expected"])}</span> → '
        f'<span class="now">{esc(x["actual"])}</span></td></tr>'
        for x in found
    )
    head = f"Compared with <code>{esc(against)}</code>: " if against else ""
    n = f"{len(found)} difference{'s' * (len(found) > 1)}"
    return _panel(
        "Since the snapshot",
        f'<p class="small">{head}{n}.</p><table class="diff" id="diff">{rows}</table>',
        wide=True,
    )


def _panel(title: str, body: str, wide: bool = False) -> str:
    cls = "panel wide" if wide else "panel"
    return f'<section class="{cls}"><h2>{esc(title)}</h2>{body}</section>'


def layouts(v: Any) -> str:
    arrays = sorted(v.arrays["inputs"].items(), key=lambda kv: -kv[1]["device_bytes"])
    if not arrays:
        return ""
    cards = "".join(
        _card(v, name, a, hidden=i >= SHOWN_ARRAYS)
        for i, (name, a) in enumerate(arrays)
    )
    more = len(arrays) - SHOWN_ARRAYS
    button = (
        f'<p><button data-more="more-arrays">Show all {len(arrays)} inputs</button></p>'
        if more > 0
        else ""
    )
    legend = " ".join(v.axis(a, n) for a, n in v.axes)
    return _panel(
        "Inputs laid out over the mesh, most bytes per device first",
        f'<p class="small muted">Each box is one array; lines split it over the mesh '
        f"axes of their colour (mesh {legend}).</p>"
        f'<div class="arrays" id="arrays">{cards}</div>{button}',
        wide=True,
    )


def _card(v: Any, name: str, a: dict, hidden: bool) -> str:
    spec = a.get("spec")
    used = {x for axes in spec or [] for x in axes}
    copies = [(x, n) for x, n in v.axes if x not in used and n > 1]
    if spec is None:
        note = "not laid out by mesh axes"
    elif copies:
        note = "a copy on each of " + " ".join(v.axis(x, n) for x, n in copies)
    else:
        note = "no copies: each device holds its own part"
    dims = ",".join(
        str(n) + ("@" + "·".join(ax) if ax else "")
        for n, ax in zip(a["shape"], spec or [[]] * len(a["shape"]))
    )
    cls = "array hidden more-arrays" if hidden else "array"
    return (
        f'<div class="{cls}"><div class="name mono">{esc(name)}</div>'
        f'<div class="mono small muted">{esc(a["dtype"])}[{esc(dims)}]</div>'
        f"{diagram(v, a['shape'], spec)}"
        f'<div class="small">{human(a["device_bytes"])} per device of '
        f"{human(a['bytes'])}"
        f'</div><div class="small muted">{note if spec is None else note}</div></div>'
    )


def diagram(v: Any, shape: list, spec: list | None) -> str:
    """The array as a box, split as `jax.debug.visualize_array_sharding` draws it:
    rows and columns for the two dimensions drawn (those split over mesh axes
    first), each cut into as many parts as its axes have devices (16 at most drawn),
    with lines in the axes' colours."""
    spec = spec or [[]] * len(shape)
    split = [i for i, axes in enumerate(spec) if axes]
    drawn = sorted(
        (split + [i for i in reversed(range(len(shape))) if i not in split])[:2]
    )
    width, height = 170, 26
    if len(drawn) == 2:
        ratio = shape[drawn[0]] / max(shape[drawn[1]], 1)
        height = max(30, round(width * min(1.0, max(0.22, ratio))))
    r = drawn[0] if len(drawn) == 2 else None
    c = drawn[-1] if drawn else None
    rows, cols = (1 if d is None else _parts(v, spec[d]) for d in (r, c))
    out = [
        f'<svg width="{width + 2}" height="{height + 16}" role="img">',
        f'<rect x="1" y="1" width="{width}" height="{height}" fill="#eef1f4"/>',
    ]
    nr, nc = min(rows, 16), min(cols, 16)
    w, h = width / nc, height / nr
    # Alternate bands of each split dimension, see-through: where they cross, a
    # chequer of the parts (a few elements, not one per part).
    for i in range(0, nr, 2) if nr > 1 else ():
        out.append(_band(1, 1 + i * h, width, h, _color(v, spec[r])))
    for j in range(0, nc, 2) if nc > 1 else ():
        out.append(_band(1 + j * w, 1, w, height, _color(v, spec[c])))
    for i in range(1, nr):  # the cuts between parts, in their axes' colour
        out.append(_line(1, 1 + i * h, width + 1, 1 + i * h, _color(v, spec[r])))
    for j in range(1, nc):
        out.append(_line(1 + j * w, 1, 1 + j * w, height + 1, _color(v, spec[c])))
    out.append(
        f'<rect x="1" y="1" width="{width}" height="{height}" fill="none" '
        'stroke="#80868b"/>'
    )
    label = " × ".join(
        _dim_label(shape[d], spec[d], p)
        for d, p in ((r, rows), (c, cols))
        if d is not None
    )
    out.append(f'<text x="1" y="{height + 13}" fill="#59636e">{escape(label)}</text>')
    return "".join(out) + "</svg>"


def _band(x: float, y: float, w: float, h: float, color: str) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
        f'fill="{color}" fill-opacity=".22"/>'
    )


def _line(x1: float, y1: float, x2: float, y2: float, color: str) -> str:
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
        f'stroke="{color}" stroke-width="1.2"/>'
    )


def _parts(v: Any, axes: list) -> int:
    return math.prod(v.sizes.get(a, 1) for a in axes)


def _color(v: Any, axes: list) -> str:
    return v.colors.get(axes[0], "#5f6368") if axes else "#9aa0a6"


def _dim_label(size: int, axes: list, parts: int) -> str:
    """`1024/4 (fsdp·tp)`: a dimension's size, and how many parts of it there are
    over which axes."""
    return f"{size}/{parts} ({'·'.join(axes)})" if axes else str(size)


def tables(v: Any) -> str:
    from .html_tables import all_tables

    return all_tables(v)


def notes(v: Any) -> str:
    items = "".join(f"<li>{esc(n)}</li>" for n in v.data.get("notes") or [])
    return (
        f'<section class="notes"><h2>Notes</h2><ul>{items}</ul></section>'
        if items
        else ""
    )


def footer(v: Any) -> str:
    return (
        f"<footer>Drawn by jaxshard {esc(__version__)}"
        + (
            f" from a snapshot of format {esc(v.data['jaxshard_snapshot'])}"
            if "jaxshard_snapshot" in v.data
            else ""
        )
        + ". Bytes are per device unless said otherwise.</footer>"
    )


def _count(n: int) -> str:
    return f"{n} collective{'s' * (n != 1)}"
