"""Writes the site's sources into docs/_build/src: the course notebooks with nbdev's cell directives turned into
myst-nb cell tags (an exercise's `#| solution` cell hidden behind a toggle) and the names of the API in their prose
linked to its reference, the home page with its table of contents and the developers' page, the API reference page;
the API's names for the site's configuration (links from code, the search's ranking); and fetches the widget manager
and MathJax once (npm), so that the site's pages need no network.

Only files whose content changed are rewritten, so Sphinx re-reads (and jupyter-cache re-runs) only those.

`run_notebook` executes one of those notebooks into the site's cache exactly as `make docs` would: the tests run every
notebook that way (in parallel with the other tests), and the site build then finds them all executed.
"""
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import nbformat
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from jupyter_cache.executors.utils import single_nb_execution

import api
import conf

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
NBS = ROOT / 'nbs'
BUILD = DOCS / '_build'
SRC = BUILD / 'src'
STATIC = BUILD / 'static'
# Pages of the site that are not notebooks, by their path in the repository (the home page links to them so).
PAGES = {'docs/developers.md': 'developers.md'}
CACHE = Path(conf.nb_execution_cache_path)
LOCKS = BUILD / 'locks'
# The html-manager 1.x line renders ipywidgets 8 state; both packages are pinned so the site does not change by itself.
NPM_PACKAGES = {'widgets': ('@jupyter-widgets/html-manager@1.0.15', ['dist/embed.js', 'dist/*.woff', 'dist/*.woff2',
                                                                       'dist/*.ttf', 'dist/*.eot', 'dist/*.svg',
                                                                       'dist/*LICENSE*']),
                'mathjax': ('mathjax@3.2.2', ['es5/tex-chtml.js', 'es5/input/tex/extensions/**/*.js',
                                              'es5/output/chtml/fonts/woff-v2/*', 'es5/ui/*.js', 'es5/a11y/*.js'])}

_DIRECTIVE = re.compile(r'^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$')
# A solution cell's toggle (myst-nb's `hide-cell`: the code runs, its source and output stay closed until opened).
SOLUTION_PROMPTS = {'code_prompt_show': 'Show the solution', 'code_prompt_hide': 'Hide the solution'}
# nbdev's cell flags that would let a test command skip a cell. A student's Run All skips nothing, so neither do the
# tests and the site: a cell that needs hardware (a GPU, a browser) checks for it itself and says that it skipped, and
# tests/test_site.py refuses these flags in every notebook.
SKIP_FLAGS = frozenset({'notest', 'cuda', 'browser'})


def skipped_cells(nb):
    "`(cell id, flag)` for each code cell that a test command could skip (a flag of SKIP_FLAGS, or `#| eval: false`)."
    found = []
    for cell in nb.cells:
        if cell.cell_type != 'code': continue
        directives, _ = split_directives(cell.source)
        found += [(cell.get('id'), flag) for flag in sorted(SKIP_FLAGS & directives.keys())]
        if directives.get('eval') == 'false': found.append((cell.get('id'), 'eval: false'))
    return found


def split_directives(source):
    "nbdev's `#| name value` lines at the top of a cell, and the code after them."
    lines, directives = source.splitlines(), {}
    while lines and (m := _DIRECTIVE.match(lines[0])):
        directives[m.group(1)] = m.group(2)
        lines.pop(0)
    return directives, '\n'.join(lines)


def tags_for(directives):
    "myst-nb's cell tags for nbdev's (and Quarto's) directives."
    tags = []
    if {'hide', 'default_exp'} & directives.keys() or directives.get('include') == 'false': tags.append('remove-cell')
    if directives.get('echo') == 'false': tags.append('remove-input')
    if directives.get('output') == 'false': tags.append('remove-output')
    if 'solution' in directives: tags.append('hide-cell')
    return tags


def process_cell(cell):
    directives, code = split_directives(cell.source)
    cell.source = code
    cell.outputs, cell.execution_count = [], None
    cell.metadata.pop('jupyter', None)  # Jupyter's own display of the cell (a solution closed): the site uses the tags
    tags = list(dict.fromkeys(cell.metadata.get('tags', []) + tags_for(directives)))
    if tags: cell.metadata['tags'] = tags
    if 'hide-cell' in tags: cell.metadata.setdefault('mystnb', {}).update(SOLUTION_PROMPTS)


def target_cell(cell_id, labels):
    "A markdown cell of MyST targets that the API page links to: they mark the code cell after them."
    return nbformat.v4.new_markdown_cell('\n'.join(f'({label})=' for label in labels), id=f'{cell_id}-api')


