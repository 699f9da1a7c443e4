"""The course site: every notebook run top to bottom in a Jupyter kernel, then the site built and read in a browser.

`test_notebook_runs_top_to_bottom` is the notebook test: one test per notebook, each executed in a fresh kernel
exactly as `make docs` executes it and as a student's Run All does, every cell run (a cell that needs a GPU or a browser
checks for it itself; `test_no_cell_is_skipped_by_the_test_command` keeps it so), and kept in the site's cache. A cell that raises fails the test with its traceback. A notebook that the cache
holds with the same code, library and installed packages is not run again. The notebooks run in parallel with the
other tests (pytest-xdist), and `make docs` then only renders them.

`test_site` builds the site through `make docs`, the command that publishes it, so `_site/` is never missing or stale,
then headless Chromium reads `_site/` from a local http.server, with no network. It starts once every notebook test
has been handed out (tests/conftest.py orders it so); a notebook not executed yet is executed by the build. It is skipped when Chromium, playwright or make is missing.

Checks: the sidebar links reach every notebook page, the appendices under their own heading; the home page links
every lesson and the developers' page; every course page loads without console errors, failed requests or requests
leaving the machine; each page shows at least as many images as its executed notebook has cells with a PNG output, and
every image has loaded; saved widgets render and formulas are typeset; no output is a blank gap (the progress bars a
fit closed are left out, with the widget state only they used) and no line of code runs out of its column; the API
page has an entry for every exported name, its links to the notebooks land on existing anchors, and the notebooks'
links to it (from prose and code) land on its entries; Sphinx's search gives an exact API name's entry first, then the
notebook that explains it; an exercise's solution stays closed until its toggle is clicked. Each page's time to be
ready (loaded, its formulas typeset as they come into view, its widgets drawn) and its weight are printed, not
asserted: the machine may be busy. Writes a screenshot of the optimizer page to artifacts/site-optimizer.png and the
counts to artifacts/site-report.txt.

The tests without a browser check the pieces: the directives' tags, the prose's and the code's links to the API, the
home page's links, the widgets left out, the wrapped lines of code.
"""
import functools
import importlib
import os
import pkgutil
import re
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
import conf  # noqa: E402  (docs/conf.py: what the site adds to myst-nb's pages)
from chromium import need_chromium, watched_page  # noqa: E402

SITE = ROOT / '_site'
BUILD = prepare.BUILD
ARTIFACTS = ROOT / 'artifacts'
WIDGET_VIEW = 'script[type="application/vnd.jupyter.widget-view+json"]'
# How long the browser may take for one step (a page, its widgets, its formulas) before the test calls it a hang: a
# safety net, not a measure of speed; the waits are for the page's state.
PATIENCE_MS = 300_000
# The browser tests share one build of the site: one test worker runs them all.
SITE_TEST = [pytest.mark.site, pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(3600),
             pytest.mark.xdist_group('site')]


def site_test(test):
    for mark in reversed(SITE_TEST): test = mark(test)
    return test


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


def test_the_sources_are_written_again_only_when_what_they_come_from_changed(tmp_path, monkeypatch):
    "The second test process, and `make docs` after the tests, find them written from the same files and skip the work."
    (tmp_path / 'nbs').mkdir()
    notebook = tmp_path / 'nbs' / 'a.ipynb'
    notebook.write_text('{}')
    writes = []
    for name, value in {'NBS': tmp_path / 'nbs', 'SRC': tmp_path / 'src', '_write_sources': lambda: writes.append(1),
                        'library_version': lambda: 'same library', 'prepare_cache': lambda n: None}.items():
        monkeypatch.setattr(prepare, name, value)
    for name in ('API_NAMES', 'SEARCH_SCORER'):  # what the writing leaves outside the sources' folder
        monkeypatch.setattr(prepare.conf, name, tmp_path / name)
        (tmp_path / name).write_text('written')
    (tmp_path / 'src').mkdir()
    prepare.write_sources()
    prepare.write_sources()
    assert len(writes) == 1
    notebook.write_text('{"cells": []}')
    prepare.write_sources()
    assert len(writes) == 2
    monkeypatch.setattr(prepare, 'library_version', lambda: 'another library')
    prepare.write_sources()
    assert len(writes) == 3
    (tmp_path / 'API_NAMES').unlink()  # an output gone: written again
    prepare.write_sources()
    assert len(writes) == 4


