"""NaNCapture and replay_nan: the capture stops before the bad step with the right state, the replay reproduces it."""
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.data import DataLoaders, digits_cnn, digits_dls
from teachloop.learner import Callback, CancelFitException, Learner
from teachloop.callback import nan_capture
from teachloop.callback.nan_capture import (FiniteCheck, NaNCapture, grads_are_finite, load_capture, nonfinite_grads, replay_nan)
from teachloop.callback.checkpoint import Checkpoint
from teachloop.optim.core import SGD, Adam
from teachloop.optim.more import Lamb
from teachloop.testing import quiet


def per_class_loss(pred, target):
    onehot = F.one_hot(target, pred.shape[1]).float()
    per_class = F.binary_cross_entropy_with_logits(pred, onehot, reduction='none').sum(0)
    return (per_class / onehot.sum(0)).mean()


class Sqrt(nn.Module):
    "sqrt is finite at 0 but its gradient is not: NaN gradients from a finite loss."
    def forward(self, x): return torch.sqrt(x)


def dropout_sqrt_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.5), Sqrt(), nn.Linear(16, 10))


class EventNames(Callback):
    def __init__(self): self.events = []
    def after_cancel_fit(self): self.events.append('after_cancel_fit')
    def after_fit(self): self.events.append('after_fit')
    def after_step(self): self.events.append('after_step')


def test_grads_are_finite_matches_isfinite_and_leaves_grads_unchanged():
    grads = [torch.randn(5, 3), torch.randn(7)]
    copies = [g.clone() for g in grads]
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)  # the check's own tensors stay float32, as the kernel needs
        assert grads_are_finite([torch.ones(3)]) and not grads_are_finite([torch.tensor([1., float('nan')])])
    finally: torch.set_default_dtype(default)
    assert grads_are_finite(grads) and all(torch.equal(a, b) for a, b in zip(grads, copies))
    for bad in (float('nan'), float('inf'), -float('inf')):
        grads[1][4] = bad
        assert not grads_are_finite(grads)
    layer = nn.Linear(3, 2)
    layer.weight.grad, layer.bias.grad = torch.ones(2, 3), torch.tensor([0., float('inf')])
    assert nonfinite_grads(layer.named_parameters()) == ['bias']


