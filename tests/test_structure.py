"""How the library is laid out: imports only point down the layers of the course, each public name is one thing."""
import ast
import re
import subprocess
import sys
import importlib
import inspect
from collections import Counter
from pathlib import Path

import pytest

import teachloop
import teachloop.all

PACKAGE = Path(teachloop.__file__).parent

# The layers, lowest first, by module or subpackage (a subpackage's modules are in its layer unless named apart). A
# module may import modules of its own layer or of lower ones, never of a higher one; inside a layer the imports must
# not form a cycle.
LAYERS = [
    {'core', 'random_state', 'lessons'},  # helpers every layer needs (and the lessons' package, which imports nothing)
    {'data', 'figures'},  # the data sets; figures and widgets of figures (matplotlib, ipywidgets when shown)
    {'optim'},  # the generic optimizer, the classic and recent ones, the fast path, torch interop
    {'lessons.momentum', 'lessons.optimizer_builder'},  # running averages and paths on 2-D surfaces, right after 01
    {'learner'},  # the callback core and the training loop
    {'callback', 'metrics', 'fine_tune', 'diagnostics', 'testing', 'inference', 'lessons.demo', 'lessons.race'},  # callbacks by family, what they measure
    {'dashboard'},  # widgets
    {'all'},
    {'designs'},  # the historical designs, in their own subpackage
]

# Where a newcomer looks for each part: the package's folders, each holding what its name says.
FOLDERS = {'optim', 'callback', 'diagnostics', 'dashboard', 'lessons', 'designs'}


def module_names():
    "Every module of the package, dotted below `teachloop` ('learner', 'designs.callbacks_v1', ...)."
    names = []
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(PACKAGE).with_suffix('').parts
        if parts[-1] == '__init__': parts = parts[:-1]
        if parts and parts[-1] != '_modidx': names.append('.'.join(parts))
    return names


def layer_of(name):
    "The layer of module `name` ('callback.checkpoint'): its own entry, else its subpackage's."
    parts = name.split('.')
    for n in range(len(parts), 0, -1):
        for i, layer in enumerate(LAYERS):
            if '.'.join(parts[:n]) in layer: return i
    raise AssertionError(f"module teachloop.{name} is in no layer: add it to LAYERS")


def test_the_package_is_laid_out_in_folders_by_part():
    "Subpackages for the parts; at the top only the foundations, the loop, and the module that gathers them all."
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / '__init__.py').exists()}
    assert folders == FOLDERS
    top = {p.stem for p in PACKAGE.glob('*.py')} - {'__init__', '_modidx'}
    assert top == {'core', 'random_state', 'data', 'figures', 'learner', 'metrics', 'fine_tune', 'testing', 'inference', 'all'}


def imported_teachloop_modules(name):
    "[(module imported, line, at module level?)] for each import of a teachloop module in `teachloop.<name>`."
    path = PACKAGE / (name.replace('.', '/') + '.py')
    if not path.exists(): path = PACKAGE / name.replace('.', '/') / '__init__.py'
    tree = ast.parse(path.read_text())
    package = ['teachloop'] + name.split('.')[:-1] if path.name != '__init__.py' else ['teachloop'] + name.split('.')
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = '.'.join(base + ([node.module] if node.module else []))
            targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import): targets = [a.name for a in node.names]
        for target in targets:
            if target == 'teachloop' or target.startswith('teachloop.'):
                inner = target[len('teachloop.'):] if target != 'teachloop' else ''
                found.append((inner, node.lineno, id(node) in top_level))
    return found


def import_graph():
    known = set(module_names())
    graph = {}
    for name in known:
        graph[name] = {}
        for target, line, top in imported_teachloop_modules(name):
            # `from teachloop import x` names a module x, `from teachloop.x import y` the module x
            while target and target not in known: target = target.rpartition('.')[0]
            if target and target != name: graph[name][target] = (line, top)
    return graph