@pytest.mark.notebook
@pytest.mark.timeout(3600)  # a safety net: nbclient stops a cell after the site's limit (docs/conf.py)
@pytest.mark.parametrize('stem', prepare.notebook_stems())
def test_notebook_runs_top_to_bottom(site_sources, stem):
    try: seconds = prepare.run_notebook(stem)
    except prepare.NotebookFailed as failed: pytest.fail(str(failed), pytrace=False)
    print(f"{stem}: " + ("in the site's cache with this code and library" if seconds is None else f"ran in {seconds:.1f} s"))


def test_a_solution_cell_runs_hidden_behind_a_toggle():
    cell = prepare.nbformat.v4.new_code_cell('#| solution\n# Exercise 1: the window\nassert 1 / (1 - 0.9) > 9.99')
    prepare.process_cell(cell)
    assert cell.source == '# Exercise 1: the window\nassert 1 / (1 - 0.9) > 9.99'
    assert cell.metadata['tags'] == ['hide-cell'] and cell.metadata['mystnb'] == prepare.SOLUTION_PROMPTS
    assert 'skip-execution' not in prepare.tags_for({'solution': ''})  # it runs, on the site and in the tests


def test_no_cell_is_skipped_by_the_test_command():
    """A student's Run All runs every cell, so the notebook test and the site do: a cell that needs hardware checks for
    it itself and says that it skipped, and no notebook keeps nbdev's skip flags."""
    flagged = {stem: cells for stem in prepare.notebook_stems()
               if (cells := prepare.skipped_cells(prepare.nbformat.read(prepare.NBS / f'{stem}.ipynb', as_version=4)))}
    assert not flagged, (f"cells the notebook test would skip, where a student runs them: {flagged}. Drop the flag and "
                         "let the cell check for what it needs (`if not torch.cuda.is_available(): print('no GPU here: "
                         "... skipped')`)")


def test_a_flagged_cell_is_seen_and_runs_on_the_site():
    flagged = prepare.nbformat.v4.new_code_cell('#| cuda\nassert torch.cuda.is_available()')
    cell = prepare.nbformat.from_dict(dict(flagged))
    prepare.process_cell(cell)
    assert 'skip-execution' not in cell.metadata.get('tags', [])
    nb = prepare.nbformat.v4.new_notebook(cells=[flagged, prepare.nbformat.v4.new_code_cell('#| eval: false\n1')])
    nb.cells[0].id, nb.cells[1].id = 'a', 'b'
    assert prepare.skipped_cells(nb) == [('a', 'cuda'), ('b', 'eval: false')]


def test_the_sidebar_lists_the_appendices_apart_from_the_course(site_sources):
    contents = prepare.nbformat.read(prepare.SRC / 'index.ipynb', as_version=4).cells[-1].source
    course, appendix, reference = re.findall(r'```\{toctree\}\n(.*?)```', contents, re.DOTALL)
    appendices = [stem for stem in prepare.notebook_stems() if stem.startswith('A')]
    assert ':caption: Appendix' in appendix and appendices and all(stem in appendix.split() for stem in appendices)
    assert not set(appendices) & set(course.split()) and '01_optimizer' in course.split()
    assert reference.split()[-2:] == ['api', 'developers']


NAMES = {'lr_find': ('teachloop.callback.schedule', 'teachloop.callback.schedule.Learner.lr_find'),
         'Learner.lr_find': ('teachloop.callback.schedule', 'teachloop.callback.schedule.Learner.lr_find'),
         'Adam': ('teachloop.optim.core', 'teachloop.optim.core.Adam')}


