"""The documentation's code runs: every Python block that is a complete program (it
starts with its imports) runs on its own, on 8 simulated CPU devices, as a user's
would: in an empty directory, with jaxshard installed and nothing of this repository
on the path (no `examples/` or `tests/` module to import). Blocks that
show a fragment of a larger program (a call, a decorated function) do not start with
imports and are not run. A complete program that cannot run here says why in a
`<!-- not run: REASON -->` line before it.

A block whose last statement shows an error (`f(y)  # raises jaxshard.ShardingError`)
must raise exactly that, there.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest


pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).parent.parent
PAGES = sorted(ROOT.glob("docs/**/*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: [^>]+-->\s*$")
RAISES = re.compile(r"#\s*raises\s+([\w.]+)")


def blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """`(line, code)` of each block of `page` that is a complete program."""
    text = page.read_text()
    out = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        if before and NOT_RUN.search(before[-1]):
            continue
        code = match.group(1)
        lines = [x for x in code.splitlines() if x.strip() and not x.startswith("#")]
        if lines and lines[0].startswith(("import ", "from ")):
            out.append((text.count("\n", 0, match.start()) + 2, code))
    return out


CASES = [(page, line, code) for page in PAGES for line, code in blocks(page)]


@pytest.mark.parametrize(
    "page, line, code",
    CASES,
    ids=[f"{p.relative_to(ROOT).as_posix()}:{line}" for p, line, _ in CASES],
)
def test_block_runs(page, line, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = "\n".join(run.stderr.strip().splitlines()[-12:])
    raises = RAISES.search(code.rstrip().splitlines()[-1])
    if raises:
        said = [
            x for x in run.stderr.splitlines() if x.startswith(raises.group(1) + ":")
        ]
        assert run.returncode and said, (
            f"the block at {page.name}:{line} should raise {raises.group(1)}:\n{tail}"
        )
    elif run.returncode:
        pytest.fail(f"the block at {page.name}:{line} failed:\n{tail}", pytrace=False)


def test_api_reference_names_every_public_name():
    """docs/api.md names each public name of `jaxshard` (those of `__all__`, and any
    other that does not start with an underscore), as a `::: jaxshard.NAME` entry or
    in backticks."""
    import inspect

    import jaxshard

    public = set(jaxshard.__all__) | {
        name
        for name, value in vars(jaxshard).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and name != "TYPE_CHECKING"
    }
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [
        name
        for name in sorted(public)
        if f"::: jaxshard.{name}\n" not in text
        and not re.search(rf"`(jaxshard\.)?{re.escape(name)}[`\[(]", text)
    ]
    assert not missing, f"docs/api.md does not name {missing}"
