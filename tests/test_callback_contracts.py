"""The contracts every callback the library exports keeps, checked for all of them at once.

Each exported callback (a subclass of `Callback` in the `__all__` of a teachloop module) is described once, in
`CALLBACKS`: how to make one for a test, whether it only observes the fit, what it keeps that a resumed fit must give
back, and what it does when two processes train together. One battery runs over every description:

1. an observer leaves a fit bit for bit as it was without it: weights, BatchNorm buffers, the optimizer's state,
   torch's, numpy's and Python's random states and the training loader's generator, on a model with BatchNorm and on
   one without;
2. a fit interrupted by a Ctrl-C from a callback, with a Checkpoint, and resumed with `fit(n, resume=path)` (where it
   stopped, in the middle of an epoch, or from the end of the epoch before) equals the uninterrupted fit: weights,
   BatchNorm buffers, optimizer state, the Recorder's history and the callback's own state (`state` below);
3. under two processes (gloo, forked) the fit works, both ranks ending with the same weights, those of one process
   with the global batch (an observer: also those of the same fit without it), or it is refused before it starts,
   with a message, in both.

Every fit is a small seeded model in float64 (a Linear layer, BatchNorm or not, ReLU, dropout, so that the fit draws
from torch's generator, and a Linear head) on a shuffling loader with its own `torch.Generator`.

`teachloop.designs` is left out: its modules rebuild other libraries' callback systems on the Learner (fastai v1's
handler, Gluon's estimator, event filters) to compare designs in the appendix notebooks, which pin their behaviour
down in their own tests (test_callbacks_v1, test_gluon_handlers, ...); they are exhibits, not callbacks offered for a
fit.
"""
import contextlib
import importlib
import math
import os
import pkgutil
import signal
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import teachloop
import teachloop.all  # noqa: F401  (every notebook's Learner methods added)
from teachloop.callback.schedule_free import BatchNormAtAverage
from teachloop.callback.core import (DeviceCallback, GradientAccumulation, MixedPrecision,
                                 ProgressCallback, Recorder)
from teachloop.callback.checkpoint import Checkpoint
from teachloop.callback.loggers import CSVLogger, ShowGraph, TensorBoardLogger, read_scalars
from teachloop.callback.tracker import EarlyStopping, ReduceLROnPlateau, SaveModel, TrackerCallback
from teachloop.dashboard.live import TrainingDashboard
from teachloop.dashboard.controls import SteeringCallback
from teachloop.data import DataLoaders
from teachloop.callback.distributed import PoisonBatch, run_ranks
from teachloop.diagnostics.effective_lr import EffectiveLRTracker
from teachloop.callback.faults import CheckBatch, GradientClipping, TerminateOnNaN
from teachloop.diagnostics.layer_stats import LayerStats
from teachloop.learner import Callback, EventLog, GatherPreds, Learner
from teachloop.callback.nan_capture import NaNCapture
from teachloop.optim.core import SGD
from teachloop.lessons.race import StepTimer
from teachloop.random_state import loader_generators, rng_states, same_state, set_seed
from teachloop.optim.recent import ScheduleFreeSGD
from teachloop.callback.schedule import LRFinder, LRSchedulerCallback, ParamScheduler, annealing_cos
from teachloop.diagnostics.sharpness import Sharpness

SGD_MOM = partial(SGD, mom=0.9)


# ---- what a callback keeps, as values to compare

def same(a, b):
    "Whether `a` and `b` are equal to the bit: tensors (dtype too), numbers (nan equals nan), and what holds them."
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict): return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b): return True
    return type(a) is type(b) and a == b


def recorder_history(learn):
    "The Recorder's history: batch losses, hyper-parameters, epoch rows without their wall time."
    recorder = learn.recorder
    return {'losses': recorder.losses, 'hps': dict(recorder.hps), 'values': [row[:-1] for row in recorder.values]}


def tracked(cb): return cb.state_dict()


def saved_and_tracked(cb):
    "A SaveModel's tracking and the weights in its file."
    return {**cb.state_dict(), 'file': torch.load(cb.path, weights_only=True)}


def epoch_files(cb): return sorted(p.name for p in cb.folder.glob('epoch-*.pt'))


def mixed_precision_state(cb): return {**cb.state_dict(), 'skipped': cb.skipped}


def sharpness_estimates(cb): return {'steps': cb.steps, 'sharpness': cb.sharpness, 'thresholds': cb.thresholds}


