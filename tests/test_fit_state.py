"""The fit's state has one owner (`learn.fit_state`): what a resume needs is saved whole and given back whole.

Each test here is a defect that the earlier design had (the state spread over callbacks), checked by behaviour: a fit
interrupted and resumed equals the fit that never stopped, bit for bit, in float64.
"""
import csv
import gc
import io
import multiprocessing
import os
import random
import signal
import threading
import warnings
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from teachloop.callback.checkpoint import Checkpoint, read_checkpoint
from teachloop.callback.core import GradientAccumulation, Recorder
from teachloop.callback.loggers import CSVLogger
from teachloop.callback.tracker import EarlyStopping
from teachloop.data import DataLoaders
from teachloop.learner import Callback, Learner
from teachloop.optim.core import SGD
from teachloop.random_state import set_seed
from teachloop.testing import quiet

pytestmark = pytest.mark.numeric


def data(n=48, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = torch.tanh(x @ torch.tensor([1., -2., 0.5, 3.], dtype=torch.float64))[:, None]
    return x, y


class NumpyAugmented(Dataset):
    "Items with noise from numpy's and Python's global generators, drawn as each item is read (in this process)."
    def __init__(self, x, y): self.x, self.y = x, y
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        noise = np.random.normal(size=self.x.shape[1]) * 0.1 + random.gauss(0, 0.01)
        return self.x[i] + torch.from_numpy(noise), self.y[i]


class TorchAugmented(NumpyAugmented):
    "Items with noise from torch's generator (in a worker process: the worker's stream)."
    def __getitem__(self, i): return self.x[i] + 0.1 * torch.randn(self.x.shape[1], dtype=torch.float64), self.y[i]


def learner(*cbs, dataset=NumpyAugmented, bs=8, loader_args=None, dropout=0.25, seed=0):
    "A float64 MLP with dropout on 32 augmented items (4 batches of 8), shuffled by a generator of its own."
    set_seed(seed)
    x, y = data()
    train = DataLoader(dataset(x[:32], y[:32]), batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(2),
                       **(loader_args or {}))
    dls = DataLoaders(train, DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 1)).double()
    return quiet(Learner(dls, model, F.mse_loss, opt_func=SGD, lr=0.05, cbs=list(cbs)))


class CtrlCAt(Callback):
    "A Ctrl-C (SIGINT to this process) during the backward of training step `at`, counted from 1 over the fit."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.learn.train_iter + 1 == self.at: os.kill(os.getpid(), signal.SIGINT)