def test_capture_stops_before_the_bad_step_with_the_weights_of_a_plain_loop(tmp_path):
    torch.manual_seed(0)
    init = digits_cnn()
    model = digits_cnn()
    model.load_state_dict(init.state_dict())
    log = EventNames()
    learn = quiet(Learner(digits_dls(bs=32), model, per_class_loss, opt_func=SGD, lr=0.05,
                          cbs=[NaNCapture(tmp_path / 'nan.pt'), log]))
    learn.fit(2)
    capture = load_capture(tmp_path / 'nan.pt')
    k = capture['train_iter']
    # an independent reference: torch.optim.SGD over the same batches, stopped before step k
    reference = digits_cnn()
    reference.load_state_dict(init.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    batches = [b for _, b in zip(range(k + 1), digits_dls(bs=32).train)]
    for x, y in batches[:k]:
        per_class_loss(reference(x), y).backward()
        opt.step(); opt.zero_grad()
    for a, b in zip(reference.parameters(), learn.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    x, y = batches[k]
    assert torch.equal(capture['batch'][0][0], x) and torch.equal(capture['batch'][1][0], y)
    assert not torch.isfinite(per_class_loss(reference(x), y)) and torch.bincount(y, minlength=10).min() == 0
    for name, value in learn.model.state_dict().items(): assert torch.equal(value, capture['model'][name])
    assert capture['weights_finite'] and set(capture['bad_params']) == {n for n, _ in model.named_parameters()}
    assert (capture['epoch'], capture['iter']) == divmod(k, len(learn.dls.train))
    assert log.events[-2:] == ['after_cancel_fit', 'after_fit'] and log.events.count('after_step') == k
    assert all(p.grad is None or (p.grad == 0).all() for p in learn.model.parameters())
    learn.loss_func = F.cross_entropy
    learn.fit(1)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters()) and learn.nan_capture.captured is None


def test_replay_reports_the_division_and_its_source_line(tmp_path):
    torch.manual_seed(0)
    dls = digits_dls(bs=32)
    quiet(Learner(dls, digits_cnn(), per_class_loss, cbs=[NaNCapture(tmp_path / 'nan.pt')])).fit(2)
    fresh = quiet(Learner(dls, digits_cnn(), per_class_loss))
    report = replay_nan(fresh, tmp_path / 'nan.pt')
    assert report.recurred and report.first_forward is None and report.first_backward == 'DivBackward0'
    assert 'per_class / onehot.sum(0)' in report.source and report.loss == float('inf')
    capture = load_capture(tmp_path / 'nan.pt')
    for name, value in fresh.model.state_dict().items(): assert torch.equal(value, capture['model'][name])
    assert all(p.grad is None for p in fresh.model.parameters()) and not fresh.model.training
    assert 'DivBackward0' in str(report)


def test_replay_restores_the_dropout_mask_and_finds_sqrt(tmp_path):
    torch.manual_seed(1)
    dls = digits_dls(bs=32)
    learn = quiet(Learner(dls, dropout_sqrt_model(), F.cross_entropy, cbs=[NaNCapture(tmp_path / 'nan.pt')]))
    learn.fit(1)
    capture = load_capture(tmp_path / 'nan.pt')
    assert np.isfinite(capture['loss'])
    torch.manual_seed(123)  # the replay must not depend on the current random state
    report = replay_nan(quiet(Learner(dls, dropout_sqrt_model(), F.cross_entropy)), tmp_path / 'nan.pt')
    assert report.recurred and report.loss == capture['loss']
    assert report.first_forward is None and report.first_backward == 'SqrtBackward0' and 'torch.sqrt' in report.source


def test_replay_finds_the_first_module_with_a_non_finite_output(tmp_path):
    class Log(nn.Module):
        def forward(self, x): return torch.log(x)
    def model(): return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), Log(), nn.Linear(16, 10))
    torch.manual_seed(0)
    dls = digits_dls(bs=32)
    quiet(Learner(dls, model(), F.cross_entropy, cbs=[NaNCapture(tmp_path / 'nan.pt')])).fit(1)
    report = replay_nan(quiet(Learner(dls, model(), F.cross_entropy)), tmp_path / 'nan.pt')
    assert report.recurred and report.first_forward == '3'


class NaNGradientAt(Callback):
    "Put a NaN into the gradient of parameter `name` (None: the first) at training step `step`, before NaNCapture (order 20) looks."
    order = 15
    def __init__(self, step, name=None): self.step, self.param_name = step, name
    def after_backward(self):
        if self.train_iter != self.step: return
        params = dict(self.model.named_parameters())
        params[self.param_name or next(iter(params))].grad.view(-1)[0] = float('nan')


@pytest.mark.parametrize('sync_free', [False, True])
@pytest.mark.parametrize('check_every, captured_at, weights_finite', [(1, 1, True), (3, 3, False)])
def test_check_every_checks_only_every_kth_step(tmp_path, check_every, captured_at, weights_finite, sync_free):
    torch.manual_seed(0)
    learn = quiet(Learner(digits_dls(bs=32), digits_cnn(), F.cross_entropy,
                          cbs=[NaNCapture(tmp_path / 'nan.pt', check_every=check_every, sync_free=sync_free), NaNGradientAt(1)]))
    learn.fit(1)
    capture = load_capture(tmp_path / 'nan.pt')
    assert capture['train_iter'] == captured_at and capture['weights_finite'] == weights_finite


def same_nested(a, b):
    "Equal nested dicts, lists and tuples of tensors and plain values."
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(map(same_nested, a, b))
    return a == b


class CancelFitAfterStep(Callback):
    "End the fit right after the optimizer step of training step `step` (after NaNCapture looked at it)."
    order = 30
    def __init__(self, step): self.step = step
    def after_step(self):
        if self.train_iter == self.step: raise CancelFitException()


class ValidBatches(Callback):
    def __init__(self): self.count = 0
    def after_batch(self): self.count += not self.training