def library_version():
    "A hash of the package's sources and of the installed packages: jupyter-cache keys a notebook by its own code only."
    digest = hashlib.sha256()
    for path in sorted((ROOT / 'teachloop').rglob('*.py')): digest.update(path.read_bytes())
    digest.update('\n'.join(installed_packages()).encode())
    return digest.hexdigest()[:16]


def installed_packages():
    "`name==version` of each package in the environment's site-packages, the project itself left out."
    # Only site-packages: a process's sys.path may also hold the project's own build metadata (an .egg-info).
    paths = sorted({sysconfig.get_paths()[kind] for kind in ('purelib', 'platlib')})
    found = {d.metadata['Name'].lower(): d.version for d in importlib.metadata.distributions(path=paths)}
    found.pop('teachloop', None)
    return sorted(f'{name}=={version}' for name, version in found.items())


def version_cell(version):
    "A hidden first cell naming the library's version: a change in the package or in what is installed runs it again."
    cell = nbformat.v4.new_code_cell(f'# teachloop sources {version}', id='site-library-version')
    cell.metadata['tags'] = ['remove-cell']
    return cell


# What a markdown cell's text keeps as it is: fenced blocks, headings, HTML blocks (up to the next blank line: their
# text is not markdown), links (a link inside a link does not work), math and double-backtick code; then inline code,
# which may name the API.
_KEPT = (r'^(?:```|~~~).*?^(?:```|~~~)[ \t]*$|^#.*?$|^<.*?(?=\n[ \t]*\n|\Z)|\[[^\]\n]*\]\([^)\n]*\)|\$\$.*?\$\$'
         r'|\$[^$\n]+\$|``[^`\n]+``|<[^>\n]+>')
_MARKDOWN_PARTS = re.compile(rf'(?P<kept>{_KEPT})|`(?P<code>[^`\n]+)`', re.MULTILINE | re.DOTALL)
_CODE_NAME = re.compile(r'(?:(?P<owner>\w+)\.)?(?P<name>\w+)(?:\(\))?')


def api_target(code, names):
    """The API page's object id for inline code that names a public name (`lr_find`, `learn.lr_find()`,
    `Recorder.plot_loss`), or None."""
    if not (m := _CODE_NAME.fullmatch(code)): return None
    owner = 'Learner' if m['owner'] == 'learn' else m['owner']
    name = f"{owner}.{m['name']}" if owner else m['name']
    return names[name][1] if name in names else None


def link_api_names(text, names):
    "Markdown with each inline code that names a public name (`names`: api.api_names) made a link to its API entry."
    def link(m):
        target = m['code'] and api_target(m['code'], names)
        return f"{{py:obj}}`{m['code']} <{target}>`" if target else m[0]
    return _MARKDOWN_PARTS.sub(link, text)


def process(nb, targets, names=None):
    "The site's copy of a notebook: cell tags for nbdev's directives, API targets, and the prose's links to the API."
    cells = []
    for cell in nb.cells:
        if cell.cell_type == 'code':
            process_cell(cell)
            if cell.get('id') in targets: cells.append(target_cell(cell.id, targets[cell.id]))
        elif cell.cell_type == 'markdown' and names: cell.source = link_api_names(cell.source, names)
        cells.append(cell)
    nb.cells = cells
    return nb


def title(nb):
    "The page title: the notebook's first markdown heading."
    for cell in nb.cells:
        if cell.cell_type == 'markdown' and (m := re.search(r'^#\s+(.+)$', cell.source, re.MULTILINE)):
            return m.group(1).strip()
    return None


def is_design(nb):
    return any(re.search(r'^\s*#\|\s*default_exp\s+designs\.', c.source, re.MULTILINE) for c in nb.cells
               if c.cell_type == 'code')


def contents(course, designs):
    "The home page's (hidden) tables of contents: they make the sidebar, in course order."
    toctree = lambda caption, docs: '\n'.join(['```{toctree}', ':hidden:', ':maxdepth: 2', f':caption: {caption}',
                                                '', *docs, '```'])
    return '\n\n'.join([toctree('Course', course), toctree('Appendix: historical designs', designs),
                        toctree('Reference', ['api', Path(PAGES['docs/developers.md']).stem])])


_REPOSITORY_LINK = re.compile(r'\]\((nbs/[\w-]+\.ipynb|docs/[\w-]+\.md)(#[^)\s]*)?\)')