def same_fit(a, b):
    weights = all(torch.equal(p, q) for p, q in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    rows = [r[:-1] for r in a.recorder.values] == [r[:-1] for r in b.recorder.values]
    return weights and rows and a.recorder.losses == b.recorder.losses


def interrupted_and_resumed(at, tmp_path, **kwargs):
    "The fit of 3 epochs stopped by a Ctrl-C at step `at`, and the fit resumed from its `interrupted.pt`."
    first = learner(Checkpoint(tmp_path), **kwargs)
    with pytest.raises(KeyboardInterrupt), redirect_stdout(io.StringIO()): first.fit(3, cbs=[CtrlCAt(at)])
    resumed = learner(Checkpoint(tmp_path / 'again'), **kwargs)
    resumed.fit(3, resume=tmp_path / 'interrupted.pt')
    return read_checkpoint(tmp_path / 'interrupted.pt'), resumed


def test_a_ctrl_c_in_an_epochs_last_training_batch_resumes_exactly(tmp_path):
    "The interruption lands after the epoch's training and before its validation: a resume runs that validation."
    whole = learner()
    whole.fit(3)
    state, resumed = interrupted_and_resumed(4, tmp_path)  # 4 batches an epoch: the first epoch's last
    assert state['progress']['resumable'] and (state['progress']['epochs_done'], state['progress']['batches_done']) == (0, 4)
    assert same_fit(resumed, whole)


@pytest.mark.parametrize('at', [2, 6])
def test_a_mid_epoch_resume_draws_numpy_and_python_augmentation_again(tmp_path, at):
    "The skipped batches draw their noise from numpy and `random` again, from the epoch's start, so the next ones match."
    whole = learner()
    whole.fit(3)
    state, resumed = interrupted_and_resumed(at, tmp_path)
    assert state['progress']['batches_done'] == (at - 1) % 4 + 1 and same_fit(resumed, whole)


def test_a_step_that_draws_from_numpy_is_followed_at_every_batch(tmp_path):
    "A callback drawing from numpy inside the step (not the data): numpy's state is noted at every batch boundary."
    class NumpyNoise(Callback):
        def after_backward(self):
            for p in self.model.parameters(): p.grad.add_(torch.from_numpy(np.random.normal(size=p.shape)) * 1e-3)
    whole = learner(NumpyNoise(), dataset=TensorDataset)
    whole.fit(3)
    first = learner(NumpyNoise(), Checkpoint(tmp_path), dataset=TensorDataset)
    with pytest.raises(KeyboardInterrupt), redirect_stdout(io.StringIO()): first.fit(3, cbs=[CtrlCAt(6)])
    assert 'numpy' in read_checkpoint(tmp_path / 'interrupted.pt')['rng'][0]
    resumed = learner(NumpyNoise(), Checkpoint(tmp_path / 'again'), dataset=TensorDataset)
    resumed.fit(3, resume=tmp_path / 'interrupted.pt')
    assert same_fit(resumed, whole)


@pytest.mark.slow
@pytest.mark.parametrize('at', [5, 6])
def test_persistent_workers_with_augmentation_resume_exactly(tmp_path, at):
    "Workers that live across epochs keep their streams; each epoch's streams start from a seed the checkpoint keeps."
    args = dict(dataset=TorchAugmented, loader_args=dict(num_workers=2, persistent_workers=True))
    whole = learner(**args)
    whole.fit(3)
    _, resumed = interrupted_and_resumed(at, tmp_path, **args)  # 5: from the second epoch's end; 6: in its middle
    assert same_fit(resumed, whole)


@pytest.mark.slow
def test_the_persistent_workers_of_a_learner_exit_when_it_is_collected(monkeypatch):
    "Collected with the learner (a cycle), their queues could go first: each worker stopped only after torch's wait."
    # torch waits this long for a worker that did not hear it should stop (5 s each): here past the test's time limit
    monkeypatch.setattr(torch.utils.data._utils, 'MP_STATUS_CHECK_INTERVAL', 3600.)
    before = set(multiprocessing.active_children())
    learn = learner(dataset=TorchAugmented, loader_args=dict(num_workers=2, persistent_workers=True))
    learn.fit(1)
    workers, held, collected = set(multiprocessing.active_children()) - before, [learn], threading.Event()
    del learn
    def collect():
        held.clear()
        gc.collect()  # returns once the workers have ended (torch's own wait, in a finalizer, swallows a test's timeout)
        collected.set()
    threading.Thread(target=collect, daemon=True).start()
    assert collected.wait(60) and len(workers) == 2 and not any(w.is_alive() for w in workers)  # 60 s: a net for a hang


def test_a_float64_fit_is_recorded_in_float64():
    "The epoch's training loss is the batch losses' mean in the fit's own precision, not rounded to float32."
    learn = learner(dataset=TensorDataset, dropout=0.)
    learn.fit(1)
    losses = torch.tensor(learn.recorder.losses, dtype=torch.float64)
    assert abs(learn.recorder.values[0][1] - losses.mean().item()) < 1e-15


class Stream(IterableDataset):
    "A stream of batches with no length (a DataLoader over it has no `len()` either)."
    def __iter__(self):
        x, y = data()
        return iter(zip(x[:32].split(8), y[:32].split(8)))


def test_a_loader_over_an_iterable_data_set_without_a_length_trains():
    set_seed(0)
    x, y = data()
    dls = DataLoaders(DataLoader(Stream(), batch_size=None), DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8))
    learn = quiet(Learner(dls, nn.Linear(4, 1).double(), F.mse_loss, opt_func=SGD, lr=0.05))
    learn.fit(2)
    assert learn.train_iter == 8 and len(learn.recorder.values) == 2 and learn.pct_train == 0.
    with pytest.raises(ValueError, match='len'): learn.fit(1, cbs=[GradientAccumulation(16)])  # refused: no last batch


