"""Writes the site's sources into docs/_build/src: the course notebooks with nbdev's cell directives turned into
myst-nb cell tags, the home page's table of contents, the API reference page; and fetches the widget manager and
MathJax once (npm), so that the site's pages need no network.

Only files whose content changed are rewritten, so Sphinx re-reads (and jupyter-cache re-runs) only those.
"""
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import nbformat
from jupyter_cache import get_cache
from nbdev.config import get_config

import api

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'
BUILD = ROOT / 'docs' / '_build'
SRC = BUILD / 'src'
STATIC = BUILD / 'static'
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
    "A hash of the package's sources: jupyter-cache keys a notebook by its own code, not by the library it imports."
    digest = hashlib.sha256()
    for path in sorted((ROOT / 'teachloop').rglob('*.py')): digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def version_cell(version):
    "A hidden first cell naming the library's version, so that a change anywhere in the package runs the notebook again."
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
    if not path.exists() or path.read_text() != text: path.write_text(text)


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


def main():
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
    for stale in set(p.name for p in SRC.iterdir()) - written: (SRC / stale).unlink()
    for name, (spec, patterns) in NPM_PACKAGES.items(): fetch_npm(name, spec, patterns)
    # Sphinx's parallel readers would each create the cache's database, and all but one fail.
    cache = get_cache(BUILD / 'jupyter_cache')
    cache.db
    # Each run of a changed notebook adds an entry; a few per notebook is enough to go back and forth.
    cache.change_cache_limit(4 * len(written))


if __name__ == '__main__':
    main()
