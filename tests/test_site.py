"""The course site: every notebook run top to bottom in a Jupyter kernel, then the site built and read in a browser.

`test_notebook_runs_top_to_bottom` is the notebook test: one test per notebook, each executed in a fresh kernel
exactly as `make docs` executes it (cells flagged `notest`, `cuda` or `browser` are not run, as `nbdev-test` skips
them), and kept in the site's cache. A cell that raises fails the test with its traceback. A notebook that the cache
holds with the same code, library and installed packages is not run again. The notebooks run in parallel with the
other tests (pytest-xdist), and `make docs` then only renders them.

`test_site` builds the site through `make docs`, the command that publishes it, so `_site/` is never missing or stale,
then headless Chromium reads `_site/` from a local http.server, with no network. It runs after the notebooks (`make
test` runs it in its second step; a plain `pytest` orders it last); a notebook not executed yet is executed by the
build. It is skipped when Chromium, playwright or make is missing.

Checks: the sidebar links reach every notebook page; every course page loads without console errors, failed requests
or requests leaving the machine; each page shows at least as many images as its executed notebook has cells with a PNG
output, and every image has loaded; saved widgets render and formulas are typeset; the API page has an entry for every
exported name, and its links to the notebooks land on existing anchors; Sphinx's search finds `average_grad`. Writes a
screenshot of the optimizer page to artifacts/site-optimizer.png and the counts to artifacts/site-report.txt.
"""
import functools
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urljoin

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'docs'))
import prepare  # noqa: E402  (docs/prepare.py: the site's sources and how its notebooks are executed)

SITE = ROOT / '_site'
BUILD = prepare.BUILD
ARTIFACTS = ROOT / 'artifacts'
CHROMIUM = shutil.which('chromium') or '/usr/bin/chromium'
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                 '--disable-sync', '--no-first-run', '--disable-quic']
WIDGET_VIEW = 'script[type="application/vnd.jupyter.widget-view+json"]'
# How long the browser may take for one step (a page, its widgets, its formulas) before the test calls it a hang: a
# safety net, not a measure of speed; the waits are for the page's state.
PATIENCE_MS = 300_000


def notebook_pages():
    return prepare.notebook_stems()


def png_cells(stem):
    "How many code cells of the notebook, as the site executed it (its jupyter-cache entry), have a PNG output."
    import nbformat
    from jupyter_cache import get_cache
    source = nbformat.read(BUILD / 'src' / f'{stem}.ipynb', as_version=4)
    try: _, executed = get_cache(prepare.CACHE).merge_match_into_notebook(source)
    except KeyError: raise AssertionError(f"{stem}: the site's cache has no executed copy of the notebook") from None
    return sum(any('image/png' in out.get('data', {}) for out in cell.get('outputs', []))
               for cell in executed.cells if cell.cell_type == 'code')


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope='session')
def site_sources():
    "docs/_build/src written, once per test process (the second one finds nothing to change)."
    prepare.write_sources()


@pytest.mark.notebook
@pytest.mark.timeout(3600)  # a safety net: nbclient stops a cell after the site's limit (docs/conf.py)
@pytest.mark.parametrize('stem', prepare.notebook_stems())
def test_notebook_runs_top_to_bottom(site_sources, stem):
    try: seconds = prepare.run_notebook(stem)
    except prepare.NotebookFailed as failed: pytest.fail(str(failed), pytrace=False)
    print(f"{stem}: " + ("in the site's cache with this code and library" if seconds is None else f"ran in {seconds:.1f} s"))


@pytest.fixture(scope='module')
def site():
    "`make docs`, then `_site/` served on a free localhost port; the server stops afterwards."
    if not os.path.exists(CHROMIUM): pytest.skip("chromium is not installed (`make browser-deps` installs it as root)")
    pytest.importorskip('playwright.sync_api', reason="the playwright package is not installed")
    if not shutil.which('make'): pytest.skip("make is not installed")
    fetched = all((BUILD / 'static' / name / '.spec').exists() for name in ('widgets', 'mathjax'))
    if not fetched and not shutil.which('npm'): pytest.skip("npm is not installed: `make docs` needs it once")
    # The readers' kernels, not the numeric tests' baseline ones; OMP_NUM_THREADS=1 as for every test process.
    env = {k: v for k, v in os.environ.items() if k != 'ATEN_CPU_CAPABILITY'} | {'OMP_NUM_THREADS': '1'}
    with prepare.every_notebook_locked():  # a notebook test running now finishes first; those after find it cached
        build = subprocess.run(['make', '-C', str(ROOT), 'docs'], capture_output=True, text=True, env=env)
    assert build.returncode == 0, f"make docs failed:\n{build.stdout[-5000:]}\n{build.stderr[-5000:]}"
    server = ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(QuietHandler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try: yield f'http://127.0.0.1:{server.server_address[1]}/'
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope='module')
def browser_page(site):
    "A Chromium page that records console errors, failed requests and any request that would leave the machine."
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={'width': 1300, 'height': 1000})
        problems = []
        def outside(route):
            problems.append(f"request leaving the machine: {route.request.url}")
            route.abort()
        context.route(lambda url: not url.startswith(site), outside)
        page = context.new_page()
        page.on('console', lambda msg: msg.type == 'error' and problems.append(f"console: {msg.text}"))
        page.on('pageerror', lambda error: problems.append(f"page error: {error}"))
        page.on('requestfailed', lambda request: problems.append(f"failed: {request.url} {request.failure}"))
        page.on('response', lambda response: response.status >= 400
                and problems.append(f"HTTP {response.status}: {response.url}"))
        try: yield page, problems
        finally: browser.close()