def test_the_epoch_at_which_early_stopping_stops_is_logged(tmp_path):
    "EarlyStopping asks the fit to stop once every callback has heard the epoch's end: the loggers have its row."
    learn = learner(dataset=TensorDataset)
    def score(pred, target): return torch.tensor([0.5, 0.6, 0.7, 0.8][learn.epoch])
    learn.metrics = [score]
    stopper, out = EarlyStopping('score', 'min', patience=1), io.StringIO()
    learn.progress.print_rows = True
    with redirect_stdout(out): learn.fit(4, cbs=[stopper, CSVLogger(tmp_path / 'log.csv')])
    rows = list(csv.DictReader(open(tmp_path / 'log.csv')))
    assert stopper.stopped_epoch == 1 and [r['epoch'] for r in rows] == ['0', '1'] and len(learn.recorder.values) == 2
    assert len([line for line in out.getvalue().splitlines() if line.split() and line.split()[0] in '01']) == 2


def test_an_undeclared_writer_of_a_scheduled_rate_is_refused_before_the_first_step():
    "A user's callback setting lr every batch beside fit_one_cycle: refused naming both, nothing trained, lr as before."
    class MyRate(Callback):
        def before_batch(self): self.opt.set_hyper('lr', 0.01)
    learn = learner(dataset=TensorDataset)
    learn.create_opt()
    weights, lr = [p.clone() for p in learn.model.parameters()], learn.opt.hypers[0]['lr']
    with pytest.raises(ValueError, match="both set 'lr'") as refusal: learn.fit_one_cycle(1, 0.1, cbs=[MyRate()])
    said = str(refusal.value)
    assert 'MyRate (in `before_batch`, undeclared)' in said and 'ParamScheduler (in `before_batch`, declared' in said
    assert '`MyRate.hypers_written()`' in said and learn.train_iter == 0
    assert all(map(torch.equal, weights, learn.model.parameters())) and learn.opt.hypers[0]['lr'] == lr


def test_a_callback_that_keeps_a_count_without_a_state_is_named_when_a_fit_resumes(tmp_path):
    class CountSteps(Callback):
        def before_fit(self): self.count = 0
        def after_step(self): self.count += 1
    first = learner(CountSteps(), Checkpoint(tmp_path))
    with pytest.raises(KeyboardInterrupt), redirect_stdout(io.StringIO()): first.fit(2, cbs=[CtrlCAt(5)])
    resumed = learner(CountSteps(), Checkpoint(tmp_path / 'again'))
    with pytest.warns(UserWarning, match=r"CountSteps keeps attributes .*count was 5 and is 0"):
        resumed.fit(2, resume=tmp_path / 'interrupted.pt')
    with warnings.catch_warnings():  # without it, nothing to say
        warnings.simplefilter('error')
        learner(Checkpoint(tmp_path / 'third')).fit(2, resume=tmp_path / 'interrupted.pt')


