"""The documentation's code runs: each page's Python blocks, in order, as one program
(a later block may use what an earlier one defined), on 8 simulated CPU devices.

A block preceded by `<!-- not run: REASON -->` is left out: a fragment that shows one
call of a larger program, or code that needs what the docs cannot hold (a dataset).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest


pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).parent.parent
PAGES = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: [^>]+-->\s*$")


def blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """`(line, code)` of each block that runs."""
    text = page.read_text()
    out = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n")
        if NOT_RUN.search(before.splitlines()[-1] if before else ""):
            continue
        out.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return out


def program(page: pathlib.Path) -> str:
    """The page's blocks as one script; each reports its line before it runs."""
    parts = []
    for line, code in blocks(page):
        parts.append(f"print('--- block at line {line}', file=sys.stderr, flush=True)")
        parts.append(code)
    return "import sys\n" + "\n".join(parts)


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if blocks(p)],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_page_runs(page, tmp_path):
    script = tmp_path / "page.py"
    script.write_text(program(page))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode:
        markers = re.findall(r"--- block at line (\d+)", run.stderr)
        where = f"{page.name}:{markers[-1]}" if markers else page.name
        tail = "\n".join(run.stderr.strip().splitlines()[-15:])
        pytest.fail(f"the block at {where} failed:\n{tail}", pytrace=False)
