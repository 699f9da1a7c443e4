"""Writes the site's sources into docs/_build/src: the course notebooks with nbdev's cell directives turned into
myst-nb cell tags, the home page's table of contents, the API reference page; and fetches the widget manager and
MathJax once (npm), so that the site's pages need no network.

Only files whose content changed are rewritten, so Sphinx re-reads (and jupyter-cache re-runs) only those.

`run_notebook` executes one of those notebooks into the site's cache exactly as `make docs` would: the tests run every
notebook that way (in parallel with the other tests), and the site build then finds them all executed.
"""
import fcntl
import hashlib
import importlib.metadata
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
from nbdev.config import get_config

import api
import conf

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'
BUILD = ROOT / 'docs' / '_build'
SRC = BUILD / 'src'
STATIC = BUILD / 'static'
CACHE = Path(conf.nb_execution_cache_path)
LOCKS = BUILD / 'locks'
# The html-manager 1.x line renders ipywidgets 8 state; both packages are pinned so the site does not change by itself.
NPM_PACKAGES = {'widgets': ('@jupyter-widgets/html-manager@1.0.15', ['dist/embed.js', 'dist/*.woff', 'dist/*.woff2',
                                                                       'dist/*.ttf', 'dist/*.eot', 'dist/*.svg',
                                                                       'dist/*LICENSE*']),
                'mathjax': ('mathjax@3.2.2', ['es5/tex-chtml.js', 'es5/input/tex/extensions/**/*.js',
                                              'es5/output/chtml/fonts/woff-v2/*', 'es5/ui/*.js', 'es5/a11y/*.js'])}

_DIRECTIVE = re.compile(r'^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$')
_WHY_NOT_RUN = {'cuda': 'it needs a CUDA GPU', 'browser': 'it needs a browser', 'notest': 'it is left out of the notebook tests'}


def test_flags():
    "The cell flags that `nbdev-test` skips (`tst_flags` in pyproject.toml): the site does not run those cells either."
    return set(str(get_config(path=ROOT).get('tst_flags', '')).split())


def split_directives(source):
    "nbdev's `#| name value` lines at the top of a cell, and the code after them."
    lines, directives = source.splitlines(), {}
    while lines and (m := _DIRECTIVE.match(lines[0])):
        directives[m.group(1)] = m.group(2)
        lines.pop(0)
    return directives, '\n'.join(lines)


def tags_for(directives, skipped):
    "myst-nb's cell tags for nbdev's (and Quarto's) directives."
    tags = []
    if {'hide', 'default_exp'} & directives.keys() or directives.get('include') == 'false': tags.append('remove-cell')
    if skipped or directives.get('eval') == 'false': tags.append('skip-execution')
    if directives.get('echo') == 'false': tags.append('remove-input')
    if directives.get('output') == 'false': tags.append('remove-output')
    return tags


def process_cell(cell, flags):
    directives, code = split_directives(cell.source)
    skipped = sorted(flags & directives.keys())
    if skipped:
        why = ', '.join(_WHY_NOT_RUN.get(flag, f'it is marked `{flag}`') for flag in skipped)
        code = f'# Not run for this page: {why}.\n{code}'
    cell.source = code
    cell.outputs, cell.execution_count = [], None
    tags = list(dict.fromkeys(cell.metadata.get('tags', []) + tags_for(directives, skipped)))
    if tags: cell.metadata['tags'] = tags


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


def process(nb, flags, targets):
    cells = []
    for cell in nb.cells:
        if cell.cell_type == 'code':
            process_cell(cell, flags)
            if cell.get('id') in targets: cells.append(target_cell(cell.id, targets[cell.id]))
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
                        toctree('Reference', ['api'])])


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
    with locked('sources'): _write_sources()


def _write_sources():
    SRC.mkdir(parents=True, exist_ok=True)
    flags, (toolkit, designs) = test_flags(), api.course_modules()
    targets = {}
    for (module, name), (stem, cell_id) in api.definitions(toolkit + designs).items():
        targets.setdefault(stem, {}).setdefault(cell_id, []).append(api.label(module, name))
    notebooks = {path.stem: nbformat.read(path, as_version=4) for path in sorted(NBS.glob('*.ipynb'))}
    home = notebooks.pop('index')
    written = {'index.ipynb', 'api.md'}
    version = version_cell(library_version())
    for stem, nb in notebooks.items():
        written.add(f'{stem}.ipynb')
        nb = process(nb, flags, targets.get(stem, {}))
        nb.cells.insert(0, version)
        write_if_changed(SRC / f'{stem}.ipynb', nbformat.writes(nb))
    course = [stem for stem, nb in notebooks.items() if not is_design(nb)]
    home.cells.append(nbformat.v4.new_markdown_cell(contents(course, [s for s in notebooks if s not in course]),
                                                     id='site-contents'))
    write_if_changed(SRC / 'index.ipynb', nbformat.writes(process(home, flags, {})))
    write_if_changed(SRC / 'api.md', api.api_page({stem: title(nb) for stem, nb in notebooks.items()}))
    for stale in set(p.name for p in SRC.iterdir() if not p.name.startswith('.')) - written: (SRC / stale).unlink()
    # Sphinx's parallel readers would each create the cache's database, and all but one fail.
    cache = get_cache(CACHE)
    cache.db
    # Each run of a changed notebook adds an entry; a few per notebook is enough to go back and forth.
    cache.change_cache_limit(4 * len(written))


def notebook_stems():
    "The site's notebooks (as `write_sources` names them in docs/_build/src), home page included."
    return sorted(path.stem for path in NBS.glob('*.ipynb'))


class NotebookFailed(Exception):
    "A cell of a site notebook raised (or ran past the site's time limit per cell)."


def run_notebook(stem):
    """Execute the site's notebook `stem` as `make docs` does (a fresh kernel, in a temporary folder, the cells that
    `nbdev-test` skips not run) and keep it in the site's cache; nothing runs if the cache has it with this code and
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
