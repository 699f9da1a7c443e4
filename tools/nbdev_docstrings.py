"""An nbdev export processor: the comments beside a function's parameters (nbdev's docments) are added to its
docstring in the exported module, as an `Args:` section, so that `help()` and editors show them.

The notebooks keep one-line docstrings and the comments beside the parameters, which is how they read best; only the
generated modules carry the section. `pyproject.toml` names the processor (`export_procs`); `make` puts this folder on
the virtual environment's path so that `nbdev-export` finds it.
"""
import ast
import io
import tokenize


def _comments(source):
    "{line: comment text} of the comments in `source`."
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: (t.start[1], t.string.lstrip('#').strip()) for t in tokens if t.type == tokenize.COMMENT}


def _parameters(node):
    "(name, node its text ends with) of each parameter of the function `node`, in order."
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    found = [(a.arg, d or a) for a, d in zip(positional, defaults)]
    if args.vararg: found.append(('*' + args.vararg.arg, args.vararg))
    found += [(a.arg, d or a) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg: found.append(('**' + args.kwarg.arg, args.kwarg))
    return found


def parameter_docs(node, lines, comments):
    "{parameter: comment} for the parameters of `node` followed on their line by a comma (or nothing) and a comment."
    docs = {}
    for name, last in _parameters(node):
        line, end = last.end_lineno, last.end_col_offset
        if line not in comments: continue
        col, text = comments[line]
        # ast counts columns in bytes of UTF-8, tokenize in characters
        between = lines[line - 1].encode()[end:len(lines[line - 1][:col].encode())].decode()
        if between.strip() in ('', ','): docs[name.lstrip('*')] = text
    return docs


def _docstring(body):
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.value
    return None


def _with_args(node, docs):
    "The docstring literal of `node` (an ast string constant) with an `Args:` section for `docs`."
    indent = ' ' * node.col_offset
    if any(line.strip() == 'Args:' for line in node.value.splitlines()):
        raise ValueError(f"the docstring {node.value.splitlines()[0]!r} (line {node.lineno}) has an `Args:` section "
                         "and comments beside its parameters: keep the comments, remove the section (the export "
                         "writes it from them)")
    text = node.value.rstrip() + '\n\n' + indent + 'Args:\n'
    text += ''.join(f'{indent}    {name}: {doc}\n' for name, doc in docs.items()) + indent
    return '"""' + text.replace('\\', '\\\\').replace('"""', '\\"\\"\\"') + '"""'


def edits(source):
    "[(docstring node, new literal)] for the functions and classes at the top of `source` or in its classes."
    try: tree = ast.parse(source)
    except SyntaxError: return []
    lines, comments, found = source.splitlines(), _comments(source), []

    def visit(node, owner=None):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            docs, doc = parameter_docs(node, lines, comments), _docstring(node.body)
            # a constructor without a docstring of its own documents its parameters in its class's
            target = doc if doc is not None else (_docstring(owner.body) if owner and node.name == '__init__' else None)
            if docs and target is not None: found.append((target, docs))
        elif isinstance(node, ast.ClassDef):
            for child in node.body: visit(child, node)

    for node in tree.body: visit(node)
    merged = {}
    for target, docs in found: merged.setdefault(id(target), (target, {}))[1].update(docs)
    return [(target, _with_args(target, docs)) for target, docs in merged.values()]


def add_parameter_docs(source):
    "`source` with the parameters' comments added to the docstrings of its functions."
    lines = source.splitlines(keepends=True)
    for node, literal in sorted(edits(source), key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        start, end = lines[node.lineno - 1].encode(), lines[node.end_lineno - 1].encode()
        replaced = (start[:node.col_offset] + literal.encode() + end[node.end_col_offset:]).decode()
        lines[node.lineno - 1:node.end_lineno] = [replaced]
    return ''.join(lines)


def docstring_proc(cell):
    "nbdev's processor: rewrite an exported code cell's source."
    if cell.cell_type == 'code' and {'export', 'exports'} & set(getattr(cell, 'directives_', {})):
        cell.source = add_parameter_docs(cell.source)
