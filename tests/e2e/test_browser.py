"""End to end in a real browser: `streamlit run app.py` on loopback, Debian's chromium driven by Playwright.

Runs a tiny benchmark from the Run page, waits for its metrics, downloads the CSV from the Results page, launches a
3-trial Pareto study on the Tune page, and saves a screenshot of every page to docs/screenshots/<page>.png.

Skipped when /usr/bin/chromium is missing, unless WORKBENCH_REQUIRE_E2E=1 (CI), which turns that into a failure.
Never runs `playwright install`: the browser is the system's.
"""
from __future__ import annotations

import csv
import io
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")

BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run", "--disable-default-apps", "--disable-extensions",
                "--disable-sync", "--mute-audio", "--disable-dev-shm-usage"]
RUN_TIMEOUT_MS = 240_000


def _shots_dir(tmp: Path) -> Path:
    """The README's screenshots are refreshed only on request (WORKBENCH_SCREENSHOTS=1), so a test run leaves git
    clean; otherwise they go to $WORKBENCH_SCREENSHOT_DIR or the test's own temp dir."""
    if os.environ.get("WORKBENCH_SCREENSHOT_DIR"):
        return Path(os.environ["WORKBENCH_SCREENSHOT_DIR"])
    return ROOT / "docs" / "screenshots" if os.environ.get("WORKBENCH_SCREENSHOTS") == "1" else tmp / "screenshots"


def _require_browser() -> None:
    if CHROMIUM.exists():
        return
    message = f"{CHROMIUM} is missing (apt-get install chromium)"
    if os.environ.get("WORKBENCH_REQUIRE_E2E") == "1":
        pytest.fail(message + "; WORKBENCH_REQUIRE_E2E=1 makes this test mandatory")
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def server(tmp_path):
    _require_browser()
    port = _free_port()
    env = {**os.environ, "WORKBENCH_STORE": str(tmp_path / "store"), "WORKBENCH_JOBS": str(tmp_path / "jobs"),
           "WORKBENCH_STUDY_STORAGE": str(tmp_path / "journal.log"), "WORKBENCH_ZOO_DIR": str(tmp_path / "zoo"),
           "WORKBENCH_CLI_STUDY_STORAGE": f"sqlite:///{tmp_path / 'studies.db'}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    log = open(tmp_path / "streamlit.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.fileWatcherType", "none",
         "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
         "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"streamlit did not start:\n{(tmp_path / 'streamlit.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"url": url, "tmp": tmp_path, "env": env}
    finally:
        # stop the jobs this server started (their runners lead their own process groups), then the server
        sys.path.insert(0, str(ROOT))
        os.environ["WORKBENCH_JOBS"], old = env["WORKBENCH_JOBS"], os.environ.get("WORKBENCH_JOBS")
        try:
            from ui import jobs
            for job in jobs.list_jobs(status=jobs.RUNNING):
                job.cancel(wait_s=10)
        finally:
            if old is None:
                os.environ.pop("WORKBENCH_JOBS", None)
            else:
                os.environ["WORKBENCH_JOBS"] = old
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _fill(page, label: str, value: str) -> None:
    box = page.get_by_role("textbox", name=label, exact=True)
    box.fill(value)
    box.press("Enter")  # a Streamlit text input commits on Enter (or blur)
    page.wait_for_timeout(300)


def _wait_idle(page, timeout_ms: int = 30_000) -> None:
    """Until Streamlit is not running the script (the status widget disappears)."""
    page.wait_for_timeout(400)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout_ms)


def _shot(page, shots: Path, name: str, height: int = 1800) -> None:
    shots.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1440, "height": height})
    page.wait_for_timeout(800)
    page.screenshot(path=str(shots / f"{name}.png"))


def _goto(page, server, title: str) -> None:
    page.get_by_role("link", name=title, exact=True).first.click()
    _wait_idle(page)


