"""The public API a user of their own model meets first is typed: every parameter and return of it is annotated, the
annotations resolve at run time (`typing.get_type_hints`, as editors and `help()` read them), and a type checker run
on a user's script accepts what works and flags what does not.

To a static checker the methods that later notebooks add with `@patch` (fit, fit_one_cycle, get_preds, export, ...)
are reached through `Learner.__getattr__`, so it types them as `Any`: their annotations are checked here at run time."""
import importlib
import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module -> the names in it (methods as `Class.method`; a method another module adds is listed under that module)
API = {
    'teachloop.data': ['DataLoaders.__init__', 'load_digits_tensors', 'split_by_seed', 'tensor_dls', 'digits_dls',
                       'mnist_dls', 'digits_cnn', 'noisy_parabola', 'regression_2d', 'regression_dls'],
    'teachloop.optim.core': ['SGD', 'RMSProp', 'Adam', 'spread_hyper', 'Optimizer.__init__', 'Optimizer.step',
                             'Optimizer.set_hyper', 'Optimizer.hypers', 'Optimizer.state_dict',
                             'Optimizer.load_state_dict', 'Optimizer.clear_state'],
    'teachloop.optim.interop': ['OptimWrapper.__init__', 'OptimWrapper.step', 'OptimWrapper.zero_grad',
                                'OptimWrapper.set_hyper', 'OptimWrapper.hypers', 'OptimWrapper.param_groups',
                                'OptimWrapper.decouple_wd', 'OptimWrapper.state_dict', 'OptimWrapper.load_state_dict',
                                'split_at'],
    'teachloop.learner': ['Learner.__init__', 'Learner.fit', 'Learner.validate', 'Learner.get_preds',
                          'Learner.predict', 'Learner.save', 'Learner.load', 'Learner.freeze', 'Learner.freeze_to',
                          'Learner.unfreeze', 'Learner.add_cbs', 'Learner.remove_cbs', 'Learner.added_cbs',
                          'Learner.create_opt', 'Learner.stop', 'Learner.__getattr__', 'default_splitter', 'callback_list',
                          'Callback.name', 'Callback.quieten', 'Callback.hypers_written', 'Callback.state_dict'],
    'teachloop.callback.core': ['DeviceCallback.__init__', 'accuracy', 'AccumMetric.__init__', 'AccumMetric.value',
                                'AccumMetric.__call__', 'Recorder.__init__', 'Recorder.losses',
                                'Recorder.smooth_losses', 'ProgressCallback.__init__', 'MixedPrecision.__init__',
                                'GradientAccumulation.__init__'],
    'teachloop.callback.loggers': ['CSVLogger.__init__', 'CSVLogger.read_log', 'TensorBoardLogger.__init__',
                                   'read_scalars', 'ShowGraph.__init__', 'ShowGraph.draw'],
    'teachloop.callback.schedule': ['Learner.fit_one_cycle', 'Learner.fit_flat_cos', 'Learner.fit_sgdr',
                                    'Learner.lr_find', 'Stepper.__init__', 'ParamScheduler.__init__',
                                    'LRSchedulerCallback.__init__', 'LRFinder.__init__'],
    'teachloop.inference': ['Learner.export', 'load_learner', 'InferenceLearner.__init__',
                            'InferenceLearner.get_preds', 'InferenceLearner.predict'],
}
CASES = [(module, name) for module, names in API.items() for name in names]


def function(module, name):
    "The function behind `name` in `module` (a property's getter, a context manager's generator function)."
    obj = importlib.import_module(module)
    for part in name.split('.'): obj = inspect.getattr_static(obj, part)
    return obj.fget if isinstance(obj, property) else obj


def untyped(fn):
    "The parameters of `fn` without an annotation (`self` of a method defined in its class apart), and 'return'."
    sig = inspect.signature(fn)
    missing = [n for i, (n, p) in enumerate(sig.parameters.items())
               if p.annotation is inspect.Parameter.empty and not (i == 0 and n == 'self')]
    return missing + (['return'] if sig.return_annotation is inspect.Signature.empty else [])


@pytest.mark.parametrize('module, name', CASES, ids=[f'{m.rsplit(".", 1)[-1]}.{n}' for m, n in CASES])
def test_every_parameter_and_the_return_are_typed_and_resolve(module, name):
    fn = function(module, name)
    assert untyped(fn) == [], f"{module}.{name}: not annotated: {untyped(fn)}"
    hints = typing.get_type_hints(fn)  # a name undefined at run time raises here
    assert set(inspect.signature(fn).parameters) - {'self'} <= set(hints) and 'return' in hints


def test_every_method_users_call_on_a_learner_from_these_modules_is_listed():
    for module in API: importlib.import_module(module)
    from teachloop.learner import Learner
    listed = {name.split('.', 1)[1] for names in API.values() for name in names if name.startswith('Learner.')}
    public = {name for name, value in vars(Learner).items() if not name.startswith('_') and callable(value)
              and getattr(value, '__module__', None) in API}
    assert public - listed <= {'exclusive', 'reserve_for', 'release'}  # for callbacks and background fits
    assert all(untyped(getattr(Learner, name)) == [] for name in public)


