"""End to end in a real browser: JupyterLab in headless Chromium (Debian's), driven by Playwright.

A run launched from a notebook on the "Python (Workbench)" kernel (where ``%workbench status``
works without ``%load_ext``) appears in the Workbench panel, its mini loss curve grows, its
details open, and Cancel in the panel stops it. The launcher offers the kernel and the
"New fine-tuning run" card, which opens the template notebook. Screenshots go to
``tests/lab/artifacts/`` (light and dark theme).
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_notebook

import workbench
from workbench.serve import endpoints
from workbench.targets.named import target_names

from .browser import accept_kernel_dialog, browser_page, open_lab, run_until_started, shot
from .browser import command as _command
from .browser import run_first_cell as _run_first_cell
from .conftest import LabServer, wait_for


@pytest.fixture(scope="module")
def page(lab_server: LabServer):
    with browser_page() as page:
        yield page


@pytest.fixture(autouse=True)
def _shot_on_exit(request, page):
    yield
    shot(page, f"last-{request.node.name}")


def _run_all_cells(page, attempts: int = 8, wait_s: float = 15) -> None:
    """Run every cell, again while the first code cell's prompt shows nothing started."""
    run_until_started(page, "notebook:run-all-cells",
                      page.locator(".jp-Notebook .jp-CodeCell").first.locator(".jp-InputPrompt"),
                      attempts, wait_s)


def _wait_accepting_dialogs(page, locator, timeout_s: float) -> None:
    """Wait for ``locator``, accepting the kernel dialogs JupyterLab may raise meanwhile."""
    def seen() -> bool:
        accept_kernel_dialog(page)
        return locator.count() > 0

    wait_for(seen, timeout_s, f"{locator} to appear")


# Whether the Workbench panel's computed background is dark (the first non-transparent one up
# from the panel, as painted): the theme's CSS has reached the page, not only its attribute.
DARK_PANEL = """() => {
  for (let el = document.querySelector('.jp-WorkbenchRuns'); el; el = el.parentElement) {
    const m = getComputedStyle(el).backgroundColor.match(/[\\d.]+/g);
    if (!m || (m.length === 4 && Number(m[3]) === 0)) continue;
    const [r, g, b] = m.map(Number);
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 100;
  }
  return false;
}"""


def _run_card(page, run_id: str):
    """Open the Workbench side panel; the run's card, once it is listed."""
    page.locator(".jp-SideBar [data-id='workbench-runs']").click()
    card = page.locator(f".jp-WorkbenchRuns-run[data-run-id='{run_id}']")
    card.wait_for(timeout=30_000)
    return card


def _write_notebook(root: Path) -> str:
    nb = new_notebook(cells=[
        new_code_cell('%workbench status\n'
                      'job = workbench.launch({"name": "lab-browser", "train": {"max_steps": 100000}})\n'
                      'print("launched", job.id)'),
    ], metadata={"kernelspec": {"name": "workbench", "display_name": "Python (Workbench)",
                                "language": "python"}})
    nbformat.write(nb, root / "panel-test.ipynb")
    return "panel-test.ipynb"


def test_launcher_offers_the_kernel_and_the_new_run_card(page, lab_server: LabServer) -> None:
    open_lab(page, lab_server)
    _command(page, "launcher:create")
    launcher = page.locator(".jp-Launcher").first
    launcher.get_by_text("Python (Workbench)").first.wait_for()
    card = launcher.locator(".jp-LauncherCard", has_text="New fine-tuning run")
    card.wait_for()
    shot(page, "01-launcher")
    card.click()
    tab = page.locator(".lm-TabBar-tab", has_text="fine-tune")
    tab.first.wait_for()
    _wait_accepting_dialogs(page, page.locator(".jp-Toolbar-kernelName", has_text="Python (Workbench)"), 90)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    notebooks = sorted(p.name for p in lab_server.root.glob("fine-tune*.ipynb"))
    assert notebooks, "the card created no notebook"
    nb = nbformat.read(lab_server.root / notebooks[-1], as_version=4)
    assert nb.metadata.kernelspec.name == "workbench"
    assert any("workbench.launch" in c.source for c in nb.cells)
    shot(page, "02-new-run-notebook")
    _command(page, "application:close-all")
    # Closed once no notebook is left open; a dialog asking about the kernel or unsaved changes
    # is accepted meanwhile.
    def closed() -> bool:
        accept_kernel_dialog(page)
        return page.locator(".jp-NotebookPanel").count() == 0

    wait_for(closed, 60, "every notebook to close")