def fit_with_nan_at(tmp_path, name, step, sync_free, cbs=(), valid=True):
    torch.manual_seed(0)
    dls = digits_dls(bs=32)
    if not valid: dls.valid = None
    learn = quiet(Learner(dls, digits_cnn(), F.cross_entropy, opt_func=Adam, lr=1e-3,
                          cbs=[NaNCapture(tmp_path / name, sync_free=sync_free), NaNGradientAt(step), ValidBatches(), *cbs]))
    learn.fit(2)
    return learn, load_capture(tmp_path / name)


@pytest.mark.parametrize('where', ['mid-epoch', 'last step before validation', 'last step, no validation',
                                   'fit cancelled after the step'])
def test_sync_free_capture_equals_the_waiting_capture_and_restores_the_weights(tmp_path, where):
    n_train = len(digits_dls(bs=32).train)
    step, extra, valid = {'mid-epoch': (5, (), True), 'last step before validation': (n_train - 1, (), True),
                          'last step, no validation': (n_train - 1, (), False),
                          'fit cancelled after the step': (5, (CancelFitAfterStep(5),), True)}[where]
    waiting, expected = fit_with_nan_at(tmp_path, 'wait.pt', step, False, valid=valid)
    learn, capture = fit_with_nan_at(tmp_path, 'free.pt', step, True, cbs=extra, valid=valid)
    assert capture['train_iter'] == expected['train_iter'] == step and capture['weights_finite']
    for key in ('model', 'opt', 'batch', 'rng', 'rng_read_at', 'epoch', 'iter', 'loss', 'bad_params'):
        assert same_nested(capture[key], expected[key]), key
    # the step went ahead with the NaN gradient, and the learner was put back to the weights before it
    assert same_nested(learn.model.state_dict(), waiting.model.state_dict())
    assert same_nested(learn.opt.state_dict(), waiting.opt.state_dict())
    assert learn.valid_batches.count == waiting.valid_batches.count == 0  # no validation on the broken weights


class WeightsAfterStep(Callback):
    "Copy the weights right after the optimizer step of training step `step`, once NaNCapture (order 20) has seen it."
    order = 25
    def __init__(self, step): self.step, self.weights = step, None
    def after_step(self):
        if self.train_iter == self.step: self.weights = {k: v.clone() for k, v in self.model.state_dict().items()}


def test_sync_free_undoes_a_bad_step_on_the_device_before_the_next_step(tmp_path):
    "The answer may arrive steps later on a GPU: meanwhile no step may run on the weights the bad step broke."
    seen = WeightsAfterStep(5)
    _, capture = fit_with_nan_at(tmp_path, 'nan.pt', 5, True, cbs=(seen,))
    assert same_nested(seen.weights, capture['model'])  # back to the weights before the step, NaN-free


class InterruptAfterBatch(Callback):
    "A Ctrl-C at the end of training step `step`, after every other callback's `after_batch`."
    order = 80
    def __init__(self, step): self.step = step
    def after_batch(self):
        if self.training and self.train_iter == self.step + 1: raise KeyboardInterrupt()


def test_sync_free_settles_a_pending_check_when_the_fit_is_interrupted(tmp_path):
    waiting, expected = fit_with_nan_at(tmp_path, 'wait.pt', 5, False)
    with pytest.raises(KeyboardInterrupt):
        fit_with_nan_at(tmp_path, 'free.pt', 5, True, cbs=(InterruptAfterBatch(5), Checkpoint(tmp_path / 'ck')))
    capture = load_capture(tmp_path / 'free.pt')
    assert same_nested(capture['model'], expected['model']) and capture['bad_params'] == expected['bad_params']
    interrupted = torch.load(tmp_path / 'ck' / 'interrupted.pt', weights_only=True)
    assert same_nested(interrupted['model'], waiting.model.state_dict())  # the checkpoint keeps the good weights