def test_names_of_the_api_in_prose_link_to_their_entries():
    link = lambda text: prepare.link_api_names(text, NAMES)
    lr_find = 'teachloop.callback.schedule.Learner.lr_find'
    assert link('Pick it with `lr_find`.') == f'Pick it with {{py:obj}}`lr_find <{lr_find}>`.'
    assert link('`learn.lr_find()` and `Adam`') == (f'{{py:obj}}`learn.lr_find() <{lr_find}>`'
                                                    ' and {py:obj}`Adam <teachloop.optim.core.Adam>`')
    kept = ['## Heading with `Adam`', '```python\n`Adam`\n```', '[see `Adam`](#adam)', '$`Adam`$', '``Adam``',
            '`torch.optim.Adam`', '`Adam(lr=1e-3)`', '`adam`', '`self.Adam`',
            '<details><summary>`Adam`</summary>\n`Adam`']
    for text in kept: assert link(text) == text, text
    answer = '<details><summary>Answer</summary>\n\nWith `Adam`.\n\n</details>'  # markdown between blank lines
    assert link(answer) == answer.replace('`Adam`', '{py:obj}`Adam <teachloop.optim.core.Adam>`')


def test_names_of_the_api_in_code_link_to_their_entries():
    from pygments import highlight
    from pygments.lexers import PythonLexer
    code = 'learn = Learner(dls, model)\nlearn.lr_find()\nopt = torch.optim.Adam(ps)\nopt = Adam(ps)\n'
    names = {**NAMES, 'Learner': ('teachloop.learner', 'teachloop.learner.Learner')}
    html = conf.link_code_names(highlight(code, PythonLexer(), conf.SoftWrappedLines()), names, 'api.html')
    links = re.findall(r'<a class="api-link" href="api.html#([\w.]+)"><span class="n">(\w+)</span></a>', html)
    assert links == [('teachloop.learner.Learner', 'Learner'),
                     ('teachloop.callback.schedule.Learner.lr_find', 'lr_find'),
                     ('teachloop.optim.core.Adam', 'Adam')]  # torch's Adam is not teachloop's


def test_a_long_line_of_code_wraps_under_itself():
    from pygments import highlight
    from pygments.lexers import PythonLexer
    html = highlight('def f(x):\n\n    return x  # a comment\n', PythonLexer(), conf.SoftWrappedLines())
    lines = re.findall(r'<span class="line"( style="--indent:(\d+)")?>', html)
    assert [indent for _, indent in lines] == ['', '', '4']  # the CSS wraps each under its own indentation
    code = re.search(r'<pre>(.*)</pre>', html, re.DOTALL)[1]
    assert re.sub(r'<[^>]+>', '', code) == 'def f(x):\n\n    return x  # a comment\n'  # copied code is the code


def test_closed_progress_bars_and_the_widgets_they_alone_use_are_left_out():
    layout = lambda **state: {'model_name': 'LayoutModel', 'state': state}
    box = lambda layout_id, *children: {'model_name': 'HBoxModel', 'state': {
        'layout': f'IPY_MODEL_{layout_id}', 'children': [f'IPY_MODEL_{child}' for child in children]}}
    model = lambda name: {'model_name': name, 'state': {}}
    state = {'a1': box('a2', 'a3'), 'a2': layout(visibility='hidden'), 'a3': model('FloatProgressModel'),
             'b1': box('b2', 'b3'), 'b2': layout(), 'b3': model('ImageModel')}
    assert not conf.shown('a1', state) and conf.shown('b1', state) and not conf.shown('c1', state)
    assert conf.models_used(['b1'], state) == {'b1', 'b2', 'b3'}


def test_the_home_page_links_every_lesson_as_the_readme_and_the_site_read_it():
    readme = (ROOT / 'README.md').read_text()
    links = re.findall(r'\]\(((?:nbs|docs)/[^)#\s]+)', readme)
    assert not [link for link in links if not (ROOT / link).exists()], "README.md links to files that do not exist"
    lessons = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / 'nbs').glob('[0-9A-Z]*.ipynb'))
    assert sorted(set(links) - {'docs/developers.md'}) == lessons and 'docs/developers.md' in links
    assert prepare.site_links('[Data](nbs/00_data.ipynb), [the developers](docs/developers.md)') == \
        '[Data](00_data.ipynb), [the developers](developers.md)'
    assert 'make test' in readme and 'make demo' in readme  # .ci/run runs the README's test command