def test_run_from_a_notebook_shows_in_the_panel_grows_and_cancels(page, lab_server: LabServer) -> None:
    path = _write_notebook(lab_server.root)
    open_lab(page, lab_server, path)
    _wait_accepting_dialogs(page, page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']"), 90)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    page.locator(".lm-TabBar-tab.lm-mod-current", has_text="panel-test").first.wait_for()
    _run_first_cell(page)
    _wait_accepting_dialogs(page, page.locator(".jp-OutputArea-output", has_text="launched"), 180)
    output = page.locator(".jp-Cell").first.locator(".jp-OutputArea").inner_text()
    assert "RUN" in output and "STATE" in output  # %workbench status: the magic was preloaded
    run_id = output.split("launched")[-1].split()[0]

    card = _run_card(page, run_id)
    spark = card.locator("svg.jp-WorkbenchSpark")

    def last_step() -> int:
        value = spark.get_attribute("data-last-step")
        return int(float(value)) if value else 0

    first = wait_for(last_step, 180, "the first loss points in the panel")
    shot(page, "03-panel-running")
    # At the sidebar's default width every header button is whole and inside the panel.
    panel = page.locator(".jp-WorkbenchRuns").first.bounding_box()
    for name in ("New run", "Compare", "Refresh"):
        box = page.locator(".jp-WorkbenchRuns-header button", has_text=name).first.bounding_box()
        assert box and panel and box["x"] >= panel["x"] and \
            box["x"] + box["width"] <= panel["x"] + panel["width"], (name, box, panel)
    wait_for(lambda: last_step() > first, 120, "the panel's loss curve to grow")
    assert card.get_attribute("data-state") == "running"
    assert "step " in card.locator(".jp-WorkbenchRuns-meta").inner_text()

    card.get_by_role("button", name="details of lab-browser").click()
    page.locator(".jp-WorkbenchDetails polyline.jp-WorkbenchPlot-train").first.wait_for()
    page.locator(".jp-WorkbenchDetails-log", has_text="==>").first.wait_for()
    shot(page, "04-details")

    card.get_by_role("button", name="cancel lab-browser").click()
    wait_for(lambda: card.get_attribute("data-state") == "cancelled", 90, "the panel to show cancelled")
    assert workbench.get_job(run_id).state == "cancelled"
    assert card.get_by_role("button", name="cancel lab-browser").count() == 0
    shot(page, "05-cancelled")

    _command(page, "apputils:change-theme", {"theme": "JupyterLab Dark"})
    page.locator("body[data-jp-theme-light='false']").wait_for(state="attached")
    # The dark theme's style sheet has applied once the panel itself is painted dark.
    page.wait_for_function(DARK_PANEL)
    shot(page, "06-dark")
    _command(page, "apputils:change-theme", {"theme": "JupyterLab Light"})


@pytest.fixture(scope="module")
def finished_run(lab_server: LabServer, finished_job: workbench.Job) -> workbench.Job:
    return finished_job  # the suite's shared finished run (tests/conftest.py)


def _card(page, lab_server: LabServer, job: workbench.Job):
    open_lab(page, lab_server)
    return _run_card(page, job.id)


def test_tensorboard_opens_in_a_new_tab_through_jupyter(page, lab_server: LabServer,
                                                        finished_run) -> None:
    card = _card(page, lab_server, finished_run)
    with page.context.expect_page(timeout=90_000) as opened:
        card.get_by_role("button", name=f"open TensorBoard for {finished_run.name}").click()
    tab = opened.value
    tab.wait_for_load_state()
    # The same origin as JupyterLab, logged in by its cookie: no loopback port in the address.
    assert tab.url.startswith(f"{lab_server.url}/workbench/tensorboard/{finished_run.id}/")
    # TensorBoard's page drew the run's loss card from data it fetched through the relay.
    tab.get_by_role("combobox", name="Filter tags (regex)").fill("train/loss")
    tab.locator("card-view", has_text="train/loss").first.wait_for(timeout=90_000)
    shot(tab, "07-tensorboard")
    tab.close()


def test_details_show_the_runs_scores_and_settings(page, lab_server: LabServer,
                                                  finished_run) -> None:
    """Details of a finished run: its newest scores in a table (this run beside the base model)
    and the knobs it was run with, the whole spec a click away."""
    card = _card(page, lab_server, finished_run)
    # A CPU run with no price set reads "free" on its card, as job.summary() says (issue 37).
    assert " · free · " in card.locator(".jp-WorkbenchRuns-meta").inner_text()
    card.get_by_role("button", name=f"details of {finished_run.name}").click()
    scores = page.locator(".jp-WorkbenchDetails-scores table").first
    scores.wait_for(timeout=60_000)
    cost = page.locator("dt", has_text="Cost").first
    assert cost.evaluate("dt => dt.nextElementSibling.textContent") == "free"
    lines = [json.loads(x) for x in
             (finished_run.run_dir.path / "eval.jsonl").read_text().splitlines() if x]
    newest = [x for x in lines if x["task"] == "heldout" and x["model"] == "run"][-1]
    row = scores.locator("tr", has_text="exact_match").first
    assert row.locator("td").all_inner_texts()[:3] == [
        "heldout", "exact_match", f"{newest['metrics']['exact_match']:.3f}"]
    settings = page.locator(".jp-WorkbenchDetails-settings").first
    assert settings.locator("dt", has_text="learning rate").count() == 1
    assert "0.003" in settings.locator("dd").all_inner_texts()  # the run's lr: 3e-3
    settings.locator("summary", has_text="Full spec (YAML)").click()
    assert "lr: 0.003" in settings.locator("pre").inner_text()
    shot(page, "04b-details-scores-settings")


def test_compare_opens_the_runs_side_by_side_with_what_differs_first(
        page, lab_server: LabServer) -> None:
    jobs = [workbench.launch({"name": "lab-compare", "train": {"max_steps": 4, "lr": lr},
                              "eval": {"tasks": []}}) for lr in (1e-3, 3e-3)]
    for job in jobs:
        assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=20)
    open_lab(page, lab_server)
    _run_card(page, jobs[0].id)  # opens the panel
    for job in jobs:
        card = page.locator(f".jp-WorkbenchRuns-run[data-run-id='{job.id}']")
        card.wait_for(timeout=30_000)
        card.get_by_role("checkbox", name="select lab-compare to compare").check()
    page.locator(".jp-WorkbenchRuns-header button", has_text="Compare (2)").click()
    view = page.locator(".jp-WorkbenchCompare").first
    view.locator("tbody tr").nth(1).wait_for(timeout=60_000)
    headers = view.locator("thead tr").nth(1).locator("th").all_inner_texts()
    assert headers[:2] == ["run", "train.lr"]  # what differs, first
    assert view.locator("thead th.jp-mod-setting").inner_text() == "differs"
    for i, job in enumerate(jobs):
        row = view.locator(f"tbody tr[data-run-id='{job.id}']")
        assert row.locator("td").nth(1).inner_text() == ["0.001", "0.003"][i]
        assert view.locator(f"polyline[data-label='{job.id}']").count() == 1
    shot(page, "06b-compare")