@pytest.mark.parametrize('sync_free', [False, True])
def test_parameters_of_several_dtypes_are_checked_in_one_go(tmp_path, sync_free):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.extra = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), nn.Parameter(torch.ones(2, dtype=torch.float64))
        def forward(self, x): return self.body(x) * self.extra.sum().float()
    torch.manual_seed(0)
    learn = quiet(Learner(digits_dls(bs=32), Mixed(), F.cross_entropy,
                          cbs=[NaNCapture(tmp_path / 'nan.pt', sync_free=sync_free), NaNGradientAt(3)]))
    learn.fit(1)
    capture = load_capture(tmp_path / 'nan.pt')
    assert capture['train_iter'] == 3 and capture['bad_params'] == ['extra'] and capture['weights_finite']  # the float64 one
    assert isinstance(learn.nan_capture._check, FiniteCheck)
    with pytest.raises(ValueError, match='sync_free'): NaNCapture(tmp_path / 'nan.pt', sync_free='yes')


@pytest.mark.cuda
def test_sync_free_check_never_makes_the_host_wait_on_the_gpu(tmp_path):
    "Any synchronising CUDA call inside the callback's per-step handlers raises, under torch's sync debug mode."
    class Strict(NaNCapture):
        def _strict(self, handler):
            torch.cuda.set_sync_debug_mode('error')
            try: handler()
            finally: torch.cuda.set_sync_debug_mode('default')
        # what the training step calls at each batch: the batch's start, the check before the step, the step's end
        def begin_batch(self, learn): self._strict(lambda: super(Strict, self).begin_batch(learn))
        def check(self, opt): self._strict(lambda: super(Strict, self).check(opt))
        def stepped(self): self._strict(lambda: super(Strict, self).stepped())
    torch.manual_seed(0)
    learn = quiet(Learner(digits_dls(bs=32), dropout_model(), F.cross_entropy, cbs=[Strict(tmp_path / 'nan.pt', check_every=2)]))
    learn.fit(2)
    assert learn.nan_capture._deferred_check is not None and learn.nan_capture.captured is None
    learn = quiet(Learner(digits_dls(bs=32), dropout_model(), F.cross_entropy,
                          cbs=[NaNCapture(tmp_path / 'nan.pt', check_every=2), NaNGradientAt(4)]))
    learn.fit(1)
    assert load_capture(tmp_path / 'nan.pt')['train_iter'] == 4
    assert all(bool(torch.isfinite(p).all()) for p in learn.model.parameters())


class NumpyScale(nn.Module):
    "Scales its input by factors drawn from numpy's global generator, from call `first_draw` on."
    def __init__(self, first_draw=0): super().__init__(); self.calls, self.first_draw = 0, first_draw
    def forward(self, x):
        self.calls += 1
        if self.calls <= self.first_draw: return x
        return x * torch.from_numpy(np.random.rand(x.shape[1])).to(x.device, x.dtype)


def numpy_model(first_draw=0):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), NumpyScale(first_draw), nn.Linear(16, 10))


def dropout_model(): return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 10))


def capture_at_step_3(tmp_path, model, rngs='auto'):
    "Fit with a NaN put into a gradient at training step 3; return the learner and the capture."
    torch.manual_seed(0)
    np.random.seed(0)
    learn = quiet(Learner(digits_dls(bs=32), model, F.cross_entropy,
                          cbs=[NaNCapture(tmp_path / 'nan.pt', rngs=rngs), NaNGradientAt(3)]))
    learn.fit(1)
    return learn, load_capture(tmp_path / 'nan.pt')


GENERATORS = ('torch', 'numpy', 'random')  # these tests run on the CPU (conftest), where no CUDA generator is read
DROPOUT_GENERATOR = 'torch'


@pytest.mark.parametrize('model, rngs, read_at_start', [
    (digits_cnn, 'auto', set()), (dropout_model, 'auto', {DROPOUT_GENERATOR}), (numpy_model, 'auto', {'numpy'}),
    (digits_cnn, 'every_step', set(GENERATORS))])
def test_auto_keeps_at_every_step_only_the_generators_the_first_step_drew_from(tmp_path, model, rngs, read_at_start):
    learn, capture = capture_at_step_3(tmp_path, model(), rngs)
    assert capture['train_iter'] == 3
    assert capture['rng_read_at'] == {name: 'start' if name in read_at_start else 'end' for name in GENERATORS}
    assert set(learn.nan_capture.step_rngs) == read_at_start