@pytest.fixture(scope='module')
def site():
    "`make docs`, then `_site/` served on a free localhost port; the server stops afterwards."
    need_chromium()
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
    with watched_page(site) as found: yield found


def open_page(page, url):
    page.goto(url, wait_until='load', timeout=PATIENCE_MS)
    page.wait_for_load_state('networkidle', timeout=PATIENCE_MS)


# Resolves when the page is ready to read: loaded, MathJax started (it typesets each formula as it comes into view),
# and every widget view whose model the page saved drawn; returns the milliseconds since the navigation started.
READY = """async () => {
    const frame = () => new Promise(resolve => requestAnimationFrame(resolve));
    while (document.readyState !== 'complete') await frame();
    if (document.querySelector('.math')) {
        while (!window.MathJax?.startup?.promise) await frame();
        await window.MathJax.startup.promise;
    }
    const state = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
    const models = state ? JSON.parse(state.textContent).state : {};
    const views = [...document.querySelectorAll('%s')].filter(view => JSON.parse(view.textContent).model_id in models);
    while (!views.every(view => view.previousElementSibling?.matches('.widget-subarea')
                                && view.previousElementSibling.childElementCount)) await frame();
    return performance.now();
}""" % WIDGET_VIEW


# The first formula a reader sees (not one in a closed answer), brought into view: typeset as it comes into view.
TYPESET = """() => {
    const shown = [...document.querySelectorAll('.bd-article .math')]
        .find(math => !math.closest('details:not([open])'));
    if (!shown) return true;
    shown.scrollIntoView();
    return shown.querySelector('mjx-math') !== null;
}"""


def open_course_page(page, url):
    """Open a page and return the milliseconds it took to be ready (printed, not asserted: the machine may be busy).
    Ready is what READY waits for: the page and its images loaded, MathJax started, every saved widget drawn."""
    page.goto(url, wait_until='commit', timeout=PATIENCE_MS)
    return page.evaluate(READY)


def page_weight(page):
    """Bytes of the page's HTML and of its images; the saved widget models that no view on the page draws, and the
    views of hidden models (a closed progress bar): both are weight without anything to see."""
    return page.evaluate(f"""() => {{
        const resources = performance.getEntriesByType('resource');
        const images = resources.filter(r => r.initiatorType === 'img').reduce((sum, r) => sum + r.decodedBodySize, 0);
        const state = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
        const models = state ? JSON.parse(state.textContent).state : {{}};
        const views = [...document.querySelectorAll('{WIDGET_VIEW}')]
            .map(view => JSON.parse(view.textContent).model_id);
        const used = new Set(), todo = [...views];
        while (todo.length) {{
            const id = todo.pop();
            if (used.has(id) || !(id in models)) continue;
            used.add(id);
            for (const m of JSON.stringify(models[id]).matchAll(/IPY_MODEL_([0-9a-f]+)|"model_id": ?"([0-9a-f]+)"/g))
                todo.push(m[1] || m[2]);
        }}
        const layout = id => models[models[id]?.state?.layout?.replace('IPY_MODEL_', '')]?.state || {{}};
        return {{html: performance.getEntriesByType('navigation')[0].decodedBodySize, images,
                 unused_models: Object.keys(models).filter(id => !used.has(id)).length,
                 hidden_views: views.filter(id => layout(id).visibility === 'hidden').length}};
    }}""")


