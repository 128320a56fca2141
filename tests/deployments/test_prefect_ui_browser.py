"""The Prefect UI in a real browser (Debian's Chromium driven by Playwright) against a real `prefect server start`.

What a user does: open the deployments list, open the pipeline deployment's custom run form, read it, press
Submit; watch the run complete and find the extraction's progress and result table on the run pages; open a
failed extraction run and press Retry. The stack (server, `prefect deploy` of deployments/prefect.yaml, a
process worker with the fault gate) is test_deployments_e2e's module fixture. The form is opened the way the
UI's own "Custom run" menu item opens it (the deployment's parameters in the ``parameters`` query), here with
tiny sizes, so Submit sends exactly what the rendered form holds.

Screenshots of every step go to ``<tmp>/ui-shots`` (the path is printed). Marked slow: ~4-6 min on 2 busy
cores (stack ~1-2 min, the whole pipeline ~1.5 min, an extraction failed and retried ~1 min). Needs
``/usr/bin/chromium`` (Debian package chromium) and the PyPI package playwright (no browser download).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest
from test_deployments_e2e import _extract_params, _pipeline_params, _tail, stack  # noqa: F401  (module fixture)

from tests.extract_helpers import ledger_ids

CHROMIUM = "/usr/bin/chromium"
PROPERTY = "contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')"  # one field's block
# Without the background-networking flags Chromium keeps dialing Google's hosts, which this closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason="Debian's chromium is not installed (/usr/bin/chromium)"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (PyPI) is not installed")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class UI:
    """One browser page on the Prefect UI, saving a numbered screenshot per step."""

    def __init__(self, browser, base: str, shots: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.set_default_timeout(90_000)
        self.base, self.shots, self.n = base, shots, 0

    def goto(self, path: str, wait_text: str) -> None:
        self.page.goto(f"{self.base}{path}")
        self.page.get_by_text(wait_text, exact=False).first.wait_for()

    def shot(self, name: str) -> Path:
        self.n += 1
        path = self.shots / f"{self.n:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def blocks(self, label: str) -> list[str]:
        """Inner HTML of every form property whose label reads ``label`` (the innermost property block)."""
        xpath = (f"//span[contains(@class, 'schema-form-property__label') and normalize-space()='{label}']"
                 f"/ancestor::div[{PROPERTY}][1]")
        loc = self.page.locator(f"xpath={xpath}")
        return [loc.nth(i).inner_html() for i in range(loc.count())]

    def text_of(self, html: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()

    def custom_run(self, deployment_id: str, parameters: dict) -> None:
        """The custom run page as the UI's "Custom run" link opens it (router query parameters=<JSON, encoded>)."""
        query = quote(quote(json.dumps(parameters), safe=""), safe="")
        self.goto(f"/deployments/deployment/{deployment_id}/run?parameters={query}", "Parameters")
        self.page.get_by_text("Run Dir (Optional)" if "run_dir" in parameters.get("params", {}) else "Parameters",
                              exact=True).first.wait_for()

    def submit(self, stack, deployment_id: str) -> str:  # noqa: F811
        """Press Submit; the UI creates the run and goes back to the deployment's Runs tab. Returns the new run."""
        before = set(_run_ids(stack, deployment_id))
        self.page.get_by_role("button", name="Submit").click()
        self.page.wait_for_url(re.compile(r".*(/runs/flow-run/|/deployments/deployment/[0-9a-f-]{36}\?tab=Runs).*"))
        new = [r for r in _run_ids(stack, deployment_id) if r not in before]
        assert len(new) == 1, f"Submit created {len(new)} runs"
        return new[0]


def _run_ids(stack, deployment_id: str) -> list[str]:  # noqa: F811
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with stack.client() as c:
        runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    return [str(r.id) for r in runs]


def _deployment_id(stack, name: str) -> str:  # noqa: F811
    with stack.client() as c:
        return str(c.read_deployment_by_name(name).id)


def _children(stack, run_id: str):  # noqa: F811
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with stack.client() as c:
        return c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])))


def _check_deployments_list(ui: UI) -> None:
    ui.goto("/deployments", "pipeline-gpu-process")
    ui.shot("deployments")
    names = [ui.page.locator("a", has_text=n).count() for n in
             ("extract-gpu-process", "train-gpu-process", "bench-gpu-process", "pipeline-gpu-process",
              "pipeline-gpu-docker", "pipeline-weekly-reextract-schedule-off", "pipeline-fanout-control")]
    assert all(names), names  # every row's name says its flow; the weekly one says its schedule is off
    body = ui.page.inner_text("body")
    assert not re.search(r"^\s*gpu-(process|docker)\s*$", body, re.M), "a deployment row named only by its pool"