@pytest.mark.parametrize('model', [dropout_model, numpy_model])
def test_replay_of_a_step_drawing_random_numbers_is_exact(tmp_path, model):
    _, capture = capture_at_step_3(tmp_path, model())
    torch.manual_seed(5)
    np.random.seed(5)  # the replay must not depend on the current random states
    report = replay_nan(quiet(Learner(digits_dls(bs=32), model(), F.cross_entropy)), tmp_path / 'nan.pt')
    assert report.rng_exact and report.loss == capture['loss'] and not report.recurred  # the NaN was put in, not made


def test_replay_reports_a_generator_that_the_first_step_did_not_use(tmp_path):
    "numpy is drawn from the second step on: the first step's test misses it and the replay says so."
    _, capture = capture_at_step_3(tmp_path, numpy_model(first_draw=1))
    assert capture['rng_read_at']['numpy'] == 'end'
    report = replay_nan(quiet(Learner(digits_dls(bs=32), numpy_model(), F.cross_entropy)), tmp_path / 'nan.pt')
    assert not report.rng_exact and report.loss != capture['loss'] and "rngs='every_step'" in str(report)
    _, capture = capture_at_step_3(tmp_path, numpy_model(first_draw=1), rngs='every_step')
    report = replay_nan(quiet(Learner(digits_dls(bs=32), numpy_model(), F.cross_entropy)), tmp_path / 'nan.pt')
    assert report.rng_exact and report.loss == capture['loss']


def test_replay_refuses_files_that_do_not_fit(tmp_path):
    torch.manual_seed(0)
    dls = digits_dls(bs=32)
    quiet(Learner(dls, digits_cnn(), per_class_loss, cbs=[NaNCapture(tmp_path / 'nan.pt')])).fit(1)
    other = quiet(Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), per_class_loss))
    before = [p.clone() for p in other.model.parameters()]
    with pytest.raises(ValueError, match='do not fit this model'): replay_nan(other, tmp_path / 'nan.pt')
    assert all(torch.equal(a, b) for a, b in zip(before, other.model.parameters())) and other.opt is None
    torch.save({'model': {}}, tmp_path / 'other.pt')
    with pytest.raises(ValueError, match='not written by NaNCapture'): replay_nan(other, tmp_path / 'other.pt')
    (tmp_path / 'cut.pt').write_bytes((tmp_path / 'nan.pt').read_bytes()[:100])
    with pytest.raises(ValueError, match='could not read'): replay_nan(other, tmp_path / 'cut.pt')
    with pytest.raises(ValueError, match='check_every'): NaNCapture(tmp_path / 'x.pt', check_every=0)
    with pytest.raises(ValueError, match='rngs'): NaNCapture(tmp_path / 'x.pt', rngs=True)


@pytest.mark.parametrize('opt_func', [Adam, Lamb])
def test_sync_free_handles_0d_state(tmp_path, opt_func):
    "BatchNorm's step counter and LAMB's trust ratios are 0-d tensors: undoing a bad step must handle them."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 10))
    learn = quiet(Learner(digits_dls(bs=32), model, F.cross_entropy, opt_func=opt_func,
                          cbs=[NaNCapture(tmp_path / 'nan.pt', check_every=2, sync_free=True), NaNGradientAt(4)]))
    learn.fit(1)
    capture = load_capture(tmp_path / 'nan.pt')
    assert capture['train_iter'] == 4 and capture['weights_finite']
    # the forward passes of steps 0-3: the bad step's running statistics are put back with its weights, and no step
    # after the bad one ran
    assert int(model[1].num_batches_tracked) == 4
    assert all(bool(torch.isfinite(p).all()) for p in learn.model.parameters())


