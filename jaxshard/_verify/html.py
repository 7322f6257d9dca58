"""`report.html()`: the report as one self-contained HTML page, drawn from the data
`report.save()` writes (a snapshot, `snapshot.snapshot`), so that a saved snapshot
is drawn the same way later (`python -m jaxshard show`).

Everything is drawn here, as plain HTML and inline SVG: the page reads without
JavaScript (a notebook that runs no scripts, a CI artifact viewer). `page.js` only
sorts and filters the tables; `page.css` is scoped under `.jxs` so that a notebook
keeps its own style. The data is embedded too, as JSON. Every text is escaped, in
the way of its place (text, attribute, JSON in a `<script>`), and the page's
Content-Security-Policy lets nothing run or style it but its own script and style,
each allowed by the hash of its text: no inline event handler, no `style` attribute
(bars are SVG, colours classes), nothing fetched.
"""

import base64
import hashlib
import json
import math
import os
import re
import warnings
from html import escape
from importlib import resources
from typing import Any

from .files import write_text
from .html_text import AXIS_COLORS, human


def page(data: dict) -> str:
    """A whole HTML document for the snapshot `data`."""
    title = f"{data.get('function', '?')} · jaxshard.verify"
    body, script, css = _fragment(data)
    policy = _policy(script, css)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        f"<title>{escape(title)}</title>\n<style>{_PAGE_STYLE}</style>\n"
        f"</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


_PAGE_STYLE = "body { margin: 0; background: #fff; }"


def _policy(script: str, css: str) -> str:
    """The page's Content-Security-Policy: nothing is fetched (the browser refuses
    any address the page might name), and nothing runs or styles the page but its
    own script and style, each allowed by the hash of its exact text: no inline
    event handler, no `style` attribute, no script a field of the data might hold
    were it not escaped."""
    styles = " ".join(_hash(text) for text in (_PAGE_STYLE, css))
    return (
        f"default-src 'none'; script-src {_hash(script)}; style-src {styles}; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )


def _hash(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def fragment(data: dict) -> str:
    """The report as one `<div>` with its style, data and script: what a notebook
    shows, and the body of `page`."""
    return _fragment(data)[0]


def _fragment(data: dict) -> tuple[str, str, str]:
    """`fragment`, and the exact text of its script and of its style."""
    text = json.dumps(data, sort_keys=True, ensure_ascii=False)
    root = "jxs-" + hashlib.sha1(text.encode()).hexdigest()[:10]
    view = _View(data, root)
    script = _script_safe_code(_asset("page.js").replace("__ROOT__", root))
    css = _asset("page.css") + _axis_colors()
    body = (
        f'<div class="jxs" id="{root}">\n<style>{css}</style>\n'
        f"{view.body()}\n"
        f'<script type="application/json" class="jxs-data">{_script_safe(text)}'
        f"</script>\n<script>{script}</script>\n</div>"
    )
    return body, script, css


def _axis_colors() -> str:
    """The mesh axes' colours, one class per place in the mesh (`_View.axis`)."""
    return "".join(
        f".jxs .axis.c{i} {{ color: {color}; }}\n"
        for i, color in enumerate(AXIS_COLORS)
    )


def failure(function: str, mesh: Any, message: str) -> str:
    """The page of a run that made no report: the function failed to trace or
    compile, for a reason of its own (`message`)."""
    from .._sharding.describe import describe_devices

    data = {
        "function": function,
        "mesh": ",".join(f"{k}={v}" for k, v in mesh.shape.items()),
        "axis_types": [t.name for t in mesh.axis_types],
        "devices": describe_devices(mesh),
        "ok": False,
        "error": message,
    }
    return page(data)


def summary(data: dict) -> str:
    """The verdict of the snapshot `data` as text: what `show` prints."""
    view = _View(data, "")
    lines = [
        f"{data.get('function')} on mesh {data.get('mesh')}, {data.get('devices')}: "
        + (
            "every contract holds."
            if view.ok
            else f"{len(view.violations)} violations:"
        )
    ]
    for x in view.violations:
        what = ", ".join(filter(None, [x.get("call") or x.get("function"), x["value"]]))
        where = f" ({x['source']})" if x.get("source") else ""
        lines.append(f"- {what}{where}: {x.get('reason') or x.get('actual')}")
    memory = data.get("memory")
    if memory:
        hbm = (data.get("program") or {}).get("hbm_bytes")
        of = f" of {human(hbm)} of HBM" if hbm else ""
        lines.append(f"Memory per device: {human(memory['total'])}{of}.")
    return "\n".join(lines)


def write(text: str, path: str | os.PathLike) -> None:
    """Writes the page `text` to `path`, whole or not at all (`files`)."""
    write_text(path, text)


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


# JSON's escapes for what could end a `<script>` early (`</script>`, `<!--`), and
# for the line separators a JavaScript parser older than ES2019 would stop at.
_SCRIPT_SAFE = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
     "\u2028": "\\u2028", "\u2029": "\\u2029"}
)  # fmt: skip