def test_every_module_is_in_a_layer():
    for name in module_names(): layer_of(name)


def test_no_function_imports_a_teachloop_module():
    late = [f"teachloop.{name}:{line} imports teachloop.{target or ''}" for name in module_names()
            for target, line, top in imported_teachloop_modules(name) if not top]
    assert late == [], "imports inside functions hide cycles; import at the top, from a lower layer:\n" + '\n'.join(late)


def test_imports_only_point_down_the_layers():
    upward = [f"teachloop.{name} (layer {layer_of(name)}) imports teachloop.{target} (layer {layer_of(target)}) "
              f"at line {line}" for name, targets in import_graph().items() for target, (line, _) in targets.items()
              if layer_of(target) > layer_of(name)]
    assert upward == [], '\n'.join(upward)


def test_the_import_graph_has_no_cycle():
    graph, state, cycles = import_graph(), {}, []
    def visit(name, path):
        state[name] = 'open'
        for target in graph[name]:
            if state.get(target) == 'open': cycles.append(path[path.index(target):] + [target])
            elif target not in state: visit(target, path + [target])
        state[name] = 'done'
    for name in sorted(graph):
        if name not in state: visit(name, [name])
    assert cycles == [], '\n'.join(' -> '.join(c) for c in cycles)


def test_the_check_sees_an_upward_and_a_late_import(tmp_path, monkeypatch):
    "The parser finds what these tests look for (run on a made-up module)."
    fake = tmp_path / 'teachloop'
    fake.mkdir()
    (fake / 'optim').mkdir()
    (fake / 'optim' / 'core.py').write_text("from ..learner import Learner\ndef f():\n    from teachloop.dashboard.live import x\n")
    monkeypatch.setattr(__import__(__name__), 'PACKAGE', fake)
    assert imported_teachloop_modules('optim.core') == [('learner', 1, True), ('dashboard.live', 3, False)]


def exported():
    "(module name, exported name, object) for every public name of every module of the package."
    for name in module_names():
        if name == 'all': continue  # it re-exports the others
        module = importlib.import_module(f'teachloop.{name}' if name else 'teachloop')
        for public in getattr(module, '__all__', []): yield name, public, getattr(module, public)


def test_no_exported_function_is_a_method_in_disguise():
    classes = [obj for _, _, obj in exported() if inspect.isclass(obj)]
    methods = {id(inspect.unwrap(v)) for cls in classes for v in vars(cls).values() if callable(v)}
    wrong = [f"teachloop.{module}.{public}" for module, public, obj in exported() if inspect.isfunction(obj)
             and (id(inspect.unwrap(obj)) in methods or next(iter(inspect.signature(obj).parameters), '') == 'self')]
    assert wrong == [], f"methods exported as module functions (add them with @patch, or inside the class): {wrong}"


def test_methods_added_by_later_notebooks_carry_their_class_name():
    from teachloop.learner import Learner
    for method in ('fit', 'validate', 'save', 'fit_one_cycle', 'lr_find', 'save_checkpoint', 'resume_callback'):
        assert getattr(Learner, method).__qualname__ == f'Learner.{method}'


def test_no_two_modules_export_a_name_for_different_things():
    owners = {}
    for module, public, obj in exported():
        owners.setdefault(public, {})[id(obj)] = module
    clashes = {name: sorted(mods.values()) for name, mods in owners.items() if len(mods) > 1}
    assert clashes == {}


def test_teachloop_all_binds_each_name_once_and_no_method_nor_design():
    names = teachloop.all.__all__
    assert [n for n, c in Counter(names).items() if c > 1] == []
    namespace = {}
    exec('from teachloop.all import *', namespace)
    assert {'Learner', 'Adam', 'Recorder', 'fit_one_cycle'} & set(namespace) == {'Learner', 'Adam', 'Recorder'}
    assert not {'fit', 'save', 'load', 'before_fit', 'update'} & set(namespace)
    assert all(not getattr(namespace[n], '__module__', '').startswith('teachloop.designs') for n in names)