def layer_ticks(cb):
    return [(tick['step'], [(e['layer'], e['mean'], e['std'], e['grad_std'], e['hist']) for e in tick['layers']],
             tick['weights']) for tick in cb.ticks]


def dashboard_curves(cb):
    "The dashboard's curves, each as (steps, values)."
    series = {**cb.series, **{f'{name}/{group}': s for (name, group), s in cb.hyper_series.items()}}
    return {name: (torch.from_numpy(s.x.copy()), torch.from_numpy(s.y.copy())) for name, s in series.items()}


def csv_rows(cb):
    "The rows of a CSVLogger's file, without their wall time."
    return [{k: v for k, v in row.items() if k != 'time'} for row in cb.read_log()]


def event_scalars(cb): return read_scalars(cb.run_dir)  # every scalar of the run, as TensorBoard reads them


def drawn_lines(cb): return [line.get_xydata().tolist() for line in cb.fig.axes[0].lines]


# ---- the descriptions

@dataclass
class Described:
    "How the suite makes and checks one exported callback class."
    make: Callable = None  # folder -> a new callback for a test; None: the library makes it itself (see `why`)
    observes: object = False  # True: leaves the fit as it was; 'without BatchNorm': on a model without one only
    state: Callable = None  # callback -> what a resumed fit must give back; None: nothing outlives the fit's call
    resumes: object = True  # True: the resume battery runs it; else why it does not
    two_processes: str = 'works'  # 'works', 'refused' (before the fit, with a message), or why it is not run
    opt_func: Callable = SGD_MOM  # the optimizer of its fits
    companions: Callable = None  # folder -> other callbacks its fits need
    why: str = ''  # why it has no `make`
    known: dict = field(default_factory=dict)  # battery -> a defect outside these files that makes it fail


class InfAtStep(Callback):
    "An infinite gradient at training step `at` (counted from 0), before MixedPrecision unscales and checks it."
    order = 5
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.train_iter == self.at: next(self.model.parameters()).grad.view(-1)[0] = float('inf')


