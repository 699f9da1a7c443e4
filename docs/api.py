"""The API reference page, written from the package itself: each exported name with its docstring, signature,
parameters (the inline comments that `docments` reads) and a link to the notebook cell that defines it. A class lists
its documented methods; a method that a module adds to another module's class (fastcore's `@patch`, e.g.
`Learner.lr_find` from teachloop.callback.schedule) is listed with that module."""
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


def _is_patch(decorator):
    "`@patch` or `@patch(as_prop=True)`."
    return getattr(decorator.func if isinstance(decorator, ast.Call) else decorator, 'id', None) == 'patch'


def added_methods(module):
    "`Class.method` of each public method that `module` adds to a class of another module with fastcore's `@patch`."
    tree = ast.parse(Path(module.__file__).read_text())
    own = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith('_') or not node.args.args: continue
        cls = node.args.args[0].annotation  # `self:Learner`
        if any(map(_is_patch, node.decorator_list)) and isinstance(cls, ast.Name) and cls.id not in own:
            found.append(f'{cls.id}.{node.name}')
    return found


def public_names(module):
    "What the API page lists for `module`: its `__all__`, then the methods it adds to other modules' classes."
    return [*module.__all__, *added_methods(module)]


def definitions(modules):
    "`(module name, name)` -> `(notebook stem, cell id)` of the cell that defines each of the modules' public names."
    found = {}
    for module in modules:
        source = Path(module.__file__).read_text().splitlines()
        markers = [(i + 1, m.groups()) for i, line in enumerate(source) if (m := _CELL_MARKER.match(line))]
        lines = _defined_at(ast.parse('\n'.join(source)))
        for name in public_names(module):
            cells = [cell for line, cell in markers if line < lines.get(name.rpartition('.')[2], 0)]
            if cells: found[module.__name__, name] = cells[-1]
    return found


def api_names(modules):
    """`{name: (module name, Sphinx object id)}` of what the API page documents: the modules' public names, the methods
    of their classes as `Class.method`, and a method added to another module's class under its own name too."""
    names = {}
    for module in modules:
        for name in module.__all__:
            names.setdefault(name, (module.__name__, f'{module.__name__}.{name}'))
            obj = getattr(module, name)
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                for method_name, _ in methods(obj, module):
                    method = f'{name}.{method_name}'
                    names.setdefault(method, (module.__name__, f'{module.__name__}.{method}'))
    for module in modules:
        for name in added_methods(module):
            for key in (name, name.rpartition('.')[2]):
                names.setdefault(key, (module.__name__, f'{module.__name__}.{name}'))
    return names


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


def signature(obj, method=False):
    """The call signature, with readable defaults; '' when Python cannot tell (e.g. exceptions built on `Exception`).
    A `method`'s first parameter (`self`, `cls`) is left out, as a call on an instance shows it."""
    try: sig = inspect.signature(obj)
    except (TypeError, ValueError): return ''
    # `from __future__ import annotations` leaves annotations as strings
    plain = lambda annotation: _AsWritten(annotation) if isinstance(annotation, str) else annotation
    params = [p.replace(annotation=plain(p.annotation),
                        default=p.default if p.default is p.empty else _AsWritten(readable(p.default)))
              for p in list(sig.parameters.values())[1 if method else 0:]]
    return str(sig.replace(parameters=params, return_annotation=plain(sig.return_annotation)))


def docstring(obj):
    "The docstring without the `Args:` section that the export adds for `help()`: the page lists the parameters itself."
    return (inspect.getdoc(obj) or '').split('\n\nArgs:\n')[0]


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
    "A MyST directive fenced with more backticks than any fence inside `body` (a class holds its methods' directives)."
    fence = '`' * max([3] + [len(run) + 1 for run in re.findall(r'^`{3,}', body, re.MULTILINE)])
    return '\n'.join([f'{fence}{{py:{kind}}} {head}', *options, '', body, fence, ''])