def test_every_callbacks_constructor_in_these_modules_is_typed():
    from teachloop.learner import Callback
    found = []
    for module in map(importlib.import_module, API):
        for name in module.__all__:
            cls = getattr(module, name)
            if isinstance(cls, type) and issubclass(cls, Callback) and '__init__' in vars(cls):
                found.append(cls.__name__)
                assert untyped(cls.__init__) == [], f"{cls.__name__}.__init__: not annotated: {untyped(cls.__init__)}"
                typing.get_type_hints(cls.__init__)
    assert {'Recorder', 'MixedPrecision', 'GradientAccumulation', 'CSVLogger', 'TensorBoardLogger', 'ShowGraph',
            'ParamScheduler', 'LRSchedulerCallback', 'LRFinder'} <= set(found)


def test_the_types_say_which_kinds_a_parameter_takes():
    from teachloop.learner import Learner
    from teachloop.optim.core import HyperValue
    import teachloop.callback.schedule  # noqa: F401  (adds fit_one_cycle)
    assert typing.get_type_hints(Learner.__init__)['lr'] == HyperValue
    assert {float, slice} < set(typing.get_args(HyperValue))
    assert typing.get_type_hints(Learner.fit_one_cycle)['lr_max'] == HyperValue | None


# A user's script. A line ending in `# wrong` must be flagged by the checker, every other line accepted.
SCRIPT = '''
from functools import partial
from pathlib import Path

import torch
from torch import nn

from teachloop.callback.core import AccumMetric, GradientAccumulation, MixedPrecision, accuracy
from teachloop.callback.loggers import CSVLogger, ShowGraph
from teachloop.callback.schedule import LRSchedulerCallback, ParamScheduler, annealing_cos
from teachloop.data import DataLoaders, tensor_dls
from teachloop.inference import InferenceLearner, load_learner
from teachloop.learner import Learner
from teachloop.optim.core import SGD, Adam
from teachloop.optim.interop import OptimWrapper


def rmse(pred: torch.Tensor, target: torch.Tensor) -> float:
    return ((pred - target) ** 2).mean().sqrt().item()


x, y = torch.randn(64, 2), torch.randint(0, 2, (64,))
dls: DataLoaders = tensor_dls(x, y, bs=16, shuffle_seed=1)
model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
learn = Learner(dls, model, nn.functional.cross_entropy, opt_func=partial(SGD, mom=0.9), lr=slice(1e-3, 1e-2),
                metrics=[accuracy, AccumMetric(rmse, dim_argmax=-1)], splitter=lambda m: [list(m.parameters())],
                cbs=[CSVLogger(Path('history.csv')), GradientAccumulation(32), MixedPrecision(torch.bfloat16)])
Learner(dls, model, nn.CrossEntropyLoss(), opt_func=torch.optim.AdamW, lr=[1e-3], n_inp=1)
Learner(dls, model, nn.functional.cross_entropy, opt_func=partial(OptimWrapper, opt=torch.optim.SGD, momentum=0.9))
learn.fit_one_cycle(1, lr_max=1e-2, cbs=ShowGraph('losses.png'))
preds, targets = learn.get_preds()
decoded, probs = learn.predict(x[0])
path: Path = learn.export('model.pt2', vocab=['no', 'yes'])
inference: InferenceLearner = load_learner(path)
name, p = inference.predict(x[0])
preds, targets = inference.get_preds(dls.train)
opt = Adam(model.parameters(), lr=1e-3)
opt.set_hyper('lr', [1e-3])
LRSchedulerCallback(torch.optim.lr_scheduler.StepLR, step_size=2, step='epoch')
ParamScheduler({'lr': partial(annealing_cos, 1e-2, 1e-4)})

tensor_dls(x, y, bs='16')  # wrong
Learner(x, model, nn.functional.cross_entropy)  # wrong
Learner(dls, model, nn.functional.cross_entropy, lr='fast')  # wrong
Learner(dls, model, nn.functional.cross_entropy, cbs=CSVLogger())  # wrong
load_learner(path, trust='yes')  # wrong
inference.predict('an image')  # wrong
Adam(model.parameters(), lr=slice(1e-3, 1e-2))  # wrong
MixedPrecision(dtype='bfloat16')  # wrong
LRSchedulerCallback(torch.optim.lr_scheduler.StepLR, step='batches')  # wrong
CSVLogger(append='no')  # wrong
'''


def test_a_type_checker_accepts_a_users_script_and_flags_its_mistakes(tmp_path):
    "basedpyright (pyright with its Node runtime in the wheel), in pyright's standard mode, on the checkout."
    (tmp_path / 'user.py').write_text(SCRIPT)
    config = {'include': ['user.py'], 'typeCheckingMode': 'standard', 'pythonVersion': '3.10',
              'extraPaths': [str(ROOT)]}  # the checkout's teachloop, with its py.typed
    (tmp_path / 'pyrightconfig.json').write_text(json.dumps(config))
    checker = Path(sys.executable).parent / 'basedpyright'
    assert checker.exists(), "the type checker is in the dev extra: pip install -e '.[dev]'"
    done = subprocess.run([str(checker), '--outputjson', '--pythonpath', sys.executable, '-p', str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    errors = {d['range']['start']['line'] + 1: d['message'] for d in report['generalDiagnostics']
              if d['severity'] == 'error'}
    lines = SCRIPT.splitlines()
    wrong = {i for i, line in enumerate(lines, 1) if line.endswith('# wrong')}
    assert not set(errors) - wrong, {i: (lines[i - 1], errors[i]) for i in set(errors) - wrong}
    assert not wrong - set(errors), [lines[i - 1] for i in sorted(wrong - set(errors))]