CALLBACKS = {
    'TrainEvalCallback': Described(why="every learner has one: every fit of the suite runs it"),
    'StepSetting': Described(why="the base of the callbacks that set the training step's parts, each described here"),
    'DeviceCallback': Described(lambda folder: DeviceCallback(), observes=True),
    'GatherPreds': Described(lambda folder: GatherPreds(), observes=True),
    'EventLog': Described(lambda folder: EventLog(), observes=True),  # the events of its own fit call
    'Recorder': Described(lambda folder: Recorder(), observes=True, state=lambda cb: recorder_history(cb.learn)),
    'ProgressCallback': Described(lambda folder: ProgressCallback(), observes=True),
    'MixedPrecision': Described(lambda folder: MixedPrecision(torch.float16), state=mixed_precision_state,
                                companions=lambda folder: [InfAtStep(2)]),  # a skipped step, and a lowered scale
    # Schedule-Free SGD: an Adam would divide the rounding noise that is the gradient of the bias before BatchNorm by
    # its own size, and two processes' sums of it, in another order than one process's, would part by 1e-9
    'BatchNormAtAverage': Described(lambda folder: BatchNormAtAverage(n_batches=2), observes='without BatchNorm',
                                    opt_func=ScheduleFreeSGD),
    # two batches of 8 a step: the resume battery's Ctrl-C in the middle of an epoch comes between two steps
    'GradientAccumulation': Described(lambda folder: GradientAccumulation(16)),  # its state is the training step's
    'ParamScheduler': Described(lambda folder: ParamScheduler({'lr': partial(annealing_cos, 0.05, 0.005)}),
                                state=lambda cb: cb.hps),
    # torch's OneCycleLR stepped every batch, momentum cycled too, as long as the fit (the view's groups in its state)
    'LRSchedulerCallback': Described(lambda folder: LRSchedulerCallback(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.05),
                                     state=tracked),
    'LRFinder': Described(lambda folder: LRFinder(num_it=6), two_processes='refused',
                          resumes="lr_find runs it and restores the learner afterwards: a range test is run again, "
                                  "never resumed"),
    'EffectiveLRTracker': Described(lambda folder: EffectiveLRTracker(every=2), observes=True,
                                    state=lambda cb: cb.history),
    'Sharpness': Described(lambda folder: Sharpness(every=2, power_iters=3), observes=True, state=sharpness_estimates),
    'LayerStats': Described(lambda folder: LayerStats(every=2), observes=True, state=layer_ticks),
    'NaNCapture': Described(lambda folder: NaNCapture(folder / 'nan-capture.pt'), observes=True),
    'Resume': Described(why="`fit(resume=...)` makes it: the resume battery runs it with every callback"),
    'Checkpoint': Described(lambda folder: Checkpoint(folder / 'checkpoints', keep=1), observes=True,
                            state=epoch_files),
    'TrackerCallback': Described(lambda folder: TrackerCallback('valid_loss', 'min'), observes=True, state=tracked),
    # it ends the fit with the best epoch's weights, loaded from its file
    'SaveModel': Described(lambda folder: SaveModel('valid_loss', 'min', folder / 'best.pt'), state=saved_and_tracked),
    # never better by 1e9: best after the first epoch, stopped after the third with the first epoch's weights
    'EarlyStopping': Described(lambda folder: EarlyStopping('valid_loss', 'min', patience=2, min_delta=1e9),
                               state=tracked),
    'ReduceLROnPlateau': Described(lambda folder: ReduceLROnPlateau('valid_loss', 'min', patience=1, factor=0.5,
                                                                    min_delta=1e9), state=tracked),
    'TerminateOnNaN': Described(lambda folder: TerminateOnNaN(), observes=True, two_processes='refused'),
    'GradientClipping': Described(lambda folder: GradientClipping(max_norm=0.1)),
    'CheckBatch': Described(lambda folder: CheckBatch(), observes=True),
    'DistributedTrainer': Described(why="`learn.distributed()` makes it: the two-process battery runs it with every "
                                  "callback (alone it refuses the fit, see test_distributed)"),
    # a NaN in rank 0's batch at step 8, after the resume battery's interruptions: NaNCapture stops the fit there
    'PoisonBatch': Described(lambda folder: PoisonBatch(rank=0, at=8),
                             companions=lambda folder: [NaNCapture(folder / 'nan-capture.pt')]),
    'StepTimer': Described(lambda folder: StepTimer(), observes=True),  # the wall time of its own fit call
    'SteeringCallback': Described(lambda folder: SteeringCallback(), observes=True),  # requests belong to their call
    'TrainingDashboard': Described(lambda folder: TrainingDashboard(live=False), observes=True, state=dashboard_curves),
    'CSVLogger': Described(lambda folder: CSVLogger(folder / 'history.csv'), observes=True, state=csv_rows),
    # written every 3 batches: the resume battery's interruptions fall between two writes
    'TensorBoardLogger': Described(lambda folder: TensorBoardLogger(folder / 'runs', every=3), observes=True,
                                   state=event_scalars),
    'ShowGraph': Described(lambda folder: ShowGraph(folder / 'losses.png', refresh=0), observes=True, state=drawn_lines),
}


# ---- the fits

def small_model(batch_norm, dropout=0.25):
    "A seeded MLP in float64: Linear, BatchNorm (or not), ReLU, dropout, Linear."
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if batch_norm else []) + [nn.ReLU(), nn.Dropout(dropout),
                                                                                 nn.Linear(8, 1)]
    return nn.Sequential(*layers).double()


def small_dls(bs=8):
    "32 training items (4 batches of `bs` 8), shuffled by a generator of their own, and 16 validation items."
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(48, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1., -2., 0.5, 3.], dtype=torch.float64) + 0.1 * torch.randn(48, generator=generator,
                                                                                      dtype=torch.float64)
    train = DataLoader(TensorDataset(x[:32], y[:32, None]), batch_size=bs, shuffle=True,
                       generator=torch.Generator().manual_seed(2))
    return DataLoaders(train, DataLoader(TensorDataset(x[32:], y[32:, None]), batch_size=8))


def small_learner(name, folder, batch_norm=True, with_it=True, extra=(), bs=8, dropout=0.25):
    "The learner of a fit of the suite for callback `name` (`with_it`: the callback itself too; a Recorder always)."
    described = CALLBACKS[name]
    set_seed(0)
    model = small_model(batch_norm, dropout)
    cbs = [] if name == 'Recorder' else [Recorder()]
    cbs += described.companions(folder) if described.companions else []
    cbs += [described.make(folder)] if with_it else []
    learn = Learner(small_dls(bs), model, F.mse_loss, opt_func=described.opt_func, lr=0.02, default_cbs=False,
                    cbs=cbs + list(extra))
    for cb in learn.cbs:  # the suite checks what fits leave, not what they show
        if isinstance(cb, ProgressCallback): cb.show_bar = False
    return learn