def test_a_capture_folder_gets_the_rank_of_the_fit_not_of_the_moment_the_callback_was_made(tmp_path):
    "Callbacks are often made before torch.distributed starts: the rank in the file name is read when the fit begins."
    import torch.distributed as dist
    (tmp_path / 'captures').mkdir()
    capture = NaNCapture(tmp_path / 'captures')
    assert capture.path == str(tmp_path / 'captures' / 'nan-capture.pt')
    dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        learn = quiet(Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, cbs=[capture, NaNGradientAt(2)]))
        learn.fit(1)
    finally: dist.destroy_process_group()
    assert sorted(p.name for p in (tmp_path / 'captures').iterdir()) == ['nan-capture-rank0.pt']
    assert load_capture(tmp_path / 'captures' / 'nan-capture-rank0.pt')['train_iter'] == 2


def test_a_capture_path_spoiled_after_the_callback_was_made_is_refused_before_the_first_step(tmp_path):
    "The folder replaced by a file between making the callback and the fit: refused in before_fit, no step taken."
    capture = NaNCapture(tmp_path / 'captures' / 'nan.pt')
    (tmp_path / 'captures').write_text('not a folder')
    learn = quiet(Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, cbs=[capture, NaNGradientAt(2)]))
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match='captures'): learn.fit(1)
    assert learn.train_iter == 0 and all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))


def test_a_replay_on_a_machine_with_fewer_gpus_says_so_in_its_report(tmp_path, monkeypatch):
    "A capture whose states were saved with 2 GPUs, replayed with none: the report is not exact and its notes say why."
    torch.manual_seed(0)
    learn = quiet(Learner(digits_dls(bs=32), dropout_sqrt_model(), F.cross_entropy,
                          cbs=[NaNCapture(tmp_path / 'nan.pt')]))
    learn.fit(1)
    capture = load_capture(tmp_path / 'nan.pt')
    capture['rng']['cuda'] = [torch.zeros(16, dtype=torch.uint8)] * 2  # as a machine with two GPUs would have written
    torch.save(capture, tmp_path / 'two-gpus.pt')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)
    with pytest.warns(UserWarning, match='saved with 2 GPU'):
        fresh = quiet(Learner(digits_dls(bs=32), dropout_sqrt_model(), F.cross_entropy))
        report = replay_nan(fresh, tmp_path / 'two-gpus.pt')
    assert report.recurred and not report.rng_exact
    assert any('saved with 2 GPU' in note for note in report.notes) and 'saved with 2 GPU' in str(report)


class NaNInputAt(Callback):
    "A NaN in the first input of training step `at` (counted from 0): its forward puts NaN into BatchNorm's statistics."
    order = -30
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.learn.training and self.learn.train_iter == self.at:
            x = self.learn.xb[0].clone()
            x[0] = float('nan')
            self.learn.xb = (x, *self.learn.xb[1:])


class StopBefore(Callback):
    "Stop the fit before training step `at` (counted from 0)."
    order = -30
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.learn.training and self.learn.train_iter == self.at: raise CancelFitException()


def batch_norm_learner(*cbs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    return quiet(Learner(digits_dls(bs=32), model, F.cross_entropy, opt_func=SGD, lr=0.1, default_cbs=False,
                         cbs=list(cbs)))


@pytest.mark.parametrize('sync_free', [False, True])
def test_a_capture_leaves_the_batchnorm_statistics_of_the_start_of_the_bad_batch(tmp_path, sync_free):
    "The bad batch's forward updated the running statistics with its NaN: the model and the file have them from before it."
    captured = batch_norm_learner(NaNInputAt(5), NaNCapture(tmp_path / 'nan.pt', sync_free=sync_free))
    captured.fit(1)
    stopped = batch_norm_learner(StopBefore(5))
    stopped.fit(1)
    assert captured.nan_capture.captured is not None
    expected = stopped.model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in captured.model.state_dict().items())
    capture = load_capture(tmp_path / 'nan.pt')
    assert capture['weights_finite'] and all(torch.equal(v, expected[k]) for k, v in capture['model'].items())


# ---- a non-finite gradient in any one parameter, the last layer's included

DIGITS_PARAMS = [name for name, _ in digits_cnn().named_parameters()]


