"""Screenshots of the executed quickstart, evaluate and sweep notebooks in a real browser, for docs/.

    .venv/bin/python bench/screenshots.py                      # all three, into docs/screenshots/
    .venv/bin/python bench/screenshots.py quickstart --keep    # one; keep the work folder
    .venv/bin/python bench/screenshots.py --work DIR           # in that folder (kept)

Each notebook is copied into a work folder with a WORKBENCH_HOME of its own, opened in JupyterLab
(the server the lab tests use, tests/lab/conftest.py) in headless Chromium (tests/lab/browser.py,
`make browser`), run there cell by cell as a user would (it trains the built-in tiny model: about
half a minute each on 2 CPU cores), so its widgets draw live, and captured as PNGs: one screen
at each cell SHOTS names (the form and the live chart, the scores before and after, the sweep's
chart and table). Needs the extension installed
(`make lab` does it) and Chromium; writes nothing outside the work folder and docs/screenshots/.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
# Per notebook, what each screenshot shows: (name, the start of the cell it opens on).
SHOTS = {
    "quickstart": [("form", "form = RunForm(spec)"), ("run", "job = workbench.launch(form.spec)")],
    "evaluate": [("before-after", "import pandas as pd"), ("perplexity", "report = job.evaluate")],
    "sweep": [("live", "sweep.show()"), ("trials", "df = sweep.trials_df()")],
}
NOTEBOOKS = tuple(SHOTS)
VIEWPORT = {"width": 1280, "height": 800}
MAX_BYTES = 300_000  # what docs/ keeps per image


def run_in_browser(page: object, name: str) -> None:
    """Run every cell of the open notebook in the page, as a user would (Run All), and wait for
    its last code cell to finish: widgets then draw from their live models."""
    from tests.lab.browser import run_until_started

    panel = page.locator(".jp-NotebookPanel:visible").first  # type: ignore[attr-defined]
    code = panel.locator(".jp-CodeCell")
    started = time.monotonic()
    run_until_started(page, "notebook:run-all-cells", code.first.locator(".jp-InputPrompt"))
    prompts = code.locator(".jp-InputPrompt")
    # Run All queues every cell ([*]); the last one done, or an error clearing the queue ([ ]),
    # leaves none queued.
    while any("*" in (t or "") for t in prompts.all_text_contents()):
        if time.monotonic() - started > 1800:
            raise SystemExit(f"{name} did not finish running in 30 minutes")
        page.wait_for_timeout(1000)  # type: ignore[attr-defined]  # polling a running kernel
    if not re.search(r"\[\d+\]", prompts.last.text_content() or ""):
        raise SystemExit(f"{name}: a cell failed; the notebook is in the work folder (--work)")
    print(f"{name}: ran in {time.monotonic() - started:.0f} s", flush=True)


def capture(server: object, work: Path, names: list[str]) -> list[Path]:
    """Open each notebook in JupyterLab, run it, save a screen at each of its SHOTS cells."""
    import nbformat

    sys.path.insert(0, str(ROOT))  # the lab tests' browser helpers
    from tests.lab.browser import accept_kernel_dialog, browser_page, open_lab

    shots = []
    with browser_page() as page:
        page.set_viewport_size(VIEWPORT)
        for name in names:
            cells = nbformat.read(work / f"{name}.ipynb", as_version=4).cells
            open_lab(page, server, f"{name}.ipynb")  # type: ignore[arg-type]
            accept_kernel_dialog(page)
            run_in_browser(page, name)
            panel = page.locator(".jp-NotebookPanel:visible").first
            panel.locator(".jp-Cell").last.wait_for(state="attached")  # every cell is rendered
            for part, starts in SHOTS[name]:
                index = next(i for i, c in enumerate(cells) if c.source.startswith(starts))
                cell = panel.locator(".jp-Cell").nth(index)
                cell.evaluate("el => el.scrollIntoView({block: 'start'})")
                outputs = cells[index].get("outputs") or []
                if any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                       for o in outputs):  # drawn once the widget manager restored its state
                    try:
                        cell.locator(".jupyter-widgets").first.wait_for(timeout=90_000)
                    except Exception as exc:  # Playwright's TimeoutError: shot as it is
                        print(f"{name} {part}: its widget did not draw ({exc})", flush=True)
                elif outputs:
                    cell.locator(".jp-OutputArea-output").first.wait_for()
                page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
                cell.evaluate("el => el.scrollIntoView({block: 'start'})")
                # Two animation frames: what scrolled into view is laid out and painted.
                page.evaluate("() => new Promise(r => requestAnimationFrame("
                              "() => requestAnimationFrame(r)))")
                path = OUT / f"{name}-{part}.png"
                page.screenshot(path=str(path))
                size = path.stat().st_size
                print(f"{path.relative_to(ROOT)}: {size / 1000:.0f} KB", flush=True)
                if size > MAX_BYTES:
                    raise SystemExit(f"{path} is {size} bytes, over {MAX_BYTES}: shrink VIEWPORT")
                shots.append(path)
    return shots


def lab_settings(state: Path) -> None:
    """Every cell rendered (no windowing), so a scrolled-to cell is there to capture."""
    where = state / "settings" / "@jupyterlab" / "notebook-extension"
    where.mkdir(parents=True, exist_ok=True)
    (where / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"any of {', '.join(NOTEBOOKS)} (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (it is printed)")
    ap.add_argument("--work", type=Path, help="a work folder to use (kept)")
    args = ap.parse_args(argv)
    names = args.names or list(NOTEBOOKS)
    if set(names) - set(NOTEBOOKS):
        ap.error(f"unknown notebook(s) {sorted(set(names) - set(NOTEBOOKS))}; choose from {NOTEBOOKS}")
    work = args.work or Path(tempfile.mkdtemp(prefix="wb-screenshots-"))
    os.environ["WORKBENCH_HOME"] = str(work / "home")  # the kernels and the server inherit it
    OUT.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from tests.lab.conftest import running_lab

    try:
        for name in names:  # outputs cleared, as in the repository: the browser runs them
            shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", work / f"{name}.ipynb")
        lab_settings(work / "jupyter-state")
        with running_lab(work, work / "jupyter-state", "screenshots-server.log") as server:
            capture(server, work, names)
    finally:
        if args.keep or args.work:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
