"""Headless Chromium (Debian's) driven by Playwright, on a JupyterLab server: what every browser
test opens before it tests anything, and how it runs a cell (tests/lab/test_browser.py,
tests/remote/test_kernels_browser.py, tests/course/test_course.py).

    with browser_page() as page:
        open_lab(page, server)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .conftest import ARTIFACTS, LabServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage"]


@contextmanager
def browser_page() -> Iterator[Any]:
    """A page in a fresh headless Chromium (1400x900, 60 s default timeout), closed after."""
    # Both come from `make browser` (a prerequisite of `make test`): their absence is a set-up
    # error, not a reason to skip.
    import playwright.sync_api as playwright_api

    assert CHROMIUM.exists(), "no /usr/bin/chromium: run `make browser` (Debian's chromium)"
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        page.set_default_timeout(60_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()


def open_lab(page: Any, lab_server: LabServer, path: str = "") -> None:
    """JupyterLab (at ``path`` in its file browser) once the Workbench plugin is active."""
    # ?reset: a fresh workspace, so no notebook of an earlier test comes back as the current one.
    page.goto(f"{lab_server.url}/lab{'/tree/' + path if path else ''}?reset&token={lab_server.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=90_000)
    # Our plugin has activated once its commands exist (the splash goes before all plugins are).
    page.wait_for_function("() => window.jupyterapp?.commands.hasCommand('workbench:new-run')"
                           " && window.jupyterapp.commands.hasCommand('launcher:create')")


def accept_kernel_dialog(page: Any) -> None:
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        dialog.locator(".jp-mod-accept").first.click()


def command(page: Any, name: str, args: dict | None = None) -> None:
    """Execute a JupyterLab command (the page needs ``window.jupyterapp``: JupyterLab's
    ``expose_app_in_browser``)."""
    # Not awaited in the page: a command can wait on a dialog (e.g. kernel selection) forever.
    page.evaluate("([c, a]) => { window.jupyterapp.commands.execute(c, a); }", [name, args or {}])


def run_first_cell(page: Any, attempts: int = 8, wait_s: float = 15) -> None:
    """Run the notebook's first cell, again if JupyterLab dropped the request (kernel not ready)."""
    run_until_started(page, "notebook:run-cell",
                      page.locator(".jp-Cell").first.locator(".jp-InputPrompt"), attempts, wait_s)


def run_until_started(page: Any, name: str, prompt: Any, attempts: int = 8,
                      wait_s: float = 15) -> None:
    """Execute the run command ``name`` until ``prompt`` (a cell's input prompt) shows its cell
    queued or run, asking again if JupyterLab dropped the request (kernel not ready yet).

    A queued or running cell shows ``[*]`` at once, so re-asking only while the prompt is still
    empty never runs the cell twice.
    """
    for _ in range(attempts):
        command(page, name)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            accept_kernel_dialog(page)
            text = prompt.text_content() or ""
            if "*" in text or any(c.isdigit() for c in text):
                return
            time.sleep(0.5)
    pytest.fail(f"the notebook never started running ({name})")


def shot(page: Any, name: str) -> None:
    """A screenshot into tests/lab/artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