@pytest.mark.parametrize('sync_free', [False, True])
def test_a_nan_in_any_one_parameter_is_caught_at_its_step(tmp_path, sync_free):
    "Each parameter poisoned alone: the capture names that step and that parameter, before any weight turned NaN."
    for name in DIGITS_PARAMS:
        torch.manual_seed(0)
        path = tmp_path / f'{name}.pt'
        learn = quiet(Learner(digits_dls(bs=32), digits_cnn(), F.cross_entropy, opt_func=SGD, lr=0.05,
                              cbs=[NaNCapture(path, sync_free=sync_free), NaNGradientAt(3, name)]))
        learn.fit(1)
        capture = load_capture(path)
        assert (capture['train_iter'], capture['bad_params']) == (3, [name]), name
        assert capture['weights_finite'] and all(torch.isfinite(p).all() for p in learn.model.parameters()), name


class LogGate(nn.Module):
    "`scale * log(x0)` where the first input `x0` is positive, 0 elsewhere."
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        first = x[:, :1]
        return torch.where(first > 0, self.scale * torch.log(first), 0.)


class GatedLog(nn.Module):
    """A small regression plus a `LogGate`, whose `scale` is the model's last parameter.

    An item with `x0 == 0` leaves the loss finite but makes the gradient of `gate.scale` NaN and no other: torch.where
    sends 0 to the branch it did not take, and 0 * log(0) is NaN.
    """
    def __init__(self):
        super().__init__()
        self.body, self.gate = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), LogGate()

    def forward(self, x): return self.body(x) + self.gate(x)


def gated_log_dls(zero_in_batch, bs=8, n_batches=6):
    "Positive inputs, except one item of training batch `zero_in_batch` whose first input is 0."
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(bs * n_batches, 4, generator=generator) + 0.5, torch.rand(bs * n_batches, 1, generator=generator)
    x[zero_in_batch * bs + 2, 0] = 0.
    return DataLoaders([(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)])


@pytest.mark.parametrize('sync_free', [False, True])
def test_a_nan_made_by_the_model_in_its_last_parameter_is_caught_and_replayed(tmp_path, sync_free):
    step = 3
    torch.manual_seed(0)
    learn = quiet(Learner(gated_log_dls(step), GatedLog(), F.mse_loss, opt_func=SGD, lr=0.01,
                          cbs=[NaNCapture(tmp_path / 'nan.pt', sync_free=sync_free)]))
    assert [name for name, _ in learn.model.named_parameters()][-1] == 'gate.scale'
    learn.fit(1)
    capture = load_capture(tmp_path / 'nan.pt')
    assert (capture['train_iter'], capture['bad_params']) == (step, ['gate.scale']) and np.isfinite(capture['loss'])
    assert capture['weights_finite'] and all(torch.isfinite(p).all() for p in learn.model.parameters())
    report = replay_nan(quiet(Learner(gated_log_dls(step), GatedLog(), F.mse_loss, opt_func=SGD)), tmp_path / 'nan.pt')
    assert report.recurred and report.bad_params == ['gate.scale'] and report.loss == capture['loss']
    assert report.first_forward is None  # every module's output was finite: only the gradient was not


@pytest.mark.parametrize('n_layers, listed', [(2, 'a.weight, a.bias, b.weight, b.bias'),
                                              (3, 'a.weight, a.bias, b.weight, b.bias ...')])
def test_the_capture_names_four_bad_parameters_and_says_when_there_are_more(tmp_path, capsys, n_layers, listed):
    "Four names, then ' ...' from a fifth: the 4 parameters of 2 layers all named, 5 (a third, bias-free) cut."
    model = nn.Sequential(OrderedDict((name, nn.Linear(2, 2, bias=name != 'c')) for name in 'abc'[:n_layers]))
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    x[0, 0] = float('nan')  # every gradient NaN
    learn = Learner(DataLoaders([(x, y)], None), model, F.mse_loss, lr=0.1, cbs=[NaNCapture(tmp_path)])
    learn.progress.show_bar = learn.progress.print_rows = False
    learn.fit(1)
    said = capsys.readouterr().out
    assert f"non-finite gradients in {listed} at epoch 0" in said
