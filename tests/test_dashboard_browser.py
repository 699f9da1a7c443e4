"""The dashboard in a real browser: JupyterLab and Jupyter Notebook 7 in headless Chromium run a background fit with
`TrainingDashboard`.

Checks that the frame counter rises during the fit, that dragging the lr slider changes the lr the fit records for
later batches, that Pause holds the fit until Resume, that Stop ends the fit with the learner's history kept, and
that a plain (blocking) fit shows live frames while its cell runs. Saves screenshots to artifacts/, one set per
front end.
"""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / 'tests' / 'browser' / 'dashboard_fit.ipynb'
ARTIFACTS = ROOT / 'artifacts'
CHROMIUM = shutil.which('chromium') or '/usr/bin/chromium'
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                 '--disable-sync', '--no-first-run', '--disable-quic']


@dataclass(frozen=True)
class FrontEnd:
    "What differs between the Jupyter front ends on one jupyter_server; cells, prompts and outputs share their markup."
    name: str
    app: str                  # the `jupyter` subcommand that serves it
    app_args: tuple
    notebook_path: str        # URL path of an open notebook, before its name
    kernel_ready: str         # selector present once the notebook's kernel is connected and not starting
    artifact_prefix: str


FRONT_ENDS = {
    'lab': FrontEnd('JupyterLab', 'lab', ('--LabApp.workspaces_dir={tmp}/workspaces',), '/lab/tree/',
                    '.jp-StatusBar-TextItem:has-text("Idle")', 'dashboard'),
    # Notebook 7 starts the notebook's kernel without asking and has no status bar; its kernel indicator fades out
    # for both idle and busy, and is marked info/warn/error while the kernel starts, restarts or is dead.
    'notebook7': FrontEnd('Jupyter Notebook 7', 'notebook', (), '/notebooks/',
                          '.jp-NotebookKernelStatus-fade:not(.jp-NotebookKernelStatus-info)', 'dashboard_notebook7'),
}


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value: return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def server_ready(url, process):
    if process.poll() is not None: raise AssertionError(f"the Jupyter server exited with code {process.returncode}")
    try:
        with urllib.request.urlopen(url, timeout=2) as response: return response.status == 200
    except OSError: return False


@pytest.fixture(params=list(FRONT_ENDS))
def jupyter(request, tmp_path):
    "A Jupyter front end on a free localhost port, serving a copy of the test notebook; always shut down afterwards."
    front_end = FRONT_ENDS[request.param]
    if not os.path.exists(CHROMIUM): pytest.skip("chromium is not installed (`make browser-deps` installs it as root)")
    pytest.importorskip('playwright.sync_api', reason="the playwright package is not installed")
    jupyter = Path(sys.executable).parent / 'jupyter'
    if not jupyter.exists(): pytest.skip(f"no jupyter next to {sys.executable}")
    if front_end.app == 'notebook':
        notebook = pytest.importorskip('notebook', reason="the notebook package is not installed")
        if int(notebook.__version__.split('.')[0]) < 7: pytest.skip(f"notebook {notebook.__version__} is older than 7")
    notebook = getattr(request.module, 'NOTEBOOK', NOTEBOOK)  # the test module's own notebook
    shutil.copy(notebook, tmp_path / notebook.name)
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != 'IN_TEST'}
    env.update(OMP_NUM_THREADS='1', TEACHLOOP_BROWSER_RESULT=str(tmp_path / 'result.json'),
               JUPYTER_RUNTIME_DIR=str(tmp_path / 'runtime'), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / 'workspaces'))
    log = open(tmp_path / 'server.log', 'w')
    process = subprocess.Popen(
        [str(jupyter), front_end.app, '--no-browser', f'--ServerApp.token={token}', '--ServerApp.ip=127.0.0.1',
         f'--ServerApp.port={port}', '--ServerApp.port_retries=0', f'--ServerApp.root_dir={tmp_path}', '--allow-root',
         *(arg.format(tmp=tmp_path) for arg in front_end.app_args)],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: server_ready(f'http://127.0.0.1:{port}/api/status?token={token}', process), 90, front_end.name)
        yield dict(url=f'http://127.0.0.1:{port}{front_end.notebook_path}{notebook.name}?token={token}',
                   front_end=front_end, tmp=tmp_path, result=tmp_path / 'result.json', log=tmp_path / 'server.log')
    finally:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if process.poll() is not None: break
            try: os.killpg(process.pid, sig)
            except ProcessLookupError: break
            try: process.wait(grace)
            except subprocess.TimeoutExpired: pass
        log.close()


def frame_count(page, dashboard=0):
    "The frame counter of the `dashboard`-th dashboard on the page (0 before it shows one)."
    counter = page.locator('.tl-frame')
    return int(counter.nth(dashboard).inner_text()) if counter.count() > dashboard else 0


def is_running(page, cell):
    return '*' in page.locator('.jp-Cell .jp-InputPrompt').nth(cell).inner_text()


def frame_stable(page, seconds):
    "The frame count if it does not change for `seconds`, else None."
    before = frame_count(page)
    time.sleep(seconds)
    return before if frame_count(page) == before else None


def open_notebook(page, url, front_end):
    page.goto(url, timeout=90_000)
    page.wait_for_selector('.jp-Notebook .jp-Cell', timeout=90_000)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # JupyterLab may ask "Select Kernel" first
        accept = page.locator('.jp-Dialog .jp-mod-accept')
        if accept.count(): accept.first.click()
        if page.locator(front_end.kernel_ready).count():
            # JupyterLab's question about news would cover part of the screenshots
            page.add_style_tag(content='.Toastify { display: none !important; }')
            return
        time.sleep(0.3)
    raise AssertionError("the kernel did not become idle")