def test_a_validation_asked_for_by_a_callback_inside_a_fit_leaves_the_fit_as_it_was():
    "`learn.validate()` from a callback (after a training batch, after an epoch) runs its phase; the fit goes on the same."
    from teachloop.data import regression_2d

    x, y = regression_2d(n=24)
    x, y = x.double(), y.double()
    loaders = DataLoaders([(x[:8], y[:8]), (x[8:16], y[8:16])], [(x[16:], y[16:])])

    class ValidateInside(Callback):
        def before_fit(self): self.results, self.seen = [], []
        def before_batch(self):
            state = self.learn.fit_state
            self.seen.append((state.fitting, state.phase, state.training, self.model.training, self.iter))
        def after_batch(self):
            if self.training and self.iter == 0: self.results.append(self.learn.validate())
        def after_epoch(self):
            if self.epoch == 0: self.results.append(self.learn.validate())

    def fit(*cbs):
        torch.manual_seed(0)
        learn = Learner(loaders, nn.Linear(2, 1).double(), F.mse_loss, opt_func=SGD, lr=0.1, cbs=list(cbs))
        learn.progress.show_bar = learn.progress.print_rows = False
        learn.fit(3)
        return learn

    plain, watched = fit(), fit(inside := ValidateInside())
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), watched.model.parameters()))
    assert plain.recorder.losses == watched.recorder.losses
    assert plain.recorder.values[-1][1:3] == watched.recorder.values[-1][1:3]
    assert len(inside.results) == 4 and watched.train_iter == 6 and not watched.fit_state.fitting
    training = [seen for seen in inside.seen if seen[2]]  # every training batch, in the fit's own phase and mode
    assert len(training) == 6 and all(seen[:2] == (True, 'train') and seen[3] for seen in training)


def test_a_validation_of_another_loader_inside_a_fit_leaves_the_fits_own_rows_alone():
    """A callback that validates another loader inside the fit, in the middle of the fit's own validation or after an
    epoch before the Recorder writes its row, gets that loader's values; the fit's rows stay its own validation's, with
    an averaged and an accumulating (whole-set) metric."""
    from teachloop.callback.core import AccumMetric
    from teachloop.data import regression_2d

    x, y = regression_2d(n=24)
    x, y = x.double(), y.double()
    loaders = DataLoaders([(x[:8], y[:8]), (x[8:16], y[8:16])], [(x[16:20], y[16:20]), (x[20:], y[20:])])
    def mean_error(pred, target): return (pred - target).abs().mean()
    def worst_error(pred, target): return (pred - target).abs().max()

    class ValidateElsewhere(Callback):
        def before_fit(self): self.results = []
        def after_batch(self):  # the first batch of the fit's own validation
            if not self.training and self.iter == 0 and not self.learn.fit_state.nested:
                self.results.append(self.learn.validate(loaders.train))
        def after_epoch(self): self.results.append(self.learn.validate(loaders.train))  # order 0: before the Recorder

    def fit(*cbs):
        torch.manual_seed(0)
        learn = quiet(Learner(loaders, nn.Linear(2, 1).double(), F.mse_loss, opt_func=SGD, lr=0.1, cbs=list(cbs),
                              metrics=[mean_error, AccumMetric(worst_error, flatten=False)]))
        learn.fit(3)
        return learn

    plain, watched = fit(), fit(elsewhere := ValidateElsewhere())
    rows = lambda learn: [row[:-1] for row in learn.recorder.values]  # all but the seconds
    assert rows(watched) == rows(plain) and len(elsewhere.results) == 6
    # the callback got the training loader's values: a loss of its own, not the epoch's validation loss
    assert all(result[0] != row[2] for result, row in zip(elsewhere.results[1::2], rows(plain)))


def test_a_validation_inside_a_fit_leaves_the_phases_progress_bar_counting():
    "A callback's validation in the middle of a training phase gets no bar of its own; the phase's bar counts on."
    from teachloop.data import regression_2d

    x, y = regression_2d(n=24)
    loaders = DataLoaders([(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)], [(x[16:], y[16:])])

    class ValidateAtBatchOne(Callback):
        def after_batch(self):
            if self.training and self.iter == 1: self.learn.validate()

    class ReadTheBar(Callback):
        order = 61  # after the progress callback's after_batch
        def before_fit(self): self.counts = []
        def after_batch(self):
            bar = self.learn.progress.bar
            if self.training: self.counts.append(None if bar is None else bar.n)

    learn = Learner(loaders, nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=0.01,
                    cbs=[ValidateAtBatchOne(), read := ReadTheBar()])
    learn.progress.print_rows = False
    with redirect_stdout(io.StringIO()): learn.fit(2)
    assert read.counts == [1, 2, 3, 4] * 2  # before: None from the validation on (it closed the phase's bar)