def described_callback(learn, name):
    return next(cb for cb in learn.cbs if type(cb).__name__ == name)


def case(name, battery, *values, id=None):
    "The pytest parameter of `name` (and `values`) in `battery`, xfail(strict) where its description knows a defect there."
    known = CALLBACKS[name].known.get(battery)
    return pytest.param(name, *values, id=id or name, marks=[pytest.mark.xfail(strict=True, reason=known)] if known else [])


# ---- every exported callback is described

def exported_callbacks():
    "`{class name: module}` of the Callback subclasses in teachloop's modules' `__all__`, and those of `teachloop.designs`."
    found, designs = {}, {}
    for module in pkgutil.walk_packages(teachloop.__path__, 'teachloop.'):
        loaded = importlib.import_module(module.name)
        for name in getattr(loaded, '__all__', ()):
            obj = getattr(loaded, name)
            if isinstance(obj, type) and issubclass(obj, Callback) and obj is not Callback:
                # by the class's own name (fastai's `EarlyStoppingCallback` is a function that makes an `EarlyStopping`)
                (designs if obj.__module__.startswith('teachloop.designs') else found).setdefault(obj.__name__, obj.__module__)
    return found, designs


def test_every_exported_callback_is_described():
    exported, designs = exported_callbacks()
    missing = sorted(set(exported) - set(CALLBACKS))
    assert not missing, f"describe these callbacks in CALLBACKS: {missing}"
    assert set(CALLBACKS) <= set(exported), f"described but not exported: {sorted(set(CALLBACKS) - set(exported))}"
    assert designs and not set(designs) & set(CALLBACKS)  # the historical designs are left out (see the docstring)


def test_a_callback_that_says_it_observes_is_checked_as_an_observer():
    "`Callback.observes` lets a resume leave the callback out: the battery must check that it changes nothing."
    exported, _ = exported_callbacks()
    said = {name for name, module in exported.items() if getattr(importlib.import_module(module), name).observes}
    assert said and not {name for name in said if CALLBACKS[name].observes is not True}


@pytest.mark.parametrize('name', sorted(CALLBACKS))
def test_each_description_is_complete(name, tmp_path):
    described = CALLBACKS[name]
    assert described.make is not None or described.why
    assert described.observes in (True, False, 'without BatchNorm')
    assert described.resumes is True or (isinstance(described.resumes, str) and described.resumes)
    assert described.two_processes in ('works', 'refused') or described.make is None
    assert set(described.known) <= {'observes', 'resumes', 'two processes'}
    if described.make is not None:
        assert type(described.make(tmp_path)).__name__ == name


# ---- 1. an observer leaves the fit as it was

def fit_outcome(learn, n_epoch=3):
    "Fit, then everything an observer must leave as it would be without it."
    learn.fit(n_epoch)
    return {'model': learn.model.state_dict(), 'opt': learn.opt.state_dict(),
            'loader': [g.get_state() for g in loader_generators(learn.dls.train)], 'rng': rng_states()}


def assert_same_outcome(with_it, without):
    model, other = with_it['model'], without['model']
    assert model.keys() == other.keys()
    for key in model: assert torch.equal(model[key], other[key]), key  # weights and BatchNorm buffers
    assert same(with_it['opt']['state'], without['opt']['state'])
    assert same(with_it['loader'], without['loader']), "the training loader's generator moved"
    for generator in ('torch', 'numpy', 'random'):
        assert same_state(with_it['rng'][generator], without['rng'][generator]), f"{generator}'s random state moved"


OBSERVERS = [case(name, 'observes', batch_norm, id=f"{name}-{'batchnorm' if batch_norm else 'no-batchnorm'}")
             for name in sorted(CALLBACKS) for batch_norm in (False, True)
             if CALLBACKS[name].observes is True or (CALLBACKS[name].observes and not batch_norm)]


@pytest.mark.numeric
@pytest.mark.parametrize('name, batch_norm', OBSERVERS)
def test_an_observer_leaves_the_fit_bit_for_bit_as_it_was(name, batch_norm, tmp_path):
    without = fit_outcome(small_learner(name, tmp_path / 'without', batch_norm, with_it=False))
    with_it = fit_outcome(small_learner(name, tmp_path / 'with', batch_norm))
    assert_same_outcome(with_it, without)