def test_each_public_function_and_class_has_a_one_line_docstring():
    "One line in the notebook; the export may add the parameters' comments after it, as an `Args:` section."
    summary = lambda doc: doc.strip().split('\n\n    Args:\n')[0]
    bad = [f"teachloop.{module}.{public}" for module, public, obj in exported()
           if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__.startswith('teachloop')
           and (not obj.__doc__ or '\n' in summary(obj.__doc__))]
    assert bad == []


def example_params(optimizer_name):
    "Parameters the optimizer `optimizer_name` takes: Muon wants matrices, MuonAdamW groups tagged with their kind."
    import torch
    matrix, vector = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    if optimizer_name == 'Muon': return [matrix]
    if optimizer_name == 'MuonAdamW': return [{'params': [matrix], 'kind': 'muon'}, {'params': [vector], 'kind': 'adamw'}]
    return [vector]


def exported_optimizer_callbacks():
    "Every callback that an exported optimizer of teachloop runs, found by building each one."
    import torch
    from teachloop.optim.core import Optimizer, callback_function
    from teachloop.optim import core as optimizer, more as optimizers, recent as recent_optimizers
    found = set()
    for module in (optimizer, optimizers, recent_optimizers):
        for public in module.__all__:
            make = getattr(module, public)
            if not inspect.isfunction(make) or public[0].islower(): continue
            params = example_params(public)
            try: opt = make(params, lr=0.1)
            except TypeError: opt = make(optimizer.SGD(params, lr=0.1))  # Lookahead wraps an optimizer
            assert isinstance(opt, Optimizer), public
            found.update(callback_function(cb) for cb in opt.cbs)
    return found


def test_every_optimizer_callback_declares_its_rules_multi_tensor_version_and_effective_lr():
    from teachloop.optim.core import OPTIMIZER_CALLBACKS, callback_facts
    callbacks = exported_optimizer_callbacks()
    assert len(callbacks) >= 15 and callbacks <= set(OPTIMIZER_CALLBACKS)
    incomplete = {cb.__name__: callback_facts(cb).missing() for cb in callbacks if callback_facts(cb).missing()}
    assert incomplete == {}
    for cb in callbacks:
        facts = callback_facts(cb)
        # a callback run once per group has no per-tensor work: its multi-tensor version is None
        assert isinstance(facts.hypers, dict) and (callable(facts.multi_tensor) or facts.per_group), cb.__name__
        assert facts.effective_lr is None or callable(facts.effective_lr), cb.__name__
        # the rules cover every hyper-parameter the callback reads that has a rule anywhere
        reads = set(inspect.signature(cb).parameters)
        from teachloop.optim.core import _hyper_rules
        assert {h for h in reads if h in _hyper_rules} <= set(facts.hypers), cb.__name__


def test_a_callback_without_a_declaration_is_reported_missing():
    from teachloop.optim.core import callback_facts, declare_callback, OPTIMIZER_CALLBACKS
    def new_step(p, lr, **kwargs): p.add_(p.grad, alpha=-lr)
    assert callback_facts(new_step).missing() == ['hypers', 'multi_tensor', 'effective_lr']
    try:
        declare_callback(new_step, effective_lr=None)
        assert callback_facts(new_step).missing() == ['hypers', 'multi_tensor']
        with pytest.raises(TypeError, match='unknown facts'): declare_callback(new_step, speed=1)
    finally: OPTIMIZER_CALLBACKS.pop(new_step, None)