def test_browser_run_results_tune_models_gpu(server):
    from playwright.sync_api import expect, sync_playwright

    shots = _shots_dir(server["tmp"])
    with sync_playwright() as pw:
        # Playwright gives the browser a fresh temporary profile (--user-data-dir) itself
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 1800}, accept_downloads=True)
        page = context.new_page()
        try:
            # ---- Run: a tiny benchmark, its metrics appear
            page.goto(server["url"], wait_until="domcontentloaded")
            expect(page.get_by_role("heading", name="Run a benchmark")).to_be_visible(timeout=60_000)
            _wait_idle(page)
            for label, value in (("Draft length k", "2"), ("Batch size", "1"), ("Max new tokens", "6"),
                                 ("Number of prompts", "2")):
                _fill(page, label, value)
            page.get_by_text("Advanced", exact=True).click()  # warm-up runs are an advanced setting
            _fill(page, "Warmup runs", "0")
            _wait_idle(page)
            start = page.get_by_role("button", name="Start benchmark")
            expect(start).to_be_enabled(timeout=30_000)
            start.click()
            expect(page.get_by_text("Speedup vs AR", exact=True)).to_be_visible(timeout=RUN_TIMEOUT_MS)
            expect(page.get_by_text("Acceptance by draft position")).to_be_visible(timeout=30_000)
            _wait_idle(page)
            _shot(page, shots, "run", 1900)

            # ---- Tune: launch a 3-trial Pareto study, wait for its Pareto front
            _goto(page, server, "Tune")
            page.get_by_label("Study script").click()
            page.get_by_role("option", name="pareto").click()
            _wait_idle(page)
            _fill(page, "Study name", "e2e-front")
            _fill(page, "Trials (total budget)", "3")
            page.get_by_text("Search space and run settings").click()
            _fill(page, "Max new tokens", "6")
            _fill(page, "Number of prompts", "2")
            _wait_idle(page)
            launch = page.get_by_role("button", name="Launch study")
            expect(launch).to_be_enabled(timeout=30_000)
            launch.click()
            expect(page.get_by_text("3 of 3 trials", exact=False).first).to_be_visible(timeout=RUN_TIMEOUT_MS)
            page.get_by_role("tab", name="Pareto · tokens_per_s vs tpot_ms_p99").click()
            _wait_idle(page)
            _shot(page, shots, "tune", 2000)

            # ---- Results: the benchmark and the 3 trials are in the table; compare two runs; download the CSV
            _goto(page, server, "Results")
            expect(page.get_by_text("4 of 4 runs", exact=False)).to_be_visible(timeout=60_000)
            for wanted in ("draft k=2 b=1", " · "):  # the benchmark, then any trial ("Select all" has no " · ")
                page.get_by_role("combobox", name="Runs to compare").click()
                page.get_by_role("option").filter(has_text=wanted).first.click()
                _wait_idle(page)
                page.keyboard.press("Escape")
            compare = page.get_by_role("combobox", name="Runs to compare").locator(
                "xpath=ancestor::*[@data-testid='stMultiSelect']")
            # .first: a trial the study drew can carry the same label as the benchmark (two chips then match)
            expect(compare.get_by_text("draft k=2 b=1", exact=False).first).to_be_visible()
            expect(page.get_by_text("Yellow: metrics that differ from the baseline", exact=False)).to_be_visible(
                timeout=30_000)
            csv_button = page.get_by_role("button", name="CSV (4 runs)").first
            expect(csv_button).to_be_visible(timeout=60_000)
            with page.expect_download(timeout=60_000) as dl:
                csv_button.click()
            rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
            assert len(rows) == 4, rows
            bench = [r for r in rows if not r["study"]]
            assert len(bench) == 1 and bench[0]["method"] == "draft" and bench[0]["status"] == "ok", bench
            assert bench[0]["k"] == "2" and bench[0]["max_new_tokens"] == "6"
            assert float(bench[0]["tokens_per_s"]) > 0
            assert sorted(r["study"] for r in rows if r["study"]) == ["e2e-front"] * 3
            _shot(page, shots, "results", 2300)

            # ---- Models and GPU
            _goto(page, server, "Models")
            expect(page.get_by_text("Zoo presets")).to_be_visible(timeout=30_000)
            _shot(page, shots, "models", 1300)
            _goto(page, server, "GPU")
            expect(page.get_by_role("heading", name="GPU")).to_be_visible(timeout=30_000)
            page.wait_for_function("() => document.body.innerText.includes('No GPU on this machine') || "
                                   "document.body.innerText.includes('memory:')", timeout=120_000)
            _shot(page, shots, "gpu", 900)
        finally:
            context.close()
            browser.close()