# ---- 2. a resumed fit equals the uninterrupted one

class CtrlCAt(Callback):
    "A Ctrl-C (SIGINT to this process) during the backward of training step `at`, counted from 1 over the fit."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.learn.train_iter + 1 == self.at: os.kill(os.getpid(), signal.SIGINT)


def checkpoint_folder(learn):
    return next(cb for cb in learn.cbs if isinstance(cb, Checkpoint)).folder


def resumable_learner(name, folder):
    "The learner of `name`'s fits with a Checkpoint (its own, when it is the described one)."
    learn = small_learner(name, folder)
    if not any(isinstance(cb, Checkpoint) for cb in learn.cbs): learn.add_cbs([Checkpoint(folder / 'checkpoints')])
    return learn


def outcome_with_state(learn, name):
    described = CALLBACKS[name]
    cb = described_callback(learn, name)
    return {'model': learn.model.state_dict(), 'opt': learn.opt.state_dict(), 'history': recorder_history(learn),
            'state': described.state(cb) if described.state else None}


# With 4 training steps an epoch: a Ctrl-C in the 5th step (the first batch of the second epoch), which stops the fit
# once that batch is whole, resumed where it stopped; one in the 6th step, resumed from the end of the first epoch.
ROUTES = {'mid-epoch': (5, 'interrupted.pt'), 'from the end of an epoch': (6, 'epoch-001.pt')}
RESUMABLE = [case(name, 'resumes', route, id=f'{name}-{route}') for name in sorted(CALLBACKS) for route in ROUTES
             if CALLBACKS[name].make is not None and CALLBACKS[name].resumes is True]


@pytest.mark.numeric
@pytest.mark.parametrize('name, route', RESUMABLE)
def test_a_resumed_fit_equals_the_uninterrupted_one(name, route, tmp_path):
    at, file = ROUTES[route]
    whole = resumable_learner(name, tmp_path / 'whole')
    whole.fit(3)
    first = resumable_learner(name, tmp_path / 'run')
    with pytest.raises(KeyboardInterrupt): first.fit(3, cbs=[CtrlCAt(at)])
    second = resumable_learner(name, tmp_path / 'run')
    second.fit(3, resume=checkpoint_folder(second) / file)
    expected, got = outcome_with_state(whole, name), outcome_with_state(second, name)
    for key in expected['model']: assert torch.equal(got['model'][key], expected['model'][key]), key
    assert same(got['opt'], expected['opt']), "optimizer state"
    assert same(got['history'], expected['history']), "the Recorder's history"
    assert same(got['state'], expected['state']), f"{name}'s state"


class RaiseInsideBatch(Callback):
    "A KeyboardInterrupt raised after the backward of training step `at` (not a Ctrl-C: nothing holds it back)."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.learn.train_iter + 1 == self.at: raise KeyboardInterrupt


@pytest.mark.numeric
def test_an_exception_inside_a_batch_resumes_from_the_batchnorm_statistics_of_its_start(tmp_path):
    whole = resumable_learner('Recorder', tmp_path / 'whole')
    whole.fit(3)
    first = resumable_learner('Recorder', tmp_path / 'run')
    with pytest.raises(KeyboardInterrupt): first.fit(3, cbs=[RaiseInsideBatch(6)])
    second = resumable_learner('Recorder', tmp_path / 'run')
    second.fit(3, resume=checkpoint_folder(second) / 'interrupted.pt')
    assert all(map(torch.equal, second.model.parameters(), whole.model.parameters()))  # the weights
    expected, got = whole.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(got[key], expected[key]) for key in expected)


# ---- 3. two processes

def two_process_names(): return [name for name in sorted(CALLBACKS) if CALLBACKS[name].make is not None]


