"""`report.html()`, `save_html`, `_repr_html_`, the command line's `--html` and
`show`: the page drawn from a snapshot's data, and checked in a real browser
(Debian's chromium, driven by playwright). In CI (`CI` set) the browser tests may
not skip."""

import base64
import hashlib
import json
import os
import re
import shutil
from html.parser import HTMLParser

import jax
import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import cli, html, snapshot


DIMS = {"b": 64, "d": 256, "h": 1024}
GiB = 1 << 30


@jaxshard.jaxtyped
def layer(
    x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d h", P(None, "tp")]
) -> Float[Array, "b h", P("dp", "tp")]:
    return jax.nn.gelu(x @ w)


@jaxshard.jaxtyped
def bad_layer(
    x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d h", P(None, "tp")]
) -> Float[Array, "b h", P("tp", None)]:  # XLA keeps it split over dp and tp
    return jax.nn.gelu(x @ w)


def forward(
    x: Float[Array, "b d", P("dp", None)],
    w1: Float[Array, "d h", P(None, "tp")],
    w2: Float[Array, "h d", P("tp", None)],
) -> Float[Array, "b d", P("dp", None)]:
    return x + layer(x, w1) @ w2


def forward_bad(
    x: Float[Array, "b d", P("dp", None)],
    w1: Float[Array, "d h", P(None, "tp")],
    w2: Float[Array, "h d", P("tp", None)],
) -> Float[Array, "b d", P("dp", None)]:
    x = jax.lax.with_sharding_constraint(x, P())  # an all-gather, over the budget
    return x + bad_layer(x, w1) @ w2


forward_bad.__name__ = forward_bad.__qualname__ = "forward"  # the same, edited
# Where the page says the violation and the all-reduce come from.
BAD_LAYER = f"test_html.py:{bad_layer.__wrapped__.__code__.co_firstlineno}"
ALL_REDUCE = f"test_html.py:{forward.__code__.co_firstlineno + 5}"


@pytest.fixture(scope="module")
def reports(tpu_topology, tmp_path_factory):
    """A passing report, its snapshot, and a failing one compared with it (a
    contract violated, a budget exceeded, differences from the snapshot)."""
    mesh = tpu_topology("v5e:2x2", {"dp": 2, "tp": 2})
    folder = tmp_path_factory.mktemp("html")
    passing = jaxshard.verify(forward, mesh=mesh, dims=DIMS)
    golden = folder / "forward.json"
    passing.save(golden)
    failing = jaxshard.verify(
        forward_bad,
        mesh=mesh,
        dims=DIMS,
        max_collectives={"all-gather": 0},
        against=golden,
        raise_on_error=False,
    )
    return {"passing": passing, "failing": failing, "golden": golden, "dir": folder}


def embedded(page: str) -> dict:
    """The data a page carries, as its script holds it."""
    m = re.search(
        r'<script type="application/json" class="jxs-data">(.*?)</script>', page
    )
    return json.loads(m[1])


def test_the_snapshot_holds_what_the_page_draws(reports):
    data = json.loads(reports["golden"].read_text())
    assert data["ok"] is True and data["violations"] == [] and data["against"] is None
    assert data["layouts"]["inputs"]["x"] == {
        "dtype": "float32",
        "shape": [64, 256],
        "spec": [["dp"], []],
        "bytes": 64 * 256 * 4,
        "device_bytes": 32 * 256 * 4,
        # report.arrays: a copy on each tp device, twice an even share of 4 devices
        "replicated_bytes": 32 * 256 * 4 - 64 * 256 * 4 // 4,
    }
    assert data["program"]["hbm_bytes"] == 16 * GiB and data["program"]["fits"]
    (site,) = [s for s in data["sites"] if s["kind"] == "all-reduce"]
    assert site["line"].endswith(ALL_REDUCE) and site["axes"] == ["tp"]
    assert site["function"] == "forward" and site["count"] == 1 and site["bytes"] > 0
    # The calls that led there are the user's: none of jaxshard's wrappers.
    assert "_with_notes" not in site["where"] and "_sharding" not in site["where"]
    bad = snapshot.snapshot(reports["failing"])
    kinds = [v["kind"] for v in bad["violations"]]
    assert kinds[:4] == ["contract"] * 3 + ["budget"] and len(kinds) > 4
    assert set(kinds[4:]) == {"snapshot"}
    contract = bad["violations"][1]
    assert contract["value"] == "return" and contract["function"] == "bad_layer"
    assert contract["source"].endswith(BAD_LAYER)
    assert bad["against"] == str(reports["golden"])
    assert [s["bytes"] for s in bad["sites"]] == sorted(
        (s["bytes"] for s in bad["sites"]), reverse=True
    )