def test_export_from_the_panel_shows_its_progress_and_result_in_details(
        page, lab_server: LabServer) -> None:
    job = workbench.launch({"name": "lab-export-ui", "train": {"max_steps": 4},
                            "eval": {"tasks": []}})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=20)
    card = _card(page, lab_server, job)
    card.get_by_role("button", name="export lab-export-ui").click()
    dialog = page.locator(".jp-Dialog")
    assert dialog.get_by_role("checkbox", name="export Merged weights").is_checked()
    dialog.get_by_role("button", name="Export").click()
    section = page.locator(".jp-WorkbenchDetails-export").first
    section.locator("dt", has_text="merged").wait_for(timeout=600_000)
    merged = Path(section.locator("dd").first.inner_text())
    assert (merged / "config.json").is_file()
    assert job.status()["export"]["folders"]["merged"] == str(merged)
    shot(page, "06c-export")


def test_deploy_asks_where_to_serve_starting_from_the_runs_target(page, lab_server: LabServer,
                                                                   finished_run) -> None:
    card = _card(page, lab_server, finished_run)
    before = [e.name for e in endpoints()]
    # Every request the page sends from here on: a cancelled dialog must send no deploy at all
    # (checked on the requests themselves, not by waiting a while for an endpoint not to appear).
    sent: list[str] = []
    page.on("request", lambda r: sent.append(f"{r.method} {r.url}"))
    card.get_by_role("button", name=f"deploy {finished_run.name}").click()
    dialog = page.locator(".jp-Dialog")
    dialog.get_by_text(f"Deploy {finished_run.name}").wait_for()
    choice = dialog.get_by_role("combobox", name="deploy target")
    assert choice.input_value() == finished_run.target == "local"
    offered = choice.locator("option").all_inner_texts()
    assert offered == target_names()  # the server's list, local first
    shot(page, "08-deploy-dialog")
    dialog.get_by_role("button", name="Cancel").click()
    dialog.wait_for(state="detached")
    # A request the panel sends after this one has certainly left after any deploy the Cancel
    # could have sent: wait for the panel's next poll of the runs list, then look.
    with page.expect_request(lambda r: r.url.split("?")[0].endswith("/workbench/api/runs"),
                             timeout=60_000):
        pass
    assert not [r for r in sent if "/deploy" in r], sent
    assert [e.name for e in endpoints()] == before  # cancelled: nothing deployed


