"""Faults: seeds, NaN guards, clipping, interrupts (Ctrl-C, a Stop from another thread, errors at every event), bad input."""
import random
import signal
import threading
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.data import DataLoaders, digits_cnn, digits_dls
from teachloop.callback.faults import CheckBatch, GradientClipping, TerminateOnNaN
from teachloop.random_state import set_seed
from teachloop.learner import BATCH_EVENTS, EVENTS, Callback, CancelFitException, Learner
from teachloop.optim.core import SGD
from teachloop.testing import digits_learner, quiet


# the learner that `plain_sgd_weights` retraces by hand, step for step
sgd_learner = partial(digits_learner, opt_func=SGD, lr=0.05)


def state(learn):
    return ({k: v.clone() for k, v in learn.model.state_dict().items()}, learn.recorder.losses, learn.train_iter)


def same_weights(a, b): return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def plain_sgd_weights(steps, seed=0, lr=0.05):
    "Weights after `steps` steps of a hand-written loop with torch.optim.SGD over the same batches."
    set_seed(seed)
    model = digits_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    train = digits_dls().train
    batches = (b for _ in range(steps) for b in train)  # epoch after epoch, one shuffling generator
    for _ in range(steps):
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        opt.step(); opt.zero_grad()
    return model.state_dict()


# --- determinism -------------------------------------------------------------------------------------------------

def test_set_seed_gives_bitwise_equal_fits_and_seeds_every_generator():
    def fit(seed):
        learn = sgd_learner(seed=seed)
        learn.model = nn.Sequential(nn.Dropout(0.2), learn.model)  # randomness inside the steps too
        learn.fit(1)
        return learn.recorder.losses
    assert fit(3) == fit(3) and fit(3) != fit(4)
    set_seed(5)
    first = (random.random(), np.random.rand(), torch.rand(1))
    set_seed(5)
    assert first == (random.random(), np.random.rand(), torch.rand(1))
    with pytest.raises(TypeError, match='seed'): set_seed('5')


# --- NaN guards and clipping --------------------------------------------------------------------------------------

class NaNLossAt(Callback):
    "Make the loss NaN at training step `step` (before TerminateOnNaN, order 5, looks)."
    order = 0
    def __init__(self, step): self.step = step
    def after_loss(self):
        if self.training and self.train_iter == self.step:
            self.learn.loss_grad = self.loss_grad * float('nan')
            self.learn.loss = self.loss_grad.detach().clone()


def test_terminate_on_nan_stops_before_backward_with_good_weights():
    learn = sgd_learner()
    guard = TerminateOnNaN()
    learn.fit(2, cbs=[NaNLossAt(7), guard])
    assert guard.stopped_at == (0, 7) and learn.train_iter == 7
    assert same_weights(learn.model.state_dict(), plain_sgd_weights(7))


def test_terminate_on_nan_with_check_every_reads_late():
    learn = sgd_learner()
    guard = TerminateOnNaN(check_every=4)
    learn.fit(2, cbs=[NaNLossAt(5), guard])
    assert guard.stopped_at == (0, 7)  # steps 4..7 form one window, read at step 7
    with pytest.raises(ValueError, match='check_every'): TerminateOnNaN(check_every=0)


def test_gradient_clipping_scales_all_gradients_together():
    seen = {}
    class Before(Callback):
        order = 25
        def before_step(self): seen['before'] = [p.grad.clone() for p in self.model.parameters()]
    class After(Callback):  # the step clips after `before_step`: the gradients it stepped with are there in `after_step`
        def after_step(self):
            seen['after'] = [p.grad.clone() for p in self.model.parameters()]
            raise CancelFitException()
    learn = sgd_learner()
    learn.fit(1, cbs=[Before(), GradientClipping(0.01), After()])
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen['before']]))
    assert norm > 0.01
    for b, a in zip(seen['before'], seen['after']): torch.testing.assert_close(a, b * (0.01 / (norm + 1e-6)))
    with pytest.raises(ValueError, match='max_norm'): GradientClipping(0)


# --- interrupts ----------------------------------------------------------------------------------------------------

class RaiseAt(Callback):
    "Raise `exc()` at `event`: in training batch `at_iter` of epoch `at_epoch` for batch events, else the first time."
    def __init__(self, event, exc, at_epoch=0, at_iter=3):
        self.exc, self.at, self.fired, self.batch_event = exc, (at_epoch, at_iter), False, event in BATCH_EVENTS
        setattr(self, event, self._maybe_raise)
    def _maybe_raise(self):
        if self.fired or (self.batch_event and (not self.training or (self.epoch, self.iter) != self.at)): return
        self.fired = True
        raise self.exc()


def test_keyboard_interrupt_keeps_the_state_of_the_last_finished_batch_and_is_reraised():
    learn = sgd_learner()
    with pytest.raises(KeyboardInterrupt): learn.fit(2, cbs=[RaiseAt('before_batch', KeyboardInterrupt, 1, 4)])
    steps = len(learn.dls.train) + 4
    assert learn.train_iter == steps and len(learn.recorder.losses) == steps
    assert same_weights(learn.model.state_dict(), plain_sgd_weights(steps))
    assert not learn.model.training and all(p.grad is None for p in learn.model.parameters())
    assert not any(isinstance(cb, RaiseAt) for cb in learn.cbs)