def test_the_page_is_self_contained_and_a_view_of_the_snapshot(reports):
    report = reports["failing"]
    page = report.html()
    assert page.startswith("<!DOCTYPE html>") and len(page) < 200_000
    # Nothing to fetch: no address, no external script, style or font.
    assert not re.search(r"(src|href)=|@import|url\(|https?://", page)
    assert "default-src 'none'" in page
    assert embedded(page) == snapshot.snapshot(report)
    verdict = page.index('id="verdict"')
    assert verdict < page.index("Memory per device") < page.index("-contracts")
    first = page.index('class="violation"')
    assert verdict < first < page.index("Inputs laid out over the mesh")
    assert "bad_layer, return" in page and BAD_LAYER in page
    assert "3 of 7 sharding contracts violated, 1 budget exceeded" in page
    for text in ("Since the snapshot", "Compared with", "collectives: all-gather"):
        assert text in page
    path = reports["dir"] / "pages" / "failing.html"
    report.save_html(path)
    assert path.read_text(encoding="utf-8") == page
    fragment = report._repr_html_()
    assert fragment.startswith('<div class="jxs"') and "<html" not in fragment
    assert embedded(fragment) == embedded(page)


def test_a_saved_snapshot_draws_the_same_page(reports, capsys):
    path, page = reports["dir"] / "shown.html", reports["passing"].html()
    assert cli.main(["show", str(reports["golden"]), "--html", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == page
    assert "All 7 sharding contracts hold" in page and 'class="violation"' not in page
    assert cli.main(["show", str(reports["golden"])]) == 0
    assert "every contract holds" in capsys.readouterr().out


def test_show_says_what_is_wrong_with_its_file(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "python -m jaxshard show: there is no snapshot at" in err
    assert "Traceback" not in err
    other = tmp_path / "other.json"
    other.write_text('{"name": "not a snapshot"}')
    assert cli.main(["show", str(other), "--html", str(tmp_path / "x.html")]) == 2
    assert "other.json is not a jaxshard snapshot" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_every_text_is_escaped():
    """A name holding `</script>` or markup ends nothing early, runs nothing."""
    evil = "</script><script>alert(1)</script><b>"
    data = {
        "jaxshard_snapshot": 1,
        "function": evil,
        "mesh": "dp=2",
        "axis_types": ["Auto"],
        "devices": "2 × cpu",
        "inputs": {evil: "float32[8@dp]"},
        "outputs": {},
        "contracts": [
            {
                "function": evil,
                "value": evil,
                "expected": "P('dp')",
                "actual": "P()",
                "type": "float32[8]",
                "ok": False,
            }
        ],  # fmt: skip
        "collectives": {},
        "memory": None,
    }
    page = html.page(data)
    assert "<script>alert" not in page and "<b>" not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert embedded(page) == data
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in page


# Would run a script wherever it were written unescaped: in an attribute (the
# handler), as text (the script, the image's handler) or in the script holding the
# data (ended early; its JSON must escape the line separators too, for older
# JavaScript). An axis name holds no "=" or ",".
PAYLOAD = (
    'x" onmouseover="window.__pwned=1" y="</script><script>window.__pwned=2'
    "</script><img src=x onerror=window.__pwned=3>\u2028\u2029"
)
AXIS_PAYLOAD = '"><b>bold</b></script><script>window.__pwned++</script>'
# The fields whose keys are names (of arrays, kinds of collective, axes, functions).
NAMED = {"inputs", "outputs", "collectives", "axes", "functions", "check_collectives"}


def hostile(data: dict) -> dict:
    """`data` with every string in it, and every name, the `PAYLOAD` and a number
    (the same string, the same number: names stay consistent); the mesh's axes
    too."""
    axes = [part.partition("=")[0] for part in data["mesh"].split(",")]
    names = {a: f"{AXIS_PAYLOAD}{i}" for i, a in enumerate(axes)}

    def swap(text: str) -> str:
        if text not in names:
            names[text] = f"{PAYLOAD}{len(names)}"
        return names[text]

    def walk(x, field=None):
        if isinstance(x, str):
            return swap(x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict) and field in NAMED:
            return {swap(k): walk(v) for k, v in x.items()}
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        return x

    out = walk(data)
    out["mesh"] = ",".join(
        f"{names[a]}={n}" for a, n in (p.split("=") for p in data["mesh"].split(","))
    )
    return out


class Parsed(HTMLParser):
    """A page's elements, as a browser's parser finds them: each start tag with its
    attributes, and the text of each `<script>` and `<style>`."""

    def __init__(self, page: str):
        super().__init__()
        self.tags, self.scripts, self.styles, self.inside = [], [], [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.inside = tag

    def handle_data(self, data):
        if self.inside in ("script", "style"):
            (self.scripts if self.inside == "script" else self.styles).append(data)
        self.inside = None


def sha256(text: str) -> str:
    digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
    return f"'sha256-{digest}'"


@pytest.fixture(scope="module")
def hostile_page(reports):
    """The failing report's page, from a snapshot whose every string is hostile,
    read back as `show` reads it."""
    data = hostile(snapshot.snapshot(reports["failing"]))
    path = reports["dir"] / "hostile.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert snapshot.load(path) == data  # a well-formed snapshot, for all that
    return data, html.page(data)


def test_every_field_is_escaped_in_its_place(hostile_page):
    data, page = hostile_page
    parsed = Parsed(page)
    # No handler, no style attribute, no element of a field's: only the page's own.
    attributes = {a for _, attrs in parsed.tags for a in attrs}
    assert (
        not [a for a in attributes if a.startswith("on")] and "style" not in attributes
    )
    assert not {"img", "b"} & {tag for tag, _ in parsed.tags}
    scripts = [attrs for tag, attrs in parsed.tags if tag == "script"]
    assert scripts == [{"type": "application/json", "class": "jxs-data"}, {}]
    assert not re.search(r'onmouseover=(?!&quot;|\\")', page)  # escaped, each one
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert embedded(page) == data
    assert "\u2028" not in parsed.scripts[0] and "\\u2029" in parsed.scripts[0]
    # The policy lets run exactly the page's script, and style it exactly its styles.
    (meta,) = [
        a for t, a in parsed.tags if a.get("http-equiv") == "Content-Security-Policy"
    ]
    policy = dict(d.strip().split(" ", 1) for d in meta["content"].split(";"))
    assert "unsafe" not in meta["content"] and policy["default-src"] == "'none'"
    assert policy["script-src"] == sha256(parsed.scripts[1])
    assert policy["style-src"].split() == [sha256(s) for s in parsed.styles]
    assert len(parsed.styles) == 2


def test_an_old_snapshot_is_drawn_from_its_layouts(reports):
    """A snapshot written before snapshots held the page's data: its inputs'
    layouts are read from their text, its violations from its contracts."""
    data = json.loads(reports["golden"].read_text())
    new = snapshot.view(reports["passing"])
    old = {k: v for k, v in data.items() if k not in new}
    assert set(old) == {
        "jaxshard_snapshot", "function", "mesh", "axis_types", "devices", "inputs",
        "outputs", "contracts", "collectives", "memory",
    }  # fmt: skip
    old["contracts"][0] = {**old["contracts"][0], "ok": False}
    page = html.page(old)
    assert "1 of 7 sharding contracts violated" in page
    assert "32.0 KiB per device of 64.0 KiB" in page  # x: float32[64@dp,256]
    assert "beyond an even share" not in page  # not in that snapshot
    assert "P(None, &#x27;tp&#x27;)" in page  # w1's spec, from float32[256,1024@tp]
    assert html._from_layout("bfloat16[16@(dp,tp),4]", {"dp": 2, "tp": 2}) == {
        "dtype": "bfloat16",
        "shape": [16, 4],
        "spec": [["dp", "tp"], []],
        "bytes": 128,
        "device_bytes": 32,
    }


MODEL = """
import jax
from jax import Array
from jax.sharding import PartitionSpec as P
from jaxshard import Float


def mis_annotated(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("tp")]:
    return x * 2


def broken(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
    return x.reshape(3, -1)
"""


def test_the_command_line_writes_the_page_when_the_run_fails(
    tpu_topology, tmp_path, capsys
):
    (tmp_path / "html_model.py").write_text(MODEL)
    args = ["--topology", "v5e:2x2", "--mesh", "dp=2,tp=2", "--dim", "b=8"]
    page = tmp_path / "out" / "report.html"
    model = str(tmp_path / "html_model.py")
    status = cli.main(["verify", f"{model}:mis_annotated", *args, "--dim", "d=4",
                       "--html", str(page)])  # fmt: skip
    assert status == 1 and f"Report page written to {page}" in capsys.readouterr().err
    text = page.read_text(encoding="utf-8")
    assert "1 of 2 sharding contracts violated" in text and "html_model.py:8" in text
    status = cli.main(["verify", f"{model}:broken", *args, "--dim", "d=4",
                       "--html", str(page)])  # fmt: skip
    assert status == cli.MODEL_FAILED
    text = page.read_text(encoding="utf-8")
    assert "failed to trace or compile" in text and "reshape" in text


# --- in a browser -------------------------------------------------------------------

CHROMIUM = os.environ.get("JAXSHARD_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture(scope="module")
def browser():
    missing = None
    if shutil.which(CHROMIUM) is None:
        missing = f"no chromium at {CHROMIUM} (apt-get install chromium)"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install 'jaxshard[test]')"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the browser tests may not skip in CI: {missing}")
        pytest.skip(missing)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser, reports):
    """Opens a report's page; the console's errors are collected in `errors`."""
    pages = []

    def open_(name: str):
        path = reports["dir"] / f"{name}.html"
        reports[name].save_html(path)
        pages.append(visit(browser, path))
        return pages[-1]

    yield open_
    for tab in pages:
        tab.close()


def rows(tab, table: str) -> list[str]:
    return tab.eval_on_selector_all(
        f"table[id$='-{table}'] tbody tr:not(.hidden)",
        "rows => rows.map(r => r.cells[0].textContent)",
    )


def test_a_failing_report_in_a_browser(open_page, reports):
    tab = open_page("failing")
    assert tab.errors == []
    verdict = tab.locator("#verdict")
    assert verdict.is_visible() and "violated" in verdict.inner_text()
    violations = tab.locator("#violations > li")
    assert violations.count() == len(reports["failing"].violations)
    first = violations.first.bounding_box()
    assert first["y"] + first["height"] <= VIEWPORT["height"]  # no scrolling
    assert "bad_layer, x" in violations.first.inner_text()
    assert BAD_LAYER in violations.first.inner_text()
    # Sorting: by bytes per device, largest first on the second click.
    per_device = tab.locator("table[id$='-inputs'] th", has_text="per device")
    per_device.click()
    assert rows(tab, "inputs") == ["x", "w1", "w2"]
    per_device.click()
    assert rows(tab, "inputs")[-1] == "x"
    tab.locator("table[id$='-inputs'] th", has_text="path").click()
    assert rows(tab, "inputs") == ["w1", "w2", "x"]
    tab.locator("table[id$='-inputs'] th", has_text="beyond an even share").click()
    assert rows(tab, "inputs")[0] == "x"  # 16 KiB; w1 and w2 hold 256 KiB more
    # Search: the rows holding every word typed.
    search = tab.locator("input[data-filter$='-contracts']")
    search.fill("bad_layer return")
    assert rows(tab, "contracts") == ["bad_layer"]
    assert tab.locator("[id$='-contracts-count']").inner_text() == "1 of 7"
    search.fill("")
    assert len(rows(tab, "contracts")) == 7
    assert tab.errors == []


def test_a_passing_report_in_a_browser(open_page):
    tab = open_page("passing")
    assert tab.errors == []
    assert "All 7 sharding contracts hold" in tab.locator(".verdict").inner_text()
    assert tab.locator("#violations").count() == 0
    # Drawn as the page's own style says, under its policy: bars and colours.
    bar = tab.locator("#memory-bar").bounding_box()["width"]
    parts = tab.eval_on_selector_all(
        "#memory-bar rect", "rs => rs.map(r => r.getBoundingClientRect().width)"
    )
    assert len(parts) == 4 and bar - 3 < sum(parts) <= bar  # inside its border
    color = "e => getComputedStyle(e).color"
    assert tab.eval_on_selector("header .axis", color) == "rgb(26, 115, 232)"
    assert tab.locator("#arrays svg").count() == 3
    assert tab.locator("#top-lines tr").count() >= 1
    tab.locator("table[id$='-sites'] th", has_text="bytes").click()
    tab.locator("input[data-filter$='-sites']").fill("no such line")
    assert rows(tab, "sites") == []
    assert tab.errors == []


def test_a_hostile_snapshot_in_a_browser(browser, hostile_page, reports):
    """Every field holds a script, as an attribute, as markup, or to end the data's
    `<script>`: none runs, nothing is refused (nothing tried), and the page's own
    script still sorts and filters."""
    path = reports["dir"] / "hostile.html"
    path.write_text(hostile_page[1], encoding="utf-8")
    tab = visit(browser, path)
    for element in tab.locator("li.violation span, td, th, .chip").all()[:60]:
        element.hover()
    assert tab.evaluate("window.__pwned") is None
    assert tab.locator("b, img").count() == 0
    th = tab.locator("table[id$='-contracts'] th").first
    th.click()
    assert th.get_attribute("aria-sort") == "ascending"
    tab.locator("input[data-filter$='-contracts']").fill("no such contract")
    assert rows(tab, "contracts") == []
    assert tab.errors == []
    tab.close()


def test_the_policy_refuses_what_escaping_would_have_let_through(browser, reports):
    """Were a field written unescaped, the page's Content-Security-Policy would still
    refuse its handler, its script and its style attribute (and say so)."""
    page = (
        reports["passing"]
        .html()
        .replace(
            "</body>",
            '<div id="bait" onclick="window.__pwned=1" style="color: rgb(255, 0, 0)">'
            "bait</div><script>window.__pwned=2</script></body>",
        )
    )
    path = reports["dir"] / "injected.html"
    path.write_text(page, encoding="utf-8")
    tab = visit(browser, path)
    tab.locator("#bait").click()
    assert tab.evaluate("window.__pwned") is None
    color = tab.eval_on_selector("#bait", "e => getComputedStyle(e).color")
    assert color != "rgb(255, 0, 0)"
    assert len(tab.errors) == 3
    assert all("Content Security Policy" in e for e in tab.errors)
    # The page's own script still runs: it sorts.
    th = tab.locator("table[id$='-inputs'] th").first
    th.click()
    assert th.get_attribute("aria-sort") == "ascending"
    tab.close()


def visit(browser, path):
    """A tab on the page at `path`; the console's errors are collected in
    `errors`."""
    tab = browser.new_page(viewport=VIEWPORT)
    tab.errors = []
    tab.on("console", lambda m: m.type == "error" and tab.errors.append(m.text))
    tab.on("pageerror", lambda e: tab.errors.append(str(e)))
    tab.goto(path.as_uri())
    return tab
