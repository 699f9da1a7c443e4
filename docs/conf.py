"""Sphinx configuration of the course site; `make docs` runs docs/prepare.py, then Sphinx on docs/_build/src.

Beyond myst-nb's rendering: progress bars that a fit closed (tqdm hides them) are left out of the pages, with the
widget state they alone used; names of the API in the code cells link to their entries (prepare.py links those in
the prose); a long line of code wraps under itself, further indented, instead of running out of the column
(docs/_static/site.css); the search ranks an exact name's definition first (docs/_static/search-scorer.js). For the
pages' speed: the widget manager loads without holding up the text, MathJax typesets a formula when it comes into
view, and site.css has the browser lay out only the cells near the view."""
import functools
import json
import re
from pathlib import Path

from docutils import nodes
from pygments.formatters import HtmlFormatter
from sphinx.highlighting import PygmentsBridge

HERE = Path(__file__).resolve().parent
STATIC = HERE / '_build' / 'static'
# Written by docs/prepare.py before each build.
API_NAMES, SEARCH_SCORER = HERE / '_build' / 'api_names.json', HERE / '_build' / 'search_scorer.js'

project = 'teachloop'
author = 'teachloop contributors'
copyright = 'teachloop contributors'
# Read, not imported: importing the package would load torch for every build.
release = version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (HERE.parent / 'teachloop' / '__init__.py').read_text())[1]

extensions = ['myst_nb', 'sphinx.ext.mathjax']
root_doc = 'index'
exclude_patterns = ['**.ipynb_checkpoints']
add_module_names = False
# The API page's contents list its modules; its 300-odd names are found with the search.
toc_object_entries = False
suppress_warnings = ['myst.header']

myst_enable_extensions = ['dollarmath', 'amsmath', 'colon_fence', 'fieldlist']
myst_heading_anchors = 3

# Unchanged notebooks are not run again; a cell that raises fails the build.
nb_execution_mode = 'cache'
nb_execution_cache_path = str(HERE / '_build' / 'jupyter_cache')
nb_execution_raise_on_error = True
nb_execution_allow_errors = False
nb_execution_show_tb = True
nb_execution_timeout = 900
# Notebooks write their files to temporary folders anyway; this keeps stray ones out of the sources.
nb_execution_in_temp = True
nb_merge_streams = True

html_theme = 'sphinx_book_theme'
html_title = 'teachloop'
html_favicon = '_static/favicon.svg'
html_static_path = ['_static'] + ([str(STATIC)] if STATIC.exists() else [])
html_css_files = ['site.css']
if SEARCH_SCORER.exists(): html_search_scorer = str(SEARCH_SCORER)
html_theme_options = {
    'repository_url': 'https://github.com/teachloop/teachloop',
    'repository_branch': 'main',
    'path_to_docs': 'nbs',
    # each notebook's page opens it in Colab (the home page says what to install there first)
    'launch_buttons': {'colab_url': 'https://colab.research.google.com'},
    'use_repository_button': True,
    'use_download_button': True,
    'show_toc_level': 2,
    'navigation_with_keys': False,
}
html_copy_source = True
# Without it the theme reports an empty colour mode as a console error on a first visit.
html_context = {'default_mode': 'auto'}

# Served from the site itself: the pages must work without network.
WIDGETS, MATHJAX = STATIC / 'widgets', STATIC / 'mathjax'
# Deferred: it draws the widgets on the page's `load` event anyway, and its 1.9 MB need not hold up the text.
nb_ipywidgets_js = {'widgets/dist/embed.js': {'loading_method': 'defer'}} if WIDGETS.exists() else {}
if MATHJAX.exists(): mathjax_path = 'mathjax/es5/tex-chtml.js'
# A formula is typeset when it scrolls into view: a lesson has up to a hundred, and typesetting them all held up the
# page (02_momentum: about a third of its main thread's time).
mathjax3_config = {'loader': {'load': ['ui/lazy']}}
# Before MathJax's configuration, which is the first object `window.MathJax` holds.
html_js_files = [('mathjax-hub.js', {'priority': 100})]


def _outputs_beside_build(app):
    "myst-nb writes executed notebooks and their images next to the output folder (the repository root for _site/)."
    config = getattr(app.env, 'mystnb_config', None)
    if config is not None:
        app.env.mystnb_config = config.copy(output_folder=str(HERE / '_build' / 'jupyter_execute'))


WIDGET_VIEW = re.compile(r'<script type="application/vnd.jupyter.widget-view\+json">(.*?)</script>', re.DOTALL)
MODEL_REFERENCE = re.compile(r'IPY_MODEL_([0-9a-f]+)|"model_id": "([0-9a-f]+)"')