def _notebook_link(module, titles, name=None, where=()):
    "A link to the notebook that exports `module`: to the cell that defines `name` when it is known."
    stem = source_notebook(module)
    title = titles.get(stem) or stem
    if (module.__name__, name) in where: return f"{{ref}}`{title} <{label(module.__name__, name)}>`"
    return f"{{doc}}`{title} <{stem}>`"


def _fields(func):
    "The inline comments of a function's parameters and return value, as MyST fields."
    params = docments(func, full=True)
    returns = params.pop('return', {}).get('docment')
    return [f':param {param}: {info["docment"]}' for param, info in params.items()
            if param not in ('self', 'cls') and info['docment']] + ([f':returns: {returns}'] if returns else [])


def _function_of(value):
    "The function a class attribute holds (a static or class method's own function), or None."
    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    return value if inspect.isfunction(value) else None


def methods(cls, module):
    "`(name, attribute)` of the public, documented methods that `module` defines on `cls`, in the order added."
    return [(name, value) for name, value in vars(cls).items() if not name.startswith('_') and
            (func := _function_of(value)) and func.__module__ == module.__name__ and func.__doc__]


def method(name, value, options=(), link=None):
    "A method as a MyST directive: inside its class's directive, or at the module's level as `Class.name`."
    func, kind = _function_of(value), type(value)
    options = [*options] + ([f':{kind.__name__}:'] if kind in (staticmethod, classmethod) else [])
    body = '\n\n'.join(filter(None, [docstring(func), '\n'.join(_fields(func)), link]))
    return _directive('method', f'{name}{signature(func, method=kind is not staticmethod)}', body, options)


def lesson_of(stem, stems):
    "The lesson whose code a notebook `NNz_...` holds (the course notebook sorted just after it); None for the others."
    if not re.match(r'\d+z_', stem): return None
    return next((s for s in sorted(stems) if s > stem and re.match(r'\d', s)), None)


def document(module, name, where, titles):
    "One public name as a MyST directive of Sphinx's Python domain."
    options = [f':module: {module.__name__}']
    link = f"Explained in {_notebook_link(module, titles, name, where)}."
    lesson = lesson_of(source_notebook(module), titles)
    if lesson:
        code = _notebook_link(module, titles, name, where)
        link = f"Explained in {{doc}}`{titles[lesson]} <{lesson}>`; its code in {code}."
    if '.' in name:  # a method added to another module's class
        cls, attr = name.split('.')
        return method(name, vars(getattr(module, cls))[attr], options, link)
    obj = getattr(module, name)
    if not (inspect.isroutine(obj) or inspect.isclass(obj)):  # a constant, or a type alias (`Callable[[float], float]`)
        value = readable(obj)
        # a set's order changes from run to run (string hashing is salted), so it is not shown
        shown = len(value) <= 80 and not isinstance(obj, (set, frozenset))
        options += [f':type: {type(obj).__name__}'] + ([f':value: {value}'] if shown else [])
        return _directive('data', name, '\n\n'.join(filter(None, [_constant_comment(module, name), link])), options)
    doc, fields, members = docstring(obj), _fields(obj), []
    kind = 'function'
    if inspect.isclass(obj):
        kind = 'exception' if issubclass(obj, BaseException) else 'class'
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        if bases: doc = f"Bases: {', '.join(f'`{b}`' for b in bases)}\n\n{doc}"
        if obj.__module__ == module.__name__: members = [method(*item) for item in methods(obj, module)]
    body = '\n\n'.join(filter(None, [doc, '\n'.join(fields), link, *members]))
    return _directive(kind, f'{name}{signature(obj)}', body, options)


def module_section(module, where, titles):
    summary = (inspect.getdoc(module) or '').split('\n\n')[0]
    head = [f'### {module.__name__}', '', summary, '', f'Notebook: {_notebook_link(module, titles)}', '']
    return '\n'.join(head + [document(module, name, where, titles) for name in public_names(module)])


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