def site_links(text):
    "The home page's links, written from the repository's root as README.md reads them, made links between pages."
    def page(m):
        path, anchor = m[1], m[2] or ''
        return f"]({PAGES.get(path, path.removeprefix('nbs/'))}{anchor})"
    return _REPOSITORY_LINK.sub(page, text)


def home_page(nb, contents_cell):
    "The home page: README.md's notebook with its links made the site's, and the site's tables of contents."
    for cell in nb.cells:
        if cell.cell_type == 'markdown': cell.source = site_links(cell.source)
    nb.cells.append(contents_cell)
    return nb


def write_site_names(names, names_on, where):
    """The API's names for docs/conf.py, which links them in the pages' code, and the search's scorer, which ranks an
    exact name's definition first: its API entry, then the notebook that explains it."""
    stems = [path.stem for path in NBS.glob('*.ipynb')]
    # a name whose code is in an under-the-hood notebook (`05z_...`) is explained by the lesson after it
    pages = {f'{module}.{name}': api.lesson_of(stem, stems) or stem for (module, name), (stem, _) in where.items()}
    # a method of a class is explained with its class
    explained_in = lambda id: pages.get(id) or pages.get(id.rpartition('.')[0])
    write_if_changed(conf.API_NAMES, json.dumps({'names': names, 'names_on': names_on}, indent=1, sort_keys=True))
    ranking = {name: [id, explained_in(id)] for name, (_, id) in names.items()}
    scorer = (DOCS / '_static' / 'search-scorer.js').read_text()
    write_if_changed(conf.SEARCH_SCORER, f'const TEACHLOOP_API = {json.dumps(ranking, sort_keys=True)};\n' + scorer)


def write_if_changed(path, text):
    "Write `text` unless `path` holds it already; a reader never sees a half-written file."
    if path.exists() and path.read_text() == text: return
    partial = path.with_name(f'.{path.name}.{os.getpid()}')
    partial.write_text(text)
    os.replace(partial, path)