def _check_form(ui: UI, schema: dict) -> None:
    """(a) descriptions render whole, (b) bounds shown, (c) store settings once, (d) no None switch on the
    pipeline's derived fields, (e) dropdowns for train device and bench dtype, (f) output dir says its default."""
    ui.shot("pipeline-form")
    text = ui.page.inner_text("body")
    described = re.findall(r'"description":\s*"([^"]*)"', json.dumps(schema))
    assert described and not [d for d in described if re.search(r"<[A-Za-z_]", d)]  # (a) nothing the UI eats
    for probe in ("Local folder of this pipeline: extractions/, train/, export/, bench/, stages.json.",
                  "started one after another per GPU (see sglang_args). Range: 1 to 64.",  # (b)
                  "Tries per request for retryable errors. Range: 1 to 20.",
                  "TTT unroll length k.",
                  "that holds one subfolder per extraction id; empty: the extractions folder inside the run folder."):
        assert probe in text, probe
    assert re.search(r"Range: \d+ to \d+\.", text) and "At least 1." in text
    assert len(ui.blocks("Store Target File Mb (Optional)")) == 1  # (c) once, at the pipeline level
    assert "Last step: convert the validated shards" not in text
    for label in ("Run Dir (Optional)", "Store Url (Optional)", "Out Dir (Optional)", "Target (Optional)",
                  "Output Dir (Optional)", "Draft (Optional)"):  # (d) the pipeline's derived fields: a text box
        found = ui.blocks(label)
        assert found and all("schema-form-property__description" in b for b in found), label
        assert all("Property is type" not in b and "schema-form-property-null" not in b for b in found), label
    for label, options in (("Device (Optional)", "auto cpu cuda"), ("Dtype (Optional)", "auto")):  # (e)
        found = ui.blocks(label)
        assert found and all("p-select" in b for b in found), (label, [ui.text_of(b)[:200] for b in found])
        assert options.split()[0] in ui.text_of(found[0])


@pytest.mark.timeout(900)
def test_pipeline_form_run_artifacts_and_retry_in_the_browser(stack, browser, tiny_model_dir, tmp_path):  # noqa: F811
    shots = tmp_path / "ui-shots"
    shots.mkdir()
    print(f"screenshots: {shots}")
    ui = UI(browser, stack.api_url.removesuffix("/api"), shots)
    _check_deployments_list(ui)

    pipe_id = _deployment_id(stack, "pipeline/pipeline-gpu-process")
    with stack.client() as c:
        schema = c.read_deployment(pipe_id).parameter_openapi_schema
    params = _pipeline_params(tiny_model_dir, tmp_path / "run")
    params["params"]["extract"]["extraction_id"] = "ui-pipe"
    ui.custom_run(pipe_id, params)
    _check_form(ui, schema)

    run_id = ui.submit(stack, pipe_id)  # the form's own Submit: the run gets exactly what the form holds
    with stack.client() as c:
        sent = c.read_flow_run(run_id).parameters
    assert sent["params"]["extract"]["limit"] == 60 and sent["params"]["train"]["max_steps"] == 4
    assert stack.wait(run_id, timeout_s=420) == "COMPLETED", _tail(stack.logs / "worker.log")
    ui.goto(f"/runs/flow-run/{run_id}", "Completed")
    ui.shot("pipeline-run-completed")

    extract_run = next(r for r in _children(stack, run_id)
                       if (r.parameters.get("params") or {}).get("extraction_id") == "ui-pipe")
    ui.goto(f"/runs/flow-run/{extract_run.id}", "Artifacts")
    ui.page.get_by_text("Artifacts", exact=True).first.click()
    ui.page.get_by_text("extract-summary-ui-pipe").first.wait_for()
    ui.shot("extract-artifacts")
    assert "extract-progress-ui-pipe" in ui.page.inner_text("body")
    ui.page.get_by_text("extract-summary-ui-pipe").first.click()
    ui.page.get_by_text("done").first.wait_for()
    ui.shot("extract-result-table")

    # a failed extraction (every 3rd request answered 503 while the gate exists), then Retry in the UI
    out = tmp_path / "retry-out"
    ext_id = _deployment_id(stack, "extract/extract-gpu-process")
    stack.gate.touch()
    try:
        ui.custom_run(ext_id, {"params": _extract_params(tiny_model_dir, out, "ui-retry", max_attempts=1,
                                                         max_relaunch_rounds=0)})
        ui.shot("extract-form")
        failed_id = ui.submit(stack, ext_id)
        assert stack.wait(failed_id) == "FAILED", _tail(stack.logs / "worker.log")
    finally:
        stack.gate.unlink(missing_ok=True)
    first = json.loads((out / "ui-retry" / "report.json").read_text())
    pending = first["pending"]
    assert pending > 0 and first["done"] == len(ledger_ids(out / "ui-retry")) > 0
    ui.goto(f"/runs/flow-run/{failed_id}", "Failed")
    retry = ui.page.get_by_role("button", name="Retry")
    retry.wait_for()
    ui.shot("extract-failed")
    retry.click()
    confirm = ui.page.get_by_role("button", name=re.compile("^Retry"))  # the UI may ask to confirm
    if confirm.count() > 1:
        confirm.last.click()
    assert stack.wait(failed_id, timeout_s=240) == "COMPLETED", _tail(stack.logs / "worker.log")
    second = json.loads((out / "ui-retry" / "report.json").read_text())
    assert second["run"]["requests"] == pending and second["pending"] == 0  # only pending samples were sent
    ui.page.reload()
    ui.page.get_by_text("Completed").first.wait_for()
    ui.shot("extract-retried-completed")