def run_cell(page, cell, attempts=3):
    "Run a cell; a run sent while the kernel connection is still settling can be dropped, so retry."
    prompt = page.locator('.jp-Cell .jp-InputPrompt').nth(cell)
    for attempt in range(1, attempts + 1):
        page.locator('.jp-Cell .jp-InputArea-editor').nth(cell).click()
        page.keyboard.press('Control+Enter')
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if any(c == '*' or c.isdigit() for c in prompt.inner_text()): return attempt
            time.sleep(0.3)
    raise AssertionError(f"the cell did not start running (prompt {prompt.inner_text()!r})")


def drag_slider_left(page, selector, pixels):
    handle = page.locator(f'{selector} .noUi-handle').first
    handle.scroll_into_view_if_needed()  # below a tall figure the sliders may start out of view
    box = handle.bounding_box()
    x, y = box['x'] + box['width'] / 2, box['y'] + box['height'] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    for step in range(1, 11): page.mouse.move(x - pixels * step / 10, y)
    page.mouse.up()


@contextmanager
def browser_page(jupyter, prefix, width=1300):
    "A headless Chromium page; on an error, a screenshot `<prefix>_failure.png` and the server log's end."
    from playwright.sync_api import sync_playwright
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={'width': width, 'height': 1000})
        try: yield page
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / f'{prefix}_failure.png'))
            print(jupyter['log'].read_text()[-3000:])
            raise
        finally: browser.close()


def test_dashboard_in_browser(jupyter):
    timings, start = {}, time.monotonic()
    prefix = jupyter['front_end'].artifact_prefix
    with browser_page(jupyter, prefix) as page:
        open_notebook(page, jupyter['url'], jupyter['front_end'])
        timings['notebook open'] = time.monotonic() - start
        timings['run attempts'] = run_cell(page, 0)

        # (a) frames are drawn during the fit
        first = wait_for(lambda: frame_count(page), 120, 'the first frame')
        timings['first frame'] = time.monotonic() - start
        wait_for(lambda: frame_count(page) >= first + 3, 60, 'more frames')
        page.locator('.tl-dashboard').screenshot(path=str(ARTIFACTS / f'{prefix}.png'))

        # (b) the lr slider steers the running fit
        before = page.locator('.tl-lr-slider .widget-readout').inner_text()
        drag_slider_left(page, '.tl-lr-slider', 40)
        readout = wait_for(lambda: (t := page.locator('.tl-lr-slider .widget-readout').inner_text()) != before and t,
                           10, 'the slider readout to change')
        frames_after_drag = frame_count(page)
        wait_for(lambda: frame_count(page) >= frames_after_drag + 8, 60, 'frames after the slider change')
        page.locator('.tl-dashboard').screenshot(path=str(ARTIFACTS / f'{prefix}_after_slider.png'))

        # Pause holds the fit (no more ticks, so no more frames) until Resume
        page.locator('.tl-dashboard button', has_text='Pause').click()
        paused_at = wait_for(lambda: frame_stable(page, 1.5), 20, 'the frames to stop while paused')
        page.locator('.tl-dashboard button', has_text='Resume').click()
        wait_for(lambda: frame_count(page) > paused_at, 30, 'frames after Resume')

        # (c) Stop ends the fit, and the learner keeps its history
        page.locator('.tl-dashboard button', has_text='Stop').click()
        wait_for(jupyter['result'].exists, 60, 'the fit to end after Stop')
        timings['stopped'] = time.monotonic() - start

        # a blocking fit (the cell runs all along) still shows live frames
        run_cell(page, 1)
        blocking_first = wait_for(lambda: is_running(page, 1) and frame_count(page, 1), 60, 'a blocking-fit frame')
        wait_for(lambda: frame_count(page, 1) > blocking_first, 60, 'the next frame of the blocking fit')
        frames_seen_while_running = is_running(page, 1)
        wait_for(lambda: 'blocking fit done' in page.locator('.jp-Cell').nth(1).inner_text(), 120,
                 'the blocking fit to end')
        timings['blocking fit done'] = time.monotonic() - start

    assert frames_seen_while_running, "the blocking fit's frames must update while its cell runs"
    result = json.loads(jupyter['result'].read_text())
    print(jupyter['front_end'].name, 'timings (s):', {k: round(v, 1) for k, v in timings.items()},
          'frames:', result['frames'], 'lr:', readout)
    assert result['prefix'] == sys.prefix, "the kernel must run the project's virtual environment"
    assert result['error'] is None and result['frames'] > first
    lr_changes = [(step, value) for step, name, value in result['changes'] if name == 'lr']
    assert len(lr_changes) == 1, result['changes']
    step, new_lr = lr_changes[0]
    assert new_lr < 3e-3 and abs(new_lr - float(readout)) <= 0.01 * new_lr
    lrs = result['lrs']
    assert set(lrs[:step]) == {3e-3} and set(lrs[step:]) == {new_lr} and step < len(lrs)
    assert result['n_losses'] == result['train_iter'] == len(lrs) < result['n_batches']
    assert len(result['values']) >= 1 and all(len(row) == 5 for row in result['values'])
    assert result['panels'] == ['sharpness', 'layers'] and result['n_sharpness'] >= 1  # the third row was drawn