@contextmanager
def locked(name):
    "Hold the lock file `docs/_build/locks/<name>`: one process at a time (test workers, a `make docs` beside them)."
    LOCKS.mkdir(parents=True, exist_ok=True)
    with open(LOCKS / name, 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try: yield
        finally: fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_npm(name, spec, patterns):
    "Unpack the files of an npm package that the pages load into docs/_build/static/<name>, once per version."
    folder = STATIC / name
    if (folder / '.spec').exists() and (folder / '.spec').read_text() == spec: return
    if not shutil.which('npm'):
        sys.exit(f"prepare: the site serves {spec} itself, so that its pages need no network, and npm fetches it "
                 "once: install npm (Debian: `apt-get install npm`), then run `make docs` again")
    shutil.rmtree(folder, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(['npm', 'pack', '--silent', spec], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        with tarfile.open(next(Path(tmp).glob('*.tgz'))) as tar: tar.extractall(tmp, filter='data')
        package, staging = Path(tmp) / 'package', Path(tmp) / name
        for pattern in patterns:
            for file in package.glob(pattern):
                (staging / file.relative_to(package)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, staging / file.relative_to(package))
        for notice in ['package.json', *package.glob('LICENSE*')]: shutil.copy(package / notice, staging)
        (staging / '.spec').write_text(spec)
        STATIC.mkdir(parents=True, exist_ok=True)
        shutil.move(staging, folder)


def write_sources():
    "The notebooks, home page and API page in docs/_build/src, and the execution cache ready for parallel readers."
    with locked('sources'):
        # written from these very files already (by another test process, or the tests before `make docs`): done
        stamp, written = sources_stamp(), SRC / '.written-from'
        outputs = [written, conf.API_NAMES, conf.SEARCH_SCORER]
        if not (all(p.exists() for p in outputs) and written.read_text() == stamp):
            _write_sources()
            write_if_changed(written, stamp)
        prepare_cache(len([p for p in SRC.iterdir() if not p.name.startswith('.')]))


def sources_stamp():
    "A hash of what the sources are written from: the notebooks, the library, the pages, this code, installed packages."
    digest = hashlib.sha256(library_version().encode())
    inputs = [*NBS.glob('*.ipynb'), *DOCS.glob('*.py'), *(DOCS / '_static').rglob('*'), *(ROOT / p for p in PAGES)]
    for path in sorted(p for p in inputs if p.is_file()):
        digest.update(path.name.encode() + b'\0' + path.read_bytes())
    return digest.hexdigest()


def prepare_cache(n_sources):
    "The execution cache's database made (Sphinx's parallel readers would each make it, and all but one fail), its size set."
    cache = get_cache(CACHE)
    cache.db
    # Each run of a changed notebook adds an entry; a few per notebook is enough to go back and forth.
    cache.change_cache_limit(4 * n_sources)


def _write_sources():
    SRC.mkdir(parents=True, exist_ok=True)
    toolkit, designs = api.course_modules()
    where = api.definitions(toolkit + designs)
    targets = {}
    for (module, name), (stem, cell_id) in where.items():
        targets.setdefault(stem, {}).setdefault(cell_id, []).append(api.label(module, name))
    names = api.api_names(toolkit)
    # an appendix's own names come first on its page (its `Callback` is not the Learner's)
    names_on = {api.source_notebook(m): {**names, **api.api_names([m])} for m in designs}
    notebooks = {path.stem: nbformat.read(path, as_version=4) for path in sorted(NBS.glob('*.ipynb'))}
    home = notebooks.pop('index')
    # before the directives are taken out of the cells
    course = [stem for stem, nb in notebooks.items() if not is_design(nb)]
    written = {'index.ipynb', 'api.md', *PAGES.values()}
    version = version_cell(library_version())
    for stem, nb in notebooks.items():
        written.add(f'{stem}.ipynb')
        nb = process(nb, targets.get(stem, {}), names_on.get(stem, names))
        nb.cells.insert(0, version)
        write_if_changed(SRC / f'{stem}.ipynb', nbformat.writes(nb))
    listing = nbformat.v4.new_markdown_cell(contents(course, [s for s in notebooks if s not in course]),
                                            id='site-contents')
    write_if_changed(SRC / 'index.ipynb', nbformat.writes(process(home_page(home, listing), {}, names)))
    for path, page in PAGES.items(): write_if_changed(SRC / page, (ROOT / path).read_text())
    write_if_changed(SRC / 'api.md', api.api_page({stem: title(nb) for stem, nb in notebooks.items()}))
    write_site_names(names, names_on, where)
    for stale in set(p.name for p in SRC.iterdir() if not p.name.startswith('.')) - written: (SRC / stale).unlink()


def notebook_stems():
    "The site's notebooks (as `write_sources` names them in docs/_build/src), home page included."
    return sorted(path.stem for path in NBS.glob('*.ipynb'))


class NotebookFailed(Exception):
    "A cell of a site notebook raised (or ran past the site's time limit per cell)."


def run_notebook(stem):
    """Execute the site's notebook `stem` as `make docs` does (a fresh kernel, in a temporary folder, every cell run as a
    student's Run All runs it) and keep it in the site's cache; nothing runs if the cache has it with this code and
    library. The seconds it took, or None when cached; `NotebookFailed` with the cell's traceback on an error."""
    path = SRC / f'{stem}.ipynb'
    with locked(f'{stem}.lock'):  # the site test's `make docs` waits for it, then finds it executed
        cache, nb = get_cache(CACHE), nbformat.read(path, as_version=4)
        with suppress(KeyError):
            cache.match_cache_notebook(nb)
            return None
        record = cache.add_nb_to_project(str(path))
        with tempfile.TemporaryDirectory() as cwd:
            result = single_nb_execution(nb, cwd=cwd, timeout=conf.nb_execution_timeout,
                                         allow_errors=conf.nb_execution_allow_errors, meta_override=True)
        if result.err is not None: raise NotebookFailed(f"{stem}.ipynb: {result.err}")
        cache.cache_notebook_bundle(CacheBundleIn(nb, record.uri, data={'execution_seconds': result.time}),
                                    check_validity=False, overwrite=True)
        return result.time


def last_run_seconds():
    "Notebook stem -> seconds its last execution took, from the site's cache (to start the longest ones first)."
    if not (CACHE / 'global.db').exists(): return {}
    seconds = {}
    for record in sorted(get_cache(CACHE).list_cache_records(), key=lambda r: r.created):
        seconds[Path(record.uri).stem] = (record.data or {}).get('execution_seconds', 0.)
    return seconds


@contextmanager
def every_notebook_locked():
    "Hold every notebook's lock: while `make docs` runs, the tests do not execute a notebook it is executing."
    with ExitStack() as stack:
        for stem in notebook_stems(): stack.enter_context(locked(f'{stem}.lock'))
        yield


def main():
    write_sources()
    for name, (spec, patterns) in NPM_PACKAGES.items(): fetch_npm(name, spec, patterns)


if __name__ == '__main__':
    main()
