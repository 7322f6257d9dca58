"""Takes the report page's screenshots in docs/images/ (docs/how-to/verify-for-a-pod.md
shows them): the transformer of examples/transformer.py verified for a 256-chip TPU
v5e pod, as it holds (against its committed snapshot), and its mis-annotated block
with a budget of bytes moved that it exceeds.

Run: `python docs/images/screenshots.py` from the repository's root (needs libtpu,
playwright and Debian's chromium: `apt-get install chromium`).
"""

import os
import pathlib
import sys
import tempfile


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

import jaxshard  # noqa: E402


ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # the page names lines of code relative to the working directory

from examples import transformer as t  # noqa: E402


CHROMIUM = os.environ.get("JAXSHARD_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def reports() -> dict:
    mesh = jaxshard.tpu_mesh(t.POD, {"dp": 4, "fsdp": 8, "tp": 8})
    dims = {**t.DIMS, "batch": 256, "seqlen": 2048, "layers": 24}
    golden = t.snapshot(mesh, "auto").relative_to(ROOT)  # as a CI job would name it
    passing = jaxshard.verify(
        t.model, mesh=mesh, dims=dims, dtypes=jnp.bfloat16, against=golden
    )
    failing = jaxshard.verify(
        t.block_misannotated,
        mesh=mesh,
        dims=dims,
        dtypes=jnp.bfloat16,
        max_collective_bytes=256 << 20,
        raise_on_error=False,
    )
    return {"passing": passing, "failing": failing}


def main() -> None:
    out = pathlib.Path(__file__).parent
    folder = pathlib.Path(tempfile.mkdtemp())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for name, report in reports().items():
            page = folder / f"{name}.html"
            report.save_html(page)
            tab = browser.new_page(viewport={"width": 1280, "height": 1000})
            tab.goto(page.as_uri())
            tab.screenshot(path=out / f"verify-report-{name}.png")
            print(f"docs/images/verify-report-{name}.png")
        browser.close()


if __name__ == "__main__":
    main()