def layout_faults(page):
    """Outputs that show nothing but take room (a blank gap), and lines of code that run out of their column; every cell
    laid out first (the site lays out a cell only when it comes near the view: `content-visibility` in site.css)."""
    return page.evaluate("""() => {
        const all = document.head.appendChild(document.createElement('style'));
        all.textContent = '.bd-article .cell { content-visibility: visible !important; }';
        // an output, or a part of one (a closed progress bar took 32 px, eight of them after a fit's table)
        const media = 'img, svg, canvas, video, iframe, input, mjx-container';
        const blank = [...document.querySelectorAll('.cell_output, .cell_output > *')].filter(output =>
            !output.closest('details:not([open])') && !output.innerText.trim()
            && !output.matches(media) && !output.querySelector(media)
            && output.getBoundingClientRect().height > 16).length;
        const cut = [...document.querySelectorAll('.bd-article div.highlight pre')].filter(pre =>
            pre.scrollWidth > pre.clientWidth + 1).length;
        all.remove();
        return {blank, cut};
    }""")


def api_links(page):
    "The page's links to the API page's entries, from its prose and from its code."
    return page.evaluate("""() => {
        const entry = a => a.pathname.endsWith('/api.html') && a.hash;
        const anchors = selector => [...document.querySelectorAll(selector)].filter(entry).map(a => a.hash.slice(1));
        return {prose: anchors('.bd-article a.reference.internal'), code: anchors('.bd-article a.api-link')};
    }""")


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
    late = [f"{stem}: after the page before it was read: {problem}" for problem in problems]  # reported, not lost
    problems.clear()
    ready_ms = open_course_page(page, url)
    views, saved = wait_for_widgets(page)
    if page.locator('.math').count():
        page.wait_for_function(TYPESET, timeout=PATIENCE_MS)
        page.evaluate('() => document.fonts.ready.then(() => true)')  # its fonts, before the next page
    images, broken = image_counts(page)
    expected = png_cells(stem)
    weight, layout = page_weight(page), layout_faults(page)
    faults = late + [f"{stem}: {problem}" for problem in problems]
    if broken: faults.append(f"{stem}: images that did not load: {broken}")
    if images < expected: faults.append(f"{stem}: {images} images on the page, {expected} cells with a PNG output")
    if weight['hidden_views'] or weight['unused_models']:
        faults.append(f"{stem}: {weight['hidden_views']} hidden widget views (closed progress bars) and "
                      f"{weight['unused_models']} saved widget models that no view draws")
    if layout['blank']: faults.append(f"{stem}: {layout['blank']} outputs that show nothing but take room")
    if layout['cut']: faults.append(f"{stem}: {layout['cut']} code blocks whose lines run out of the column")
    line = (f"{stem:28} images {images:3}  cells with a PNG output {expected:3}  widget views {views} (drawn {saved})  "
            f"ready in {ready_ms:5.0f} ms  html {weight['html'] / 1024:5.0f} KB  "
            f"images {weight['images'] / 1024:5.0f} KB")
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


# An exact name of the API, its entry on the API page, and the notebook that explains it.
SEARCHES = {'average_grad': ('teachloop.optim.core.average_grad', '01_optimizer.html'),
            'lr_find': ('teachloop.callback.schedule.Learner.lr_find', '06_schedule.html'),
            'fit_one_cycle': ('teachloop.callback.schedule.Learner.fit_one_cycle', '06_schedule.html')}


def check_search(page, problems, site, query):
    "The search for an exact API name: its entry first, then the notebook that explains it before any other page."
    problems.clear()
    open_page(page, f'{site}search.html?q={query}')
    entry, explained = SEARCHES[query]
    # the results are shown one by one: wait for the summary that ends the list
    page.wait_for_selector('#search-results p.search-summary:not(:empty)', timeout=PATIENCE_MS)
    results = page.eval_on_selector_all('#search-results li > a', 'as => as.map(a => a.href)')
    pages = [page_name(href) for href in results if not urldefrag(href)[1]]
    faults = [f"search: {problem}" for problem in problems]
    if not results or urldefrag(results[0])[1] != entry:
        faults.append(f"search for {query}: the first result is {results[:1]}, not its entry {entry}")
    if not pages or pages[0] != explained:
        faults.append(f"search for {query}: the first page is {pages[:1]}, not {explained}, which explains it")
    return f"search for {query}: {[page_name(r) + ('#' if urldefrag(r)[1] else '') for r in results[:4]]}", faults