FINGERPRINT = """
import importlib
importlib.import_module('teachloop.{first}')
import torch
from teachloop.data import DataLoaders
from teachloop.learner import DEFAULT_CALLBACKS, Learner
Learner(DataLoaders([], None), torch.nn.Linear(1, 1), torch.nn.functional.mse_loss)  # the first learner: its additions
from teachloop.optim.core import FAST_STEP_PLANNERS, OPTIMIZER_CALLBACKS, callback_facts
print(sorted(m.__name__ for m in DEFAULT_CALLBACKS))
print([p.__module__ for p in FAST_STEP_PLANNERS])
print(sorted(n for n in dir(Learner) if not n.startswith('__')))
print(sorted((cb.__name__, callback_facts(cb).effective_lr is not None) for cb in OPTIMIZER_CALLBACKS))
"""


def test_what_a_module_adds_to_lower_ones_does_not_depend_on_the_import_order():
    "The learner's default callbacks and methods, the fast steps, the effective-lr facts: the same whatever comes first."
    seen = {first: subprocess.run([sys.executable, '-c', FINGERPRINT.format(first=first)], capture_output=True, text=True,
                                  check=True).stdout
            # any submodule runs the package root first: one the root imports, one it does not, and everything
            for first in ('optim.core', 'dashboard.live', 'all')}
    assert len(set(seen.values())) == 1, {first: out[:300] for first, out in seen.items()}
    root = seen['optim.core']
    assert "'Recorder'" in root and 'fit_one_cycle' in root and 'teachloop.optim.fast' in root


LOADED = """
import sys, importlib
importlib.import_module('teachloop.{first}')
print(sorted(m for m in sys.modules if m.startswith('teachloop')))
"""


def test_importing_the_optimizers_loads_no_callback_and_the_learner_loads_its_additions():
    "`import teachloop.optim.core` loads the optimizer modules only; the learner's import, or its first learner, the rest."
    loaded = lambda first: eval(subprocess.run([sys.executable, '-c', LOADED.format(first=first)], capture_output=True,
                                               text=True, check=True).stdout)
    assert loaded('optim.core') == ['teachloop', 'teachloop.optim', 'teachloop.optim.core', 'teachloop.optim.fast',
                                    'teachloop.optim.interop', 'teachloop.optim.more', 'teachloop.optim.recent']
    # importing the learner imports them, as its last step
    assert set(teachloop.LEARNER_ADDITIONS) <= set(loaded('learner'))
    # within an addition's import that would be a cycle: the first learner made imports them
    first = loaded('callback.schedule')
    assert 'teachloop.learner' in first and 'teachloop.callback.checkpoint' not in first
    made = subprocess.run([sys.executable, '-c', FINGERPRINT.format(first='callback.schedule')
                           + LOADED.format(first='callback.schedule')], capture_output=True, text=True, check=True).stdout
    assert all(f"'{name}'" in made for name in teachloop.LEARNER_ADDITIONS)


def test_a_learner_unpickled_before_any_was_made_has_the_later_methods(tmp_path):
    "A learner loaded with torch.load in a fresh process, no learner made there: `fit_one_cycle` is still found."
    import torch
    from teachloop.data import DataLoaders
    from teachloop.learner import Learner
    learn = Learner(DataLoaders([], None), torch.nn.Linear(1, 1), torch.nn.functional.mse_loss, default_cbs=False)
    torch.save(learn, tmp_path / 'learn.pt')
    # teachloop.callback.core imports the learner within its own import: the learner's import loads no addition then
    script = (f"import torch, teachloop.callback.core, sys\n"
              f"learn = torch.load({str(tmp_path / 'learn.pt')!r}, weights_only=False)\n"
              "assert 'teachloop.callback.schedule' not in sys.modules\n"
              "print(learn.fit_one_cycle.__qualname__)")
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True)
    assert out.stdout.strip() == 'Learner.fit_one_cycle', out.stderr[-2000:]


# ---- the callbacks' protocol: a callback takes part in the engine by what its class declares

PROTOCOL = {'order', 'run_train', 'run_valid', 'observes', 'hypers_written', 'quieten', 'state_dict', 'load_state_dict',
            'check_state_dict', 'check_fit', 'name'}


