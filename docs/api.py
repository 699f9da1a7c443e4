"""The API reference page, written from the package itself: each exported name with its docstring, signature,
parameters (the inline comments that `docments` reads) and a link to the notebook cell that defines it."""
import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

from fastcore.docments import docments

_CELL_MARKER = re.compile(r'^# %% \S*?([^/\s]+)\.ipynb #(\S+)')
_SOURCE_NOTEBOOK = re.compile(r'File to edit: \S*?([^/\s]+)\.ipynb')


def course_modules():
    "The modules `teachloop.all` gathers, and the historical designs, each in course (notebook) order."
    import teachloop.all
    import teachloop.designs
    designs = [importlib.import_module(f'teachloop.designs.{m.name}')
               for m in pkgutil.iter_modules(teachloop.designs.__path__)]
    by_notebook = lambda modules: sorted(modules, key=source_notebook)
    return by_notebook(teachloop.all.MODULES), by_notebook(designs)


def source_notebook(module):
    "The stem of the notebook a module is exported from (nbdev names it in the module's header)."
    return _SOURCE_NOTEBOOK.search(Path(module.__file__).read_text()).group(1)


def _defined_at(tree):
    "Top-level name -> line where the module assigns or defines it."
    lines = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): lines[node.name] = node.lineno
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name): lines.setdefault(name.id, node.lineno)
    return lines


def definitions(modules):
    "`(module name, name)` -> `(notebook stem, cell id)` of the cell that defines each exported name."
    found = {}
    for module in modules:
        source = Path(module.__file__).read_text().splitlines()
        markers = [(i + 1, m.groups()) for i, line in enumerate(source) if (m := _CELL_MARKER.match(line))]
        lines = _defined_at(ast.parse('\n'.join(source)))
        for name in module.__all__:
            cells = [cell for line, cell in markers if line < lines.get(name, 0)]
            if cells: found[module.__name__, name] = cells[-1]
    return found


def label(module_name, name):
    "The cross-reference label a notebook page puts on the cell that defines `name`."
    return f'def-{module_name}.{name}'.lower()


_OBJECT_REPR = re.compile(r"<(?:function|class|built-in function) '?(<lambda>|[\w.]+)'?(?: at 0x[0-9a-f]+)?>")


def readable(value):
    "A value as it reads in code: functions and classes by name, and no memory addresses (which change every run)."
    text = _OBJECT_REPR.sub(lambda m: 'lambda' if m[1] == '<lambda>' else m[1], repr(value))
    return re.sub(r' at 0x[0-9a-f]+', '', text)


class _AsWritten(str):
    "Text that a signature shows as it is, without the quotes of a string's repr."
    def __repr__(self): return str(self)


def signature(obj):
    "The call signature, with readable defaults; '' when Python cannot tell (e.g. exceptions built on `Exception`)."
    try: sig = inspect.signature(obj)
    except (TypeError, ValueError): return ''
    # `from __future__ import annotations` leaves annotations as strings
    plain = lambda annotation: _AsWritten(annotation) if isinstance(annotation, str) else annotation
    params = [p.replace(annotation=plain(p.annotation),
                        default=p.default if p.default is p.empty else _AsWritten(readable(p.default)))
              for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=plain(sig.return_annotation)))


def _constant_comment(module, name):
    "The comment beside a constant's assignment, or the comment lines just above it."
    source = Path(module.__file__).read_text().splitlines()
    line = _defined_at(ast.parse('\n'.join(source))).get(name)
    if line is None: return ''
    beside = source[line - 1].partition('  # ')[2]
    if beside: return beside.strip()
    above = []
    for text in reversed(source[:line - 1]):
        if not text.startswith('# ') or text.startswith('# %%'): break
        above.insert(0, text[2:])
    return ' '.join(above)


def _directive(kind, head, body, options=()):
    fence = '````' if '```' in body else '```'
    return '\n'.join([f'{fence}{{py:{kind}}} {head}', *options, '', body, fence, ''])


def _notebook_link(module, titles, name=None, where=()):
    "A link to the notebook that exports `module`: to the cell that defines `name` when it is known."
    stem = source_notebook(module)
    title = titles.get(stem) or stem
    if (module.__name__, name) in where: return f"{{ref}}`{title} <{label(module.__name__, name)}>`"
    return f"{{doc}}`{title} <{stem}>`"


def document(module, name, where, titles):
    "One exported name as a MyST directive of Sphinx's Python domain."
    obj = getattr(module, name)
    options = [f':module: {module.__name__}']
    link = f"Explained in {_notebook_link(module, titles, name, where)}."
    if not callable(obj):
        value = readable(obj)
        # a set's order changes from run to run (string hashing is salted), so it is not shown
        shown = len(value) <= 80 and not isinstance(obj, (set, frozenset))
        options += [f':type: {type(obj).__name__}'] + ([f':value: {value}'] if shown else [])
        return _directive('data', name, '\n\n'.join(filter(None, [_constant_comment(module, name), link])), options)
    doc, params = inspect.getdoc(obj) or '', docments(obj, full=True)
    returns = params.pop('return', {}).get('docment')
    fields = [f':param {param}: {info["docment"]}' for param, info in params.items()
              if param != 'self' and info['docment']] + ([f':returns: {returns}'] if returns else [])
    kind = 'function'
    if inspect.isclass(obj):
        kind = 'exception' if issubclass(obj, BaseException) else 'class'
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        if bases: doc = f"Bases: {', '.join(f'`{b}`' for b in bases)}\n\n{doc}"
    body = '\n\n'.join(filter(None, [doc, '\n'.join(fields), link]))
    return _directive(kind, f'{name}{signature(obj)}', body, options)


def module_section(module, where, titles):
    summary = (inspect.getdoc(module) or '').split('\n\n')[0]
    head = [f'### {module.__name__}', '', summary, '', f'Notebook: {_notebook_link(module, titles)}', '']
    return '\n'.join(head + [document(module, name, where, titles) for name in module.__all__])


def api_page(titles):
    "The whole reference page as MyST markdown; `titles` maps notebook stems to their page titles."
    toolkit, designs = course_modules()
    where = definitions(toolkit + designs)
    parts = ['# API reference', '',
             'Every name that `from teachloop.all import *` gives, module by module in course order, with a link to the '
             'notebook that explains it; then the historical designs, which `teachloop.all` leaves out.', '',
             '## The toolkit: `teachloop.all`', '']
    parts += [module_section(m, where, titles) for m in toolkit]
    parts += ['## Appendix: historical designs', '',
              'The designs of other libraries rebuilt on teachloop (`teachloop.designs`), to compare with its own.', '']
    parts += [module_section(m, where, titles) for m in designs]
    return '\n'.join(parts)