def test_a_stop_from_another_thread_leaves_the_same_state_without_an_exception():
    "The learner-side mechanism: a flag set from another thread, checked before each batch, raises CancelFitException."
    class StopFlag(Callback):
        def __init__(self): self.requested = threading.Event()
        def before_batch(self):
            if self.training and self.epoch == 1 and self.iter == 4: self._ask_from_a_thread()
            if self.requested.is_set(): raise CancelFitException()
        def _ask_from_a_thread(self):
            t = threading.Thread(target=self.requested.set)
            t.start(); t.join()
    stopped = sgd_learner()
    stopped.fit(2, cbs=[StopFlag()])
    interrupted = sgd_learner()
    with pytest.raises(KeyboardInterrupt): interrupted.fit(2, cbs=[RaiseAt('before_batch', KeyboardInterrupt, 1, 4)])
    a, b = state(stopped), state(interrupted)
    assert same_weights(a[0], b[0]) and a[1:] == b[1:]


def test_the_dashboard_stop_from_its_thread():
    dashboard = pytest.importorskip('teachloop.dashboard.live')
    learn = sgd_learner()
    handles, started = [], threading.Event()
    class StopFromOutside(Callback):
        def before_batch(self):
            if self.training and self.epoch == 0 and self.iter == 6:
                started.wait(10)
                stopper = threading.Thread(target=handles[0].stop)
                stopper.start(); stopper.join(10)
    handles.append(dashboard.fit_background(learn, 2, cbs=[StopFromOutside()]))
    started.set()
    handle = handles[0]
    handle.wait(60)
    assert handle.error is None and learn.train_iter == 6 and len(learn.recorder.losses) == 6
    assert same_weights(learn.model.state_dict(), plain_sgd_weights(6))


def test_ctrl_c_inside_the_optimizer_step_waits_for_the_step_and_the_batch():
    learn = sgd_learner()
    learn.create_opt()
    real_step_param = learn.opt.step_param
    n_params, calls = len(list(learn.model.parameters())), []
    def step_param(p, hypers):
        real_step_param(p, hypers)
        calls.append(p)
        if len(calls) == 2 * n_params + 1: signal.raise_signal(signal.SIGINT)  # after one parameter of step 3
    learn.opt.step_param = step_param
    learn.opt.fast = False
    with pytest.raises(KeyboardInterrupt): learn.fit(1)
    assert len(calls) == 3 * n_params  # the third step updated every parameter, and there was no fourth
    assert learn.train_iter == 3 and len(learn.recorder.losses) == 3
    assert same_weights(learn.model.state_dict(), plain_sgd_weights(3))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


EVENTS_IN_A_FIT = [e for e in EVENTS if e not in ('after_create',) and not e.startswith('after_cancel')]


@pytest.mark.parametrize('event', EVENTS_IN_A_FIT)
def test_an_error_at_any_event_leaves_a_usable_learner(event):
    learn = sgd_learner()
    with pytest.raises(RuntimeError, match='boom') as info: learn.fit(2, cbs=[RaiseAt(event, lambda: RuntimeError('boom'))])
    assert any(event in note for note in getattr(info.value, '__notes__', []))
    assert not learn.model.training and all(p.grad is None for p in learn.model.parameters())
    assert len(learn.cbs) == 4 and all(torch.isfinite(p).all() for p in learn.model.parameters())
    learn.fit(1)
    assert len(learn.recorder.values) == 1 and learn.train_iter == len(learn.dls.train)


# --- bad input ------------------------------------------------------------------------------------------------------

def batch():
    return next(iter(digits_dls().train))


def test_nan_or_inf_in_the_input_batch():
    x, y = batch()
    for bad, word in ((float('nan'), '1 NaN'), (float('inf'), '1 infinite')):
        x_bad = x.clone()
        x_bad[2, 0, 1, 1] = bad
        learn = quiet(Learner(DataLoaders([(x, y), (x_bad, y)], None), digits_cnn(), F.cross_entropy, cbs=[CheckBatch()]))
        with pytest.raises(ValueError, match=f'input 0 of training batch 1 .*{word}'): learn.fit(1)


def test_labels_out_of_range():
    x, y = batch()
    y = y.clone()
    y[0] = 10
    learn = quiet(Learner(DataLoaders([(x, y)], None), digits_cnn(), F.cross_entropy))
    with pytest.raises(ValueError, match='out of bounds'): learn.fit(1)
    learn = quiet(Learner(DataLoaders([(x, y)], None), digits_cnn(), F.cross_entropy, cbs=[CheckBatch()]))
    with pytest.raises(ValueError, match=r'class indices in \[0, 9\].*labels from 0 to 10'): learn.fit(1)
    y[0] = -1
    with pytest.raises(ValueError, match='labels from -1'): learn.fit(1)