def test_a_budget_stopped_run_says_how_to_go_on(page, lab_server: LabServer) -> None:
    # 3,600 per core-hour on 2 processes: 2 per second: a limit of 20 stops the run within 10 s,
    # start-up (billed too) included, so in or just after its start-up. What the panel shows and
    # asks is the same for any budget stop (the run's note and the resume dialog); the stop
    # mid-training and its bill are tests/test_budget.py's. (A limit of 200 held the suite
    # 100 s here.)
    job = workbench.launch({"name": "lab-budget", "train": {"max_steps": 100000},
                            "checkpoint": {"keep": 1},
                            "budget": {"price_per_cpu_core_hour": 3600.0, "limit": 20.0}})
    # Start-up on a loaded machine can take minutes: the deadline leaves room for it.
    assert job.wait(timeout=900, progress=False) == "budget_stopped", job.logs(tail=30)
    card = _card(page, lab_server, job)
    note = card.locator(".jp-WorkbenchRuns-error.jp-mod-note")
    note.wait_for()
    assert note.inner_text() == job.status()["note"]
    assert f"workbench resume {job.id} --budget N" in note.inner_text()
    shot(page, "09-budget-stopped")
    # Resume asks for a larger limit (the same one would stop the run again at once).
    card.get_by_role("button", name="resume lab-budget").click()
    dialog = page.locator(".jp-Dialog")
    dialog.get_by_text("Resume lab-budget with a larger budget").wait_for()
    dialog.get_by_role("spinbutton", name="new budget limit").fill("1000")
    shot(page, "10-resume-budget")
    dialog.get_by_role("button", name="Resume").click()
    try:
        wait_for(lambda: job.state == "running", 180, "the run resumed with a larger budget")
        assert yaml.safe_load(job.run_dir.resume_file.read_text()) == {"budget.limit": 1000.0}
    finally:
        job.cancel()


NEWS_PROMPT = "official Jupyter news"  # JupyterLab's "Would you like to get notified about ..."


def _outputs_text(page) -> str:
    # text_content, not inner_text: cells scrolled out of view are not laid out, but in the DOM.
    return "\n".join(page.locator(".jp-Notebook .jp-OutputArea").all_text_contents())


def test_the_quickstart_runs_in_the_lab_with_plots_and_no_noise(page, lab_server: LabServer) -> None:
    """What a newcomer sees: `make lab`'s quickstart, run top to bottom in the browser."""
    nb = nbformat.read(Path(__file__).parents[2] / "notebooks" / "quickstart.ipynb", as_version=4)
    nbformat.write(nb, lab_server.root / "quickstart.ipynb")
    open_lab(page, lab_server, "quickstart.ipynb")
    _wait_accepting_dialogs(page, page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']"), 90)
    # The notebook declares the kernel the lab installs: no kernel dialog, no "Python 3".
    page.locator(".jp-Toolbar-kernelName", has_text="Python (Workbench)").first.wait_for()
    shot(page, "11-quickstart-opened")
    _run_all_cells(page)
    cells = page.locator(".jp-Notebook .jp-Cell.jp-CodeCell")
    last_prompt = cells.last.locator(".jp-InputPrompt")

    def finished() -> bool:
        accept_kernel_dialog(page)
        text = last_prompt.text_content() or ""
        return any(c.isdigit() for c in text) and "*" not in text

    wait_for(finished, 900, "the quickstart to run to its last cell")
    # Every cell is in the DOM (JupyterLab's default windowing hides, never detaches, cells), so
    # the checks below read the whole notebook and not only what is on screen.
    assert page.locator(".jp-Notebook .jp-Cell").count() == len(nb.cells)
    text = _outputs_text(page)
    assert "succeeded" in text and "RUN" in text and "STATE" in text  # it ran, to the status table
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert errors.count() == 0, errors.all_text_contents()
    assert page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
    assert "<Figure" not in text
    assert "Setting accelerator to CPU" not in text and "Warning" not in text
    # job.plot() shows a picture, and the loss table has no row without a loss.
    plot_cell = cells.filter(has=page.locator(".jp-InputArea", has_text="job.plot()")).first
    image = plot_cell.locator(".jp-OutputArea-output img")
    assert image.count() == 1
    image.scroll_into_view_if_needed()
    page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=image.element_handle())
    shot(page, "12-quickstart-plot")
    table_cell = cells.filter(has=page.locator(".jp-InputArea", has_text="metrics_df()")).first
    table = table_cell.locator(".jp-OutputArea-output table").first
    table.scroll_into_view_if_needed()
    assert "NaN" not in table.text_content()
    shot(page, "13-quickstart-end")
    # No news prompt, because the settings the extension ships say so (not because it is late).
    assert page.get_by_text(NEWS_PROMPT).count() == 0
    settings = page.evaluate("() => window.jupyterapp.serviceManager.settings"
                             ".fetch('@jupyterlab/apputils-extension:notification')"
                             ".then(p => p.schema.properties.fetchNews.default)")
    assert settings == "false"