@site_test
def test_site(site, browser_page):
    page, problems = browser_page
    stems = notebook_pages()
    open_page(page, site + 'index.html')
    sidebar = page.eval_on_selector_all('.bd-sidebar-primary a.reference.internal', 'as => as.map(a => a.href)')
    linked = {page_name(href) for href in sidebar}
    unlinked = [stem for stem in stems if stem != 'index' and f'{stem}.html' not in linked]
    assert not unlinked and 'api.html' in linked, f"pages the sidebar does not link to: {unlinked}"

    sections = page.eval_on_selector_all('.bd-sidebar-primary p.caption', 'ps => ps.map(p => p.textContent.trim())')
    appendix = page.eval_on_selector_all('.bd-sidebar-primary p.caption:has(+ ul a[href^="A1_"]) ',
                                         'ps => ps.map(p => p.textContent.trim())')
    assert appendix and appendix[0].startswith('Appendix'), f"the appendices are not under their heading: {sections}"
    article = {page_name(href) for href in page.eval_on_selector_all('.bd-article a.reference.internal',
                                                                         'as => as.map(a => a.href)')}
    missing = [stem for stem in stems if stem != 'index' and f'{stem}.html' not in article]
    assert not missing and 'developers.html' in article, f"the home page does not link to {missing}"

    report, faults, ids_by_page, links_to_api = [], [], {}, {}
    for stem in stems:
        line, page_faults = check_course_page(page, problems, urljoin(site, f'{stem}.html'), stem)
        report.append(line)
        faults += page_faults
        ids_by_page[f'{stem}.html'] = anchors(page)
        links_to_api[stem] = api_links(page)
        if stem == '01_optimizer':
            ARTIFACTS.mkdir(exist_ok=True)
            figure = page.locator('.cell_output img').first
            if figure.count(): figure.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / 'site-optimizer.png'))
    for line, more in (check_api_page(page, problems, site + 'api.html', ids_by_page),
                       *(check_search(page, problems, site, query) for query in SEARCHES)):
        report.append(line)
        faults += more
    open_page(page, site + 'api.html')
    entries = anchors(page)
    for stem, links in links_to_api.items():
        dangling = sorted({anchor for anchor in links['prose'] + links['code'] if anchor not in entries})
        if dangling: faults.append(f"{stem}: links to API entries that do not exist: {dangling[:10]}")
    schedule = links_to_api.get('06_schedule', {'prose': [], 'code': []})
    if SEARCHES['lr_find'][0] not in schedule['prose'] or not schedule['code']:
        faults.append(f"06_schedule: its prose does not link `lr_find` to the API ({len(schedule['prose'])} prose "
                      f"links, {len(schedule['code'])} code links)")

    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / 'site-report.txt').write_text('\n'.join(report + faults) + '\n')
    print('\n'.join(report))
    assert not faults, '\n'.join(faults)


@site_test
def test_site_solution_cells_open_only_when_asked(site, browser_page):
    "An exercise's solution (a `#| solution` cell) is on its page, closed: its code shows once its toggle is clicked."
    page, problems = browser_page
    pages = [stem for stem in notebook_pages()
             if any(re.match(r'#\|\s*solution\b', c.source) for c in prepare.nbformat.read(
                 prepare.NBS / f'{stem}.ipynb', as_version=4).cells if c.cell_type == 'code')]
    if not pages: pytest.skip("no notebook has a solution cell yet")
    open_page(page, urljoin(site, f'{pages[0]}.html'))
    solution = page.locator('.cell.tag_hide-cell').first
    code = solution.locator('.cell_input')
    assert solution.count() and not code.is_visible(), f"{pages[0]}: no solution cell, or its code shows unasked"
    solution.locator('summary').click()
    code.wait_for(state='visible', timeout=PATIENCE_MS)
    assert 'Exercise' in code.inner_text() and 'Hide the solution' in solution.locator('summary').inner_text()