def test_model_on_another_device_than_the_data():
    x, y = batch()
    dls = DataLoaders([(x.to('meta'), y.to('meta'))], None)
    learn = Learner(dls, digits_cnn(), F.cross_entropy, default_cbs=False)
    with pytest.raises(RuntimeError) as info: learn.fit(1)
    assert any("model's parameters are on cpu, the batch's inputs on meta" in n for n in info.value.__notes__)
    learn = Learner(dls, digits_cnn(), F.cross_entropy, default_cbs=False, cbs=[CheckBatch()])
    with pytest.raises(ValueError, match='input 0 of the batch is on meta but the model is on cpu'): learn.fit(1)


def unchanged(learn, before):
    return same_weights(learn.model.state_dict(), before[0]) and learn.opt is before[1] and learn.recorder.losses == before[2]


def test_bad_fit_arguments_and_callbacks_change_nothing():
    learn = sgd_learner()
    learn.fit(1)
    before = ({k: v.clone() for k, v in learn.model.state_dict().items()}, learn.opt, learn.recorder.losses)
    check = CheckBatch()
    cases = [
        (lambda: learn.fit(0), ValueError, 'n_epoch must be a whole number >= 1'),
        (lambda: learn.fit(-2), ValueError, 'n_epoch'),
        (lambda: learn.fit(2.5), ValueError, 'n_epoch'),
        (lambda: learn.fit(1, lr='0.1'), TypeError, "hyper-parameter 'lr' must be a real number"),
        (lambda: learn.fit(1, lr=['x']), TypeError, "hyper-parameter 'lr' must be a real number"),
        (lambda: learn.fit(1, cbs=[CheckBatch]), TypeError, 'not an instance: pass `CheckBatch\\(\\)`'),
        (lambda: learn.fit(1, cbs=[check, check]), ValueError, 'already added'),
        (lambda: learn.fit(1, cbs=[CheckBatch(), CheckBatch()]), ValueError, "named 'check_batch' is already added"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text): call()
        assert unchanged(learn, before) and len(learn.cbs) == 4


def test_a_parameter_given_twice_to_the_optimizer():
    model = digits_cnn()
    with pytest.raises(ValueError, match='twice'): SGD([list(model.parameters()), [next(model.parameters())]], lr=0.1)
    learn = quiet(Learner(digits_dls(), model, F.cross_entropy, splitter=lambda m: [list(m.parameters())] * 2))
    with pytest.raises(ValueError, match='twice'): learn.fit(1)
    assert learn.opt is None


# ---- found by make mutate (tools/mutate.py): each test fails on the mutant it was written for

def segmentation_learner(labels, cbs):
    "A per-pixel classifier of 3 classes: scores (n, 3, 4, 4), one label per pixel."
    x = torch.randn(8, 1, 4, 4)
    dl = [(x, labels)]
    return quiet(Learner(DataLoaders(dl, dl), nn.Conv2d(1, 3, 1), F.cross_entropy, opt_func=SGD, lr=0.1, cbs=cbs))


def test_check_batch_reads_labels_per_pixel_and_any_range_inside_the_classes():
    "Scores of more than two dimensions are checked as well (class 3 of 3 refused), and labels from 1 to 2 are fine."
    bad = torch.randint(0, 3, (8, 4, 4))
    bad[0, 0, 0] = 3
    with pytest.raises(ValueError, match=r'labels must be class indices in \[0, 2\].*labels from 0 to 3'):
        segmentation_learner(bad, [CheckBatch()]).fit(1)
    segmentation_learner(torch.randint(1, 3, (8, 4, 4)), [CheckBatch()]).fit(1)  # no 0 in this batch: still in range


def test_terminate_on_nan_watches_the_training_loss_only():
    "A validation set with a NaN gives a NaN validation loss, which is reported, not a stop."
    x, y = torch.randn(16, 2), torch.randn(16, 1)
    valid_x = x[:8].clone()
    valid_x[0, 0] = float('nan')
    learn = quiet(Learner(DataLoaders([(x, y)], [(valid_x, y[:8])]), nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=0.1,
                          cbs=[TerminateOnNaN()]))
    learn.fit(3)
    assert learn.train_iter == 3 and len(learn.recorder.values) == 3 and np.isnan(learn.recorder.values[-1][2])


def test_gradient_clipping_by_default_clips_the_global_norm_to_1():
    "fastai's GradientClip default: max_norm 1, the 2-norm of all gradients together."
    norms = []
    class Norm(Callback):
        def after_step(self): norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()]))
    x, y = torch.randn(16, 2) * 100, torch.randn(16, 1) * 100  # a large loss: gradients far above norm 1
    learn = quiet(Learner(DataLoaders([(x, y)], None), nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=1e-6,
                          cbs=[GradientClipping(), Norm()]))
    learn.fit(2)
    assert len(norms) == 2 and all(abs(float(n) - 1.) < 1e-5 for n in norms)  # float32: the norm's rounding, 1e-7 x 100