def _script_safe(text: str) -> str:
    """JSON (from `json.dumps`, where these characters are all inside strings)
    that no field can end early: `</script>` in a name stays text."""
    return text.translate(_SCRIPT_SAFE)


def _script_safe_code(code: str) -> str:
    assert "</script" not in code.lower() and "<!--" not in code
    return code


# --- reading old snapshots ----------------------------------------------------------

_LAYOUT = re.compile(r"^(\w+)\[(.*)\]")
_DIM = re.compile(r"([0-9]{1,18})(?:@\(([^)]*)\)|@(\w+))?")


def _mesh_axes(data: dict) -> list[tuple[str, int]]:
    axes = []
    for part in str(data.get("mesh") or "").split(","):
        name, _, size = part.partition("=")
        if name and re.fullmatch("[0-9]{1,18}", size):
            axes.append((name, int(size)))
    return axes


def _from_layout(text: str, sizes: dict[str, int]) -> dict:
    """An array's entry of `view.array` from its layout, `float32[64@dp,16]` (for
    a snapshot written before snapshots held them)."""
    m = _LAYOUT.match(text or "")
    if not m:
        return {"dtype": "?", "shape": [], "spec": None, "bytes": 0, "device_bytes": 0}
    shape, spec = [], []
    for dim in _DIM.finditer(m[2]):
        shape.append(int(dim[1]))
        spec.append(dim[2].split(",") if dim[2] else [dim[3]] if dim[3] else [])
    width = _itemsize(m[1])
    block = [
        -(-n // math.prod(sizes.get(a, 1) for a in ax)) for n, ax in zip(shape, spec)
    ]
    return {
        "dtype": m[1],
        "shape": shape,
        # `float32[8,4] (fully replicated)`: not laid out by mesh axes
        "spec": None if text[m.end() :].strip() else spec,
        "bytes": math.prod(shape) * width,
        "device_bytes": math.prod(block) * width,
    }


def _itemsize(dtype: str) -> int:
    """The bytes of one element of `dtype`; 4 for a name numpy and ml_dtypes lack."""
    import ml_dtypes
    import numpy as np

    for name in (dtype, getattr(ml_dtypes, dtype, None)):
        if name is None:
            break
        try:
            with warnings.catch_warnings():  # numpy's deprecated aliases ("a")
                warnings.simplefilter("ignore")
                return np.dtype(name).itemsize
        except (TypeError, ValueError):
            continue
    return 4


# --- the page -----------------------------------------------------------------------


class _View:
    """The parts of the page, each a string of HTML, from the snapshot `data`."""

    def __init__(self, data: dict, root: str):
        self.data, self.root = data, root
        self.axes = _mesh_axes(data)
        self.sizes = dict(self.axes)
        self.places = {a: i % len(AXIS_COLORS) for i, (a, _) in enumerate(self.axes)}
        self.colors = {a: AXIS_COLORS[i] for a, i in self.places.items()}
        self.arrays = {side: self._arrays(side) for side in ("inputs", "outputs")}
        self.violations = data.get("violations")
        if self.violations is None:  # an older snapshot: its contracts only
            self.violations = [
                {"kind": "contract", "function": c.get("function", ""), "call": "",
                 "value": c.get("value", ""), "expected": c.get("expected", ""),
                 "actual": c.get("actual", ""), "type": c.get("type", ""),
                 "reason": "", "source": ""}
                for c in data.get("contracts", []) if not c.get("ok", True)
            ]  # fmt: skip
        self.ok = data.get("ok", not self.violations)

    def _arrays(self, side: str) -> dict[str, dict]:
        given = (self.data.get("layouts") or {}).get(side)
        if given is not None:
            return given
        layouts = self.data.get(side) or {}
        return {k: _from_layout(v, self.sizes) for k, v in layouts.items()}

    def body(self) -> str:
        from . import html_parts as parts

        if self.data.get("error"):  # no report: the function failed to compile
            return "\n".join(
                [parts.header(self), parts.error(self), parts.footer(self)]
            )
        return "\n".join(
            [
                parts.header(self),
                parts.verdict(self),
                '<div class="panels">',
                parts.memory(self),
                parts.collectives(self),
                parts.changes(self),
                parts.layouts(self),
                "</div>",
                parts.tables(self),
                parts.notes(self),
                parts.footer(self),
            ]
        )

    def axis(self, name: str, size: int | None = None) -> str:
        """A mesh axis's chip, in its colour (grey for an axis the mesh lacks)."""
        place = self.places.get(name)
        cls = "chip axis" if place is None else f"chip axis c{place}"
        label = escape(name) + ("" if size is None else f" {size}")
        return f'<span class="{cls}">{label}</span>'