def test_browser_results_trust_views_and_direct_links(server):
    """Hand-made runs (tests.test_app.seed_trust_store): the best run is a trusted one with its interval, the heatmap,
    the interval error bars and the per-category view render; direct links to pages work."""
    from playwright.sync_api import expect, sync_playwright

    from tests.test_app import seed_trust_store

    seed_trust_store(server["tmp"] / "store", server["tmp"] / "question.jsonl")
    shots = _shots_dir(server["tmp"])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 2600})
        page = context.new_page()
        try:
            page.goto(f"{server['url']}/results", wait_until="domcontentloaded")  # a direct link
            expect(page.get_by_role("heading", name="Results")).to_be_visible(timeout=60_000)
            _wait_idle(page)
            expect(page.get_by_text("Best trusted speedup:", exact=False)).to_be_visible(timeout=30_000)
            expect(page.get_by_test_id("stAlertContentSuccess").get_by_text("1.40x [1.35, 1.45]", exact=False)).to_be_visible()
            expect(page.get_by_text("2 flagged run(s) not considered", exact=False)).to_be_visible()
            heat = page.get_by_text("Speedup heatmap · draft · median over runs · 1 flagged run(s) left out")
            expect(heat).to_be_visible(timeout=30_000)
            expect(page.get_by_text("n=2", exact=True).first).to_be_attached()
            expect(page.get_by_text("Speedup vs draft length, one line per method, batch")).to_be_visible()
            assert page.locator("g.errorbar").count() > 0  # the runs' 95 % intervals
            expect(page.get_by_text("Acceptance by prompt category")).to_be_visible(timeout=30_000)
            _shot(page, shots, "results-trust", 3400)
            for path, heading in (("start", "Run a benchmark"), ("run", "Run a benchmark"), ("tune", "Tune")):
                page.goto(f"{server['url']}/{path}", wait_until="domcontentloaded")
                expect(page.get_by_role("heading", name=heading)).to_be_visible(timeout=60_000)
                assert "Page not found" not in page.inner_text("body")
        finally:
            context.close()
            browser.close()


def test_browser_results_tree_and_beam_charts(server):
    """Hand-made beam runs (tests.test_app.seed_tree_store): the Trees and beams section draws acceptance by depth,
    by node rank, and diversity vs beam width by method, then by prompt category."""
    from playwright.sync_api import expect, sync_playwright

    from tests.test_app import seed_tree_store

    seed_tree_store(server["tmp"] / "store", server["tmp"] / "question.jsonl")
    shots = _shots_dir(server["tmp"])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 3200})
        page = context.new_page()
        try:
            page.goto(f"{server['url']}/results", wait_until="domcontentloaded")
            expect(page.get_by_role("heading", name="Trees and beams")).to_be_visible(timeout=60_000)
            _wait_idle(page)
            for title in ("Acceptance by draft depth, per method (mean over runs)", "Acceptance by node rank, per run",
                          "Diversity vs beam width, by method"):
                expect(page.get_by_text(title)).to_be_visible(timeout=30_000)
            page.get_by_text("prompt category", exact=True).click()
            _wait_idle(page)
            expect(page.get_by_text("Diversity vs beam width, by category")).to_be_visible(timeout=30_000)
            page.get_by_role("heading", name="Trees and beams").scroll_into_view_if_needed()
            _shot(page, shots, "results-trees", 3200)
        finally:
            context.close()
            browser.close()


def test_browser_serving_page(server):
    """Hand-made serving runs (tests.test_serving_page.seed_serve_store): the rate charts, the percentile table, the
    acceptance and per-request charts render, and the engine snippets download as JSON."""
    import json

    from playwright.sync_api import expect, sync_playwright

    from tests.test_serving_page import seed_serve_store

    seed_serve_store(server["tmp"] / "store")
    shots = _shots_dir(server["tmp"])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 3400}, accept_downloads=True)
        page = context.new_page()
        try:
            page.goto(f"{server['url']}/serving", wait_until="domcontentloaded")  # a direct link
            expect(page.get_by_role("heading", name="Serving", exact=True)).to_be_visible(timeout=60_000)
            _wait_idle(page)
            expect(page.get_by_text("8 of 8 serving runs")).to_be_visible(timeout=30_000)
            for title in ("Goodput vs request rate", "p99 TPOT vs request rate", "Acceptance by batch size",
                          "Acceptance by context length"):
                expect(page.get_by_text(title, exact=True)).to_be_visible(timeout=30_000)
            expect(page.get_by_text("Per-request TTFT (ms)", exact=False)).to_be_visible(timeout=30_000)
            expect(page.get_by_text("adaptive · ngram k=3 · 1-2:3,3-8:1").first).to_be_attached()
            _shot(page, shots, "serving", 3400)
            button = page.get_by_role("button", name="Download snippets (JSON)")
            button.scroll_into_view_if_needed()
            with page.expect_download(timeout=30_000) as dl:
                button.click()
            data = json.loads(Path(dl.value.path()).read_text())
            assert {"vllm", "trtllm", "sglang"} <= set(data)
            assert "num_speculative_tokens_per_batch_size" in data["vllm"]["speculative_config"]
        finally:
            context.close()
            browser.close()