def shown(model_id, state):
    """Whether a saved widget view shows something: its model was saved, and its layout is not `visibility: hidden` (a
    closed tqdm bar, which keeps its room)."""
    if model_id not in state: return False
    layout = state[model_id]['state'].get('layout', '').removeprefix('IPY_MODEL_')
    return state.get(layout, {}).get('state', {}).get('visibility') != 'hidden'


def models_used(model_ids, state):
    "The models that the views of `model_ids` draw: those, and every model they refer to, recursively."
    used, todo = set(), list(model_ids)
    while todo:
        model_id = todo.pop()
        if model_id in used or model_id not in state: continue
        used.add(model_id)
        todo += [a or b for a, b in MODEL_REFERENCE.findall(json.dumps(state[model_id]))]
    return used


def _ancestors(node):
    while (node := node.parent) is not None: yield node


def _hidden_widgets_removed(app, doctree):
    """A fit's progress bars are closed when it ends, and a closed bar is saved hidden: on the page each still took its
    height (some 300 px of white after every fit). Views that show nothing are left out, with their output when it held
    nothing else, and the saved state keeps the models of the views left (none: the page loads no widget manager)."""
    from myst_nb.sphinx_ import NbMetadataCollector
    files = NbMetadataCollector.get_js_files(app.env, app.env.docname)
    if 'ipywidgets_state' not in files: return
    uri, script = files['ipywidgets_state']
    saved = json.loads(script['body'])
    kept = []
    for raw in list(doctree.findall(nodes.raw)):
        if not (view := WIDGET_VIEW.fullmatch(raw.astext())): continue
        model_id = json.loads(view[1])['model_id']
        if shown(model_id, saved['state']):
            kept.append(model_id)
            continue
        # the output's other forms go too (a tqdm bar's text/plain is its last state, "0%|  | 0/23")
        bundle = next((node for node in _ancestors(raw) if node.get('nb_element') == 'mime_bundle'), raw)
        output = bundle.parent
        output.remove(bundle)
        if not output.children and output.parent is not None: output.parent.remove(output)
    saved['state'] = {k: v for k, v in saved['state'].items() if k in models_used(kept, saved['state'])}
    if saved['state']: script['body'] = json.dumps(saved).replace('</script>', r'<\/script>')
    else:
        for key in [key for key in files if key.startswith('ipywidgets_')]: del files[key]


class SoftWrappedLines(HtmlFormatter):
    """Each line of highlighted code in a span that knows its indentation (`--indent`, in characters): docs/_static/
    site.css wraps a line too long for the column under itself, four characters further in, instead of cutting it
    off. The spans are inline blocks, so that copied code keeps its lines as they are."""
    def wrap(self, source):
        return super().wrap(self._lines(source))

    @staticmethod
    def _lines(source):
        for is_line, html in source:
            if not is_line or not html.endswith('\n'):
                yield is_line, html
                continue
            text = re.sub(r'<[^>]*>', '', html)
            indent = len(text) - len(text.lstrip(' '))
            style = f' style="--indent:{indent}"' if indent else ''
            yield is_line, f'<span class="line"{style}>{html[:-1]}</span>\n'


_NAME_SPAN = '<span class="n">{}</span>'
_CODE_NAME = re.compile(r'(?P<learn><span class="n">learn</span><span class="o">\.</span>)'
                        r'<span class="n">(?P<method>\w+)</span>'
                        r'|(?<!<span class="o">\.</span>)<span class="n">(?P<name>\w+)</span>')


def link_code_names(body, names, api_page):
    """Highlighted code with each name of the API (`names`: name -> (module, object id)) a link to its entry; a method
    only after `learn.` (`learn.lr_find`), and no other name after a dot (`torch.optim.Adam` is not teachloop's)."""
    def link(m):
        name = f"Learner.{m['method']}" if m['learn'] else m['name']
        if name not in names: return m[0]
        span = _NAME_SPAN.format(m['method'] or m['name'])
        return f'{m["learn"] or ""}<a class="api-link" href="{api_page}#{names[name][1]}">{span}</a>'
    return _CODE_NAME.sub(link, body)


@functools.cache
def _site_names(mtime):
    return json.loads(API_NAMES.read_text())


def _code_names_linked(app, pagename, templatename, context, doctree):
    if doctree is None or pagename == 'api' or not API_NAMES.exists() or 'body' not in context: return
    site = _site_names(API_NAMES.stat().st_mtime)
    names = site['names_on'].get(pagename, site['names'])
    context['body'] = link_code_names(context['body'], names, app.builder.get_relative_uri(pagename, 'api'))


def setup(app):
    PygmentsBridge.html_formatter = SoftWrappedLines
    app.connect('builder-inited', _outputs_beside_build, priority=900)
    app.connect('doctree-read', _hidden_widgets_removed)
    app.connect('html-page-context', _code_names_linked)
