"""The dashboard in a real browser: JupyterLab in headless Chromium runs a background fit with `TrainingDashboard`.

Checks that the frame counter rises during the fit, that dragging the lr slider changes the lr the fit records for
later batches, that Pause holds the fit until Resume, that Stop ends the fit with the learner's history kept, and
that a plain (blocking) fit shows live frames while its cell runs. Saves screenshots to artifacts/.

Jupyter Notebook 7 is made of JupyterLab's parts (its cells, outputs and widget manager): the widgets' test
(test_widgets_browser.py) drives it, this one JupyterLab, so that each front end is driven in the browser by one test.

Every wait is for progress: frames on the page, the training step a frame shows, what the kernel reports on the page
(the step at which it took a slider's value, a pause holding it). The fits run until the test has seen what it needs
(Stop, or a file the blocking fit looks for), so a slow or busy machine only makes the test slower; the time limits
are a safety net against a hang, far above what the steps take.
"""
import json
import os
import re
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

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / 'tests' / 'browser' / 'dashboard_fit.ipynb'
ARTIFACTS = ROOT / 'artifacts'
from chromium import CHROMIUM, CHROMIUM_ARGS, need_chromium  # noqa: E402
# How long any one wait may take before the test calls it a hang: a safety net, not a measure of speed. A step takes
# seconds on a quiet machine and a few times that beside other work.
PATIENCE = 300


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


def cell_error(page):
    "The text of a traceback a cell of the page shows, or None."
    shown = page.locator('.jp-OutputArea-output:has-text("Traceback (most recent call last)")')
    return shown.first.inner_text()[-2000:] if shown.count() else None


def wait_for(condition, what, timeout=PATIENCE, page=None):
    "Poll `condition` until it returns something true, and return that; fail after `timeout` s (a hang), or at once"
    " when `page` shows a cell's traceback (nothing would come then)."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value: return value
        if page is not None and (error := cell_error(page)): raise AssertionError(f"a cell failed: {error}")
        time.sleep(0.2)
    raise AssertionError(f"no progress in {timeout} s waiting for {what}")


def server_ready(url, process):
    if process.poll() is not None: raise AssertionError(f"the Jupyter server exited with code {process.returncode}")
    try:
        with urllib.request.urlopen(url, timeout=2) as response: return response.status == 200
    except OSError: return False


@pytest.fixture(params=list(FRONT_ENDS))
def jupyter(request, tmp_path):
    "A Jupyter front end on a free localhost port, serving a copy of the test notebook; always shut down afterwards."
    front_end = FRONT_ENDS[request.param]
    need_chromium()
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
        wait_for(lambda: server_ready(f'http://127.0.0.1:{port}/api/status?token={token}', process), front_end.name)
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


_FRAME_STATUS = re.compile(r'epoch (\d+)/\d+ · batch (\d+)/(\d+) \(train\)')


def frame_step(page, dashboard=0):
    "The training step whose values the `dashboard`-th dashboard's frame shows; None before a frame of a training batch."
    status = page.locator('.tl-dashboard code')
    if status.count() <= dashboard: return None
    match = _FRAME_STATUS.search(status.nth(dashboard).inner_text())
    if match is None: return None
    epoch, batch, batches = map(int, match.groups())
    return (epoch - 1) * batches + batch


def probe(page, name):
    "What the test notebook's probe line says about `name` (None until it says it)."
    fact = page.locator(f'.tl-probe-{name}')
    return fact.first.inner_text() if fact.count() else None


def is_running(page, cell):
    return '*' in page.locator('.jp-Cell .jp-InputPrompt').nth(cell).inner_text()


def kernel_ready(page, front_end):
    "True once the notebook's kernel is connected and idle; JupyterLab may ask \"Select Kernel\" first."
    accept = page.locator('.jp-Dialog .jp-mod-accept')
    if accept.count(): accept.first.click()
    return page.locator(front_end.kernel_ready).count() > 0


def open_notebook(page, url, front_end):
    page.goto(url, timeout=PATIENCE * 1000)
    page.wait_for_selector('.jp-Notebook .jp-Cell', timeout=PATIENCE * 1000)
    wait_for(lambda: kernel_ready(page, front_end), 'the kernel to be idle')
    # JupyterLab's question about news would cover part of the screenshots
    page.add_style_tag(content='.Toastify { display: none !important; }')


def run_cell(page, cell, attempts=3):
    "Run a cell; a run sent while the kernel connection is still settling can be dropped, so retry."
    prompt = page.locator('.jp-Cell .jp-InputPrompt').nth(cell)
    started = lambda: any(c == '*' or c.isdigit() for c in prompt.inner_text())
    for attempt in range(1, attempts + 1):
        page.locator('.jp-Cell .jp-InputArea-editor').nth(cell).click()
        page.keyboard.press('Control+Enter')
        # The page marks the cell itself when it sends the run: a minute without the mark is a dropped run.
        try: return wait_for(started, f'cell {cell} to start', timeout=60) and attempt
        except AssertionError: pass
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


