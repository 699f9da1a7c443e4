"""Sphinx configuration of the course site; `make docs` runs docs/prepare.py, then Sphinx on docs/_build/src."""
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATIC = HERE / '_build' / 'static'

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
html_theme_options = {
    'repository_url': 'https://github.com/teachloop/teachloop',
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
nb_ipywidgets_js = {'widgets/dist/embed.js': {}} if WIDGETS.exists() else {}
if MATHJAX.exists(): mathjax_path = 'mathjax/es5/tex-chtml.js'
# Before MathJax's configuration, which is the first object `window.MathJax` holds.
html_js_files = [('mathjax-hub.js', {'priority': 100})]


def _outputs_beside_build(app):
    "myst-nb writes executed notebooks and their images next to the output folder (the repository root for _site/)."
    config = getattr(app.env, 'mystnb_config', None)
    if config is not None:
        app.env.mystnb_config = config.copy(output_folder=str(HERE / '_build' / 'jupyter_execute'))


def setup(app):
    app.connect('builder-inited', _outputs_beside_build, priority=900)