def callback_classes():
    from teachloop.learner import Callback
    found = {Callback}
    for name in module_names():
        module = importlib.import_module(f'teachloop.{name}')
        found |= {v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Callback)}
    return found


def test_the_callback_base_declares_the_protocol():
    "What the engine asks of any callback (its order, phases, whether it only watches, what hyper-parameters it sets, "
    "whether it refuses a fit, how it goes quiet in a process other than the first, its saved state) is declared on "
    "`Callback`, with defaults that do nothing: the engine asks every callback the same way."
    from teachloop.learner import Callback
    assert PROTOCOL <= set(dir(Callback))
    cb = Callback()
    assert cb.quieten() is None and not cb.observes and cb.hypers_written() == {} and cb.state_dict() is None
    assert cb.check_fit() is None and cb.check_state_dict({}) is None and cb.load_state_dict({}) is None


def test_the_engine_reads_other_callbacks_only_through_what_their_classes_declare():
    "`getattr(cb, 'x', ...)` on a learner's callbacks reads a class-level declaration (a protocol attribute or one a "
    "callback class declares), never an instance attribute found by its name (`epoch_start`, `epochs_seen` once)."
    declared = {attr for cls in callback_classes() for attr in vars(cls)} | PROTOCOL
    read = set()
    for path in PACKAGE.rglob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ('getattr', 'hasattr')
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ('cb', 'c', 'callback')
                    and isinstance(node.args[1], ast.Constant)):
                read.add((path.relative_to(PACKAGE).as_posix(), node.args[1].value))
    callback_reads = {(p, a) for p, a in read if not p.startswith(('optim/', 'lessons/'))}  # there `cb` is an optimizer part
    assert all(a in declared for _, a in callback_reads), sorted((p, a) for p, a in callback_reads if a not in declared)
    for name in ('epoch_start', 'batch_boundary', 'epochs_seen'): assert name not in {a for _, a in callback_reads}


NOTEBOOK = """
import torch
from fastcore.basics import patch
import {first}
from teachloop.data import DataLoaders
from teachloop.learner import Callback, Learner, add_default_callbacks

class Recorder(Callback):  # a notebook's own version of a library class, as notebook 05 defines it
    order = 50
add_default_callbacks(Recorder)

@patch
def fit_one_cycle(self:Learner, n_epoch): return 'this notebook'  # as notebook 06 defines it

learn = Learner(DataLoaders([], None), torch.nn.Linear(1, 1), torch.nn.functional.mse_loss)
print(type(learn.recorder).__module__, learn.fit_one_cycle(1))
"""


# first: the learner, which imports the additions at once; or a module whose import imports it (the additions then
# load with the first learner made, after the notebook's own definitions, as notebook 06 imports)
@pytest.mark.parametrize('first', ['teachloop.data', 'teachloop.callback.core', 'teachloop.diagnostics.effective_lr'])
def test_a_notebooks_own_definitions_replace_the_librarys_whatever_loads_after_them(first):
    "A notebook imports the learner, then defines its module's callbacks and methods again: its own are the ones run."
    out = subprocess.run([sys.executable, '-c', NOTEBOOK.format(first=first)], capture_output=True, text=True)
    assert out.stdout.split() == ['__main__', 'this', 'notebook'], out.stderr[-2000:]


def test_every_module_that_adds_to_the_learner_is_named_in_the_package_root():
    "A module that patches `Learner` or adds a default callback must be in LEARNER_ADDITIONS: else what it adds would depend on the imports."
    adds = re.compile(r'self:\s*Learner\b|^add_default_callbacks\(', re.MULTILINE)
    found = {'teachloop.' + '.'.join(path.relative_to(PACKAGE).with_suffix('').parts) for path in PACKAGE.rglob('*.py')
             if path.stem not in ('learner', 'all', '_modidx') and adds.search(path.read_text())}
    assert found == set(teachloop.LEARNER_ADDITIONS)