@pytest.mark.parametrize('jupyter', ['lab'], indirect=True)
def test_dashboard_in_browser(jupyter):
    timings, start = {}, time.monotonic()  # reported, never compared with a limit
    prefix = jupyter['front_end'].artifact_prefix
    dashboard = lambda: page.locator('.tl-dashboard').first
    with browser_page(jupyter, prefix) as page:
        open_notebook(page, jupyter['url'], jupyter['front_end'])
        timings['notebook open'] = time.monotonic() - start
        timings['run attempts'] = run_cell(page, 0)

        # (a) frames are drawn during the fit
        first = wait_for(lambda: frame_count(page), 'the first frame', page=page)
        timings['first frame'] = time.monotonic() - start
        wait_for(lambda: frame_count(page) >= first + 2, 'two more frames')
        dashboard().screenshot(path=str(ARTIFACTS / f'{prefix}.png'))

        # (b) the lr slider steers the running fit: the kernel reports the step it took the new value at, and the
        # page goes on to show frames of later steps
        before = page.locator('.tl-lr-slider .widget-readout').inner_text()
        drag_slider_left(page, '.tl-lr-slider', 40)
        readout = wait_for(lambda: (t := page.locator('.tl-lr-slider .widget-readout').inner_text()) != before and t,
                           'the slider readout to change')
        changed_at = int(wait_for(lambda: probe(page, 'lr_changed_at'), 'the fit to take the new lr'))
        wait_for(lambda: (frame_step(page) or 0) >= changed_at + 20, 'a frame 20 steps after the new lr')
        dashboard().screenshot(path=str(ARTIFACTS / f'{prefix}_after_slider.png'))

        # Pause holds the fit (the kernel says so) until Resume; then frames of later steps follow
        page.locator('.tl-dashboard button', has_text='Pause').click()
        held_at = int(wait_for(lambda: probe(page, 'held') == 'yes' and probe(page, 'held_at'), 'the pause to hold'))
        page.locator('.tl-dashboard button', has_text='Resume').click()
        wait_for(lambda: probe(page, 'held') == 'no', 'the fit to go on after Resume')
        wait_for(lambda: (frame_step(page) or 0) > held_at, 'a frame of a step after the pause')

        # (c) Stop ends the fit, and the learner keeps its history
        page.locator('.tl-dashboard button', has_text='Stop').click()
        wait_for(jupyter['result'].exists, 'the fit to end after Stop')
        timings['stopped'] = time.monotonic() - start

        # a blocking fit (the cell runs all along) still shows live frames; it ends when the test has seen them
        run_cell(page, 1)
        blocking_first = wait_for(lambda: is_running(page, 1) and frame_count(page, 1), 'a blocking-fit frame')
        wait_for(lambda: frame_count(page, 1) > blocking_first, 'the next frame of the blocking fit')
        frames_seen_while_running = is_running(page, 1)
        Path(f"{jupyter['result']}.seen").touch()
        done = wait_for(lambda: re.search(r'blocking fit done: (\d+) frames, (\d+) steps',
                                          page.locator('.jp-Cell').nth(1).inner_text()), 'the blocking fit to end')
        timings['blocking fit done'] = time.monotonic() - start

    result = json.loads(jupyter['result'].read_text())
    assert frames_seen_while_running, "the blocking fit's frames must update while its cell runs"
    assert int(done[1]) > blocking_first and 0 < int(done[2]) < result['n_batches']  # ended by the test, not its length
    print(jupyter['front_end'].name, 'timings (s):', {k: round(v, 1) for k, v in timings.items()},
          'frames:', result['frames'], 'lr:', readout, 'steps:', result['train_iter'])
    assert os.path.realpath(result['prefix']) == os.path.realpath(sys.prefix), "the kernel must run the project's venv"
    assert result['error'] is None and result['frames'] > first
    lr_changes = [(step, value) for step, name, value in result['changes'] if name == 'lr']
    assert len(lr_changes) == 1 and lr_changes[0][0] == changed_at, result['changes']
    step, new_lr = lr_changes[0]
    assert new_lr < 3e-3 and abs(new_lr - float(readout)) <= 0.01 * new_lr
    lrs = result['lrs']
    assert set(lrs[:step]) == {3e-3} and set(lrs[step:]) == {new_lr} and step + 20 <= len(lrs)
    assert result['n_losses'] == result['train_iter'] == len(lrs) < result['n_batches']
    # one pause, at the step the page showed, during which the fit took no step and the dashboard no tick
    (step_held, ticks_held, step_released, ticks_released), = result['pauses']
    assert step_held == step_released == held_at >= changed_at + 20 and ticks_held == ticks_released
    assert len(result['values']) >= 1 and all(len(row) == 5 for row in result['values'])
    assert result['panels'] == ['sharpness', 'layers'] and result['n_sharpness'] >= 1  # the third row was drawn