def distributed_fit(name, folder, with_it=True, world_size=2):
    "In a rank: the fit of `name` (or the same without it) on this rank's shard of every global batch of 8."
    # without dropout: each rank draws its masks from the same seed, one process draws one mask for all 8 items
    learn = small_learner(name, folder, with_it=with_it, bs=8 // world_size, dropout=0.)
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    try:
        with learn.distributed(sync_bn=True): learn.fit(2)
    except ValueError as refusal:
        unchanged = same(before, learn.model.state_dict()) and learn.opt is None
        return {'refused': str(refusal), 'unchanged': unchanged}
    except BaseException as e:
        e.add_note(f"(in the two-process fit of {name})")
        raise
    history = recorder_history(learn) if any(isinstance(cb, Recorder) for cb in learn.cbs) else None
    return {'model': {k: v.clone() for k, v in learn.model.state_dict().items()}, 'history': history}


def fits_in_each_rank(folder):
    "Every described callback's fit in this rank, and for each observer the same fit without it."
    results = {}
    for name in two_process_names():
        results[name] = distributed_fit(name, folder / name, True)
        if CALLBACKS[name].observes is True:
            results[name]['without'] = distributed_fit(name, folder / name / 'without', with_it=False)
    return results


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    return run_ranks(fits_in_each_rank, tmp_path_factory.mktemp('ranks'), world_size=2, start_method='fork',
                     timeout=150)


TWO_PROCESSES = [case(name, 'two processes') for name in two_process_names()]


@pytest.mark.ranks
@pytest.mark.numeric
@pytest.mark.timeout(200)
@pytest.mark.parametrize('name', TWO_PROCESSES)
def test_under_two_processes_the_fit_works_or_is_refused_before_it_starts(name, two_ranks, tmp_path):
    rank0, rank1 = two_ranks[0][name], two_ranks[1][name]
    if CALLBACKS[name].two_processes == 'refused':
        for rank in (rank0, rank1): assert rank.get('refused') and rank['unchanged'], rank
        return
    assert 'refused' not in rank0 and 'refused' not in rank1, rank0.get('refused')
    for key in rank0['model']: assert torch.equal(rank0['model'][key], rank1['model'][key]), key
    assert same(rank0['history'], rank1['history'])
    # the fit of one process with the global batch: its items' gradients summed in another order, 1e-16 a step
    alone = distributed_fit(name, tmp_path, world_size=1)
    for key in rank0['model']: assert (rank0['model'][key] - alone['model'][key]).abs().max() < 1e-10, key
    if CALLBACKS[name].observes is True:
        for key in rank0['model']: assert torch.equal(rank0['model'][key], rank0['without']['model'][key]), key
        if rank0['without']['history'] is not None: assert same(rank0['history'], rank0['without']['history'])


class StopRequestedInRankZero(Callback):
    "What a dashboard does in the process that shows it: a slider moved and a pause at step 1, the stop button `at`."
    order = 80
    def __init__(self, at): self.at = at  # ('train', steps done) or ('valid', the epoch whose validation)
    def after_batch(self):
        if torch.distributed.get_rank() != 0: return
        controls = self.learn.steering.controls
        if self.training and self.train_iter == 1: controls.set_hyper('lr', 0.5); controls.pause()
        if (('train', self.train_iter) if self.training else ('valid', self.epoch)) == self.at: controls.stop()


def stop_requested_in_rank_zero(folder, at):
    learn = small_learner('SteeringCallback', folder, bs=4, extra=[StopRequestedInRankZero(at)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with learn.distributed(sync_bn=True): learn.fit(3)  # BatchNorm's statistics alike in both ranks too
    said = sorted({str(w.message).split(':')[0] for w in caught if 'several processes train together' in str(w.message)})
    return learn.train_iter, learn.model.state_dict(), learn.opt.hypers[0]['lr'], said


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.timeout(600)  # safety nets for a hang (as run_ranks's below), minutes long: a busy machine is only slower
@pytest.mark.parametrize('at, steps', [(('train', 2), 4), (('valid', 0), 4)])
def test_a_stop_requested_in_one_rank_stops_every_rank_after_the_same_batch(at, steps, tmp_path):
    "Requested after step 2, the stop rides with the next message (the epoch's last step, the 4th); requested during"
    " the first validation, the ranks agree on it at that epoch's end (after the 4th step), as they do at every epoch's end."
    (steps0, model0, lr0, said0), (steps1, model1, lr1, said1) = run_ranks(
        partial(stop_requested_in_rank_zero, at=at), tmp_path, world_size=2, start_method='fork', timeout=300)
    assert steps0 == steps1 == steps
    assert all(torch.equal(model0[k], model1[k]) for k in model0) and lr0 == lr1 == 0.02  # the slider's lr: in no rank
    assert said0 == ['a pause is not applied while several processes train together',
                     "hyper-parameter requests {'lr'"] and said1 == []