def open_page(page, url):
    page.goto(url, wait_until='load', timeout=PATIENCE_MS)
    page.wait_for_load_state('networkidle', timeout=PATIENCE_MS)


def wait_for_widgets(page):
    "The saved widget views, and how many of them have their model in the page's saved state: those must be drawn."
    views, saved = page.evaluate(f"""() => {{
        const state = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
        const models = state ? JSON.parse(state.textContent).state : {{}};
        const views = [...document.querySelectorAll('{WIDGET_VIEW}')];
        return [views.length, views.filter(view => JSON.parse(view.textContent).model_id in models).length];
    }}""")
    if saved: page.wait_for_function(f"""() => [...document.querySelectorAll('{WIDGET_VIEW}')].filter(view =>
        view.previousElementSibling?.matches('.widget-subarea') && view.previousElementSibling.childElementCount
        ).length >= {saved}""", timeout=PATIENCE_MS)
    return views, saved


def image_counts(page):
    "Images in the cells' outputs, and those among them that did not load."
    return page.evaluate("""() => {
        const images = [...document.querySelectorAll('.cell_output img, .output img')];
        return [images.length, images.filter(img => !(img.complete && img.naturalWidth > 0)).map(img => img.src)];
    }""")


def anchors(page):
    return set(page.evaluate("() => [...document.querySelectorAll('[id]')].map(e => e.id)"))


def page_name(url):
    return urldefrag(url)[0].rsplit('/', 1)[-1]


def exported_names():
    "`module.name` of everything `teachloop.all` exports, and of the historical designs."
    import teachloop.all
    import teachloop.designs
    designs = [importlib.import_module(f'teachloop.designs.{m.name}')
               for m in pkgutil.iter_modules(teachloop.designs.__path__)]
    return {f'{module.__name__}.{name}' for module in (*teachloop.all.MODULES, *designs) for name in module.__all__}


def check_course_page(page, problems, url, stem):
    "A report line and the faults found on one notebook's page."
    problems.clear()
    open_page(page, url)
    views, saved = wait_for_widgets(page)
    if page.locator('.math').count(): page.wait_for_selector('mjx-container', timeout=PATIENCE_MS)
    images, broken = image_counts(page)
    expected = png_cells(stem)
    faults = [f"{stem}: {problem}" for problem in problems]
    if broken: faults.append(f"{stem}: images that did not load: {broken}")
    if images < expected: faults.append(f"{stem}: {images} images on the page, {expected} cells with a PNG output")
    line = f"{stem:28} images {images:3}  cells with a PNG output {expected:3}  widget views {views} (drawn {saved})"
    return line, faults


def check_api_page(page, problems, url, ids_by_page):
    "A report line and the faults found on the API page: missing names, links to anchors that do not exist."
    problems.clear()
    open_page(page, url)
    faults = [f"api: {problem}" for problem in problems]
    names = exported_names()
    undocumented = sorted(names - anchors(page))
    if undocumented: faults.append(f"exported names without an API entry: {undocumented[:20]}")
    links = [urldefrag(href) for href in page.eval_on_selector_all('dd a.reference.internal', 'as => as.map(a => a.href)')]
    explained = [(page_name(url), anchor) for url, anchor in links if page_name(url) in ids_by_page]
    dangling = [f'{name}#{anchor}' for name, anchor in explained if anchor and anchor not in ids_by_page[name]]
    if dangling: faults.append(f"API links to anchors the notebook pages lack: {dangling[:10]}")
    return f"api: {len(names)} names, {len(explained)} links to notebook pages", faults


def check_search(page, problems, url):
    problems.clear()
    open_page(page, url)
    page.wait_for_selector('#search-results li', timeout=PATIENCE_MS)
    found = {page_name(href) for href in page.eval_on_selector_all('#search-results li a', 'as => as.map(a => a.href)')}
    faults = [f"search: {problem}" for problem in problems]
    if not {'api.html', '01_optimizer.html'} <= found: faults.append(f"search for average_grad found only {found}")
    return f"search for average_grad: results on {sorted(found)}", faults


@pytest.mark.site
@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_site(site, browser_page):
    page, problems = browser_page
    stems = notebook_pages()
    open_page(page, site + 'index.html')
    sidebar = page.eval_on_selector_all('.bd-sidebar-primary a.reference.internal', 'as => as.map(a => a.href)')
    linked = {page_name(href) for href in sidebar}
    unlinked = [stem for stem in stems if stem != 'index' and f'{stem}.html' not in linked]
    assert not unlinked and 'api.html' in linked, f"pages the sidebar does not link to: {unlinked}"

    report, faults, ids_by_page = [], [], {}
    for stem in stems:
        line, page_faults = check_course_page(page, problems, urljoin(site, f'{stem}.html'), stem)
        report.append(line)
        faults += page_faults
        ids_by_page[f'{stem}.html'] = anchors(page)
        if stem == '01_optimizer':
            ARTIFACTS.mkdir(exist_ok=True)
            figure = page.locator('.cell_output img').first
            if figure.count(): figure.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / 'site-optimizer.png'))
    for line, more in (check_api_page(page, problems, site + 'api.html', ids_by_page),
                       check_search(page, problems, site + 'search.html?q=average_grad')):
        report.append(line)
        faults += more

    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / 'site-report.txt').write_text('\n'.join(report + faults) + '\n')
    print('\n'.join(report))
    assert not faults, '\n'.join(faults)
