"The standard callbacks: what the Recorder records, BatchNorm statistics at the average, gradient accumulation."
import copy
import math
import os
import signal
from functools import partial

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from teachloop.callback.schedule_free import BatchNormAtAverage
from teachloop.callback.core import (AccumMetric, DeviceCallback, GradientAccumulation, MixedPrecision, Recorder,
                                 format_row, hypers_read, smooth_values, smoothing_window)
from teachloop.callback.checkpoint import Checkpoint, read_checkpoint
from teachloop.data import DataLoaders
from teachloop.callback.faults import GradientClipping
from teachloop.optim.interop import OptimWrapper
from teachloop.learner import CancelBatchException, Callback, Learner
from teachloop.optim.core import SGD, Adam
from teachloop.random_state import rng_states, same_state, set_seed
from teachloop.optim.recent import ScheduleFreeAdamW
from teachloop.testing import digits_learner, tiny_dls, tiny_learner


def fitted(opt_func):
    learn = tiny_learner(Recorder(), opt_func=opt_func)
    learn.fit(1)
    return learn


@pytest.mark.parametrize('opt_func, recorded', [
    (SGD, {'lr', 'wd'}),  # `mom` is an argument of SGD, but without momentum no callback reads it
    (lambda params, lr: SGD(params, lr=lr, mom=0.9), {'lr', 'mom', 'wd'}),
    (Adam, {'lr', 'mom', 'sqr_mom', 'eps', 'wd'}),
])
def test_recorder_records_only_the_hypers_the_optimizer_reads(opt_func, recorded):
    learn = fitted(opt_func)
    assert set(learn.recorder.hps) == recorded == hypers_read(learn.opt)
    assert all(len(values) == 2 for values in learn.recorder.hps.values())
    axs = learn.recorder.plot_sched()
    assert [ax.get_title() for ax in axs.flat] == ['lr', 'mom'][:1 + ('mom' in recorded)]
    assert tuple(axs.flat[0].figure.get_size_inches()) == (4. * axs.size, 3.)  # 4 inches a panel
    plt.close('all')


def test_recorder_records_the_rates_of_the_last_group_the_head():
    "With discriminative rates (a slice over two groups), the recorded rate is the head's, as fastai's Recorder keeps."
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    learn = Learner(tiny_dls(), model, F.mse_loss, opt_func=SGD, default_cbs=False, cbs=[Recorder()],
                    splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
    learn.fit(1, lr=slice(1e-3, 1e-2))
    assert [h['lr'] for h in learn.opt.hypers] == [1e-3, 1e-2] and learn.recorder.hps['lr'] == [1e-2, 1e-2]


def test_the_epoch_tables_row_right_aligns_numbers_and_gives_the_time_in_seconds():
    assert format_row([1, 0.5, 0.25, 12.34], [5, 9, 9, 9]) == '    1   0.500000   0.250000       12.3s'


def test_recorder_records_every_hyper_of_a_torch_optimizer():
    learn = fitted(lambda params, lr: OptimWrapper(params, opt=torch.optim.SGD, lr=lr))
    assert 'mom' in learn.recorder.hps and learn.recorder.hps['lr'] == [0.1, 0.1]



def test_an_epoch_without_validation_has_a_whole_row_of_nans_for_the_loss_and_each_metric(tmp_path):
    "Every row lines up with `metric_names`, as the printed table and the CSV log read it."
    def mae(pred, target): return (pred - target).abs().mean()
    def mse(pred, target): return ((pred - target) ** 2).mean()
    learn = tiny_learner(default_cbs=True, dls=tiny_dls(valid=False), metrics=[mae, mse])
    learn.fit(2)
    assert learn.recorder.metric_names == ['epoch', 'train_loss', 'valid_loss', 'mae', 'mse', 'time']
    for epoch, row in enumerate(learn.recorder.values):
        assert len(row) == 6 and row[0] == epoch and math.isfinite(row[1]) and all(map(math.isnan, row[2:5]))


def test_plot_loss_saves_its_figure_and_smooths_by_the_fits_length(tmp_path):
    "A script sees nothing of a pyplot figure: `path` writes it. 69 batches are averaged over 2, not the 50 of beta 0.98."
    learn = digits_learner()
    learn.fit(3)
    ax = learn.recorder.plot_loss(path=tmp_path / 'loss.png')
    assert (tmp_path / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    losses = learn.recorder.losses
    window = smoothing_window(len(losses))
    assert len(losses) == 69 and window == 2
    drawn = ax.get_lines()[1].get_ydata()
    assert list(drawn) == smooth_values(losses, 1 - 1 / window) and '~2 batches' in ax.get_lines()[1].get_label()
    valid = ax.get_lines()[2]  # each epoch's validation loss, drawn at the batch that ends the epoch
    assert list(valid.get_xdata()) == [23, 46, 69] and list(valid.get_ydata()) == [r[2] for r in learn.recorder.values]
    plt.close('all')


def test_the_device_callback_without_a_device_trains_on_the_default_one_and_says_which():
    "CUDA when there is a GPU, else the CPU: the model, each batch and the callback's `device` agree."
    from teachloop.core import default_device
    placing, seen = DeviceCallback(), []
    learn = tiny_learner(placing)
    learn.fit(1, cbs=[type('Where', (Callback,), {'after_pred': lambda self: seen.append(self.xb[0].device)})()])
    assert placing.device == default_device() == next(learn.model.parameters()).device == seen[0]


def test_smooth_values_is_the_debiased_moving_average():
    "avg_t = beta avg_(t-1) + (1 - beta) v_t, shown as avg_t / (1 - beta^t): the first value, then (b a + v)/(1 + b)."
    for beta in (0.9, 0.98):
        first, second, third = smooth_values([3., 1., 1.], *([beta] if beta != 0.98 else []))  # 0.98 by default
        assert first == pytest.approx(3.) and second == pytest.approx((beta * 3. + 1.) / (1 + beta), rel=1e-12)
        assert third == pytest.approx((beta ** 2 * 3. + beta + 1.) / (1 + beta + beta ** 2), rel=1e-12)
    assert smooth_values([0.25] * 40) == pytest.approx([0.25] * 40, rel=1e-12)  # a constant stays itself


def test_the_loss_plots_window_is_a_25th_of_the_fit_at_least_2_at_most_betas():
    assert [smoothing_window(n) for n in (10, 69, 1000, 1250, 5000)] == [2, 2, 40, 50, 50]  # beta 0.98: 50 batches
    assert smoothing_window(5000, beta=0.9) == 10


def test_the_progress_callback_prints_each_epochs_row_and_shows_its_bar_only_when_asked(capsys):
    learn = tiny_learner(default_cbs=True)
    learn.progress.show_bar, learn.progress.print_rows = False, True
    learn.fit(2)
    out, err = capsys.readouterr()
    header, *rows = out.strip().splitlines()
    assert header.split() == learn.recorder.metric_names and [r.split()[0] for r in rows] == ['0', '1'] and not err
    learn.progress.show_bar = True
    learn.fit(1)
    assert 'epoch 1/1 train' in capsys.readouterr().err  # tqdm's bar, on stderr

@pytest.mark.cuda
@pytest.mark.parametrize('make', [lambda params: torch.optim.Adam(params), lambda params: torch.optim.Adam(params, fused=True),
                                  lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                  lambda params: Adam(params, lr=1e-3), lambda params: Adam(params, lr=1e-3, fast=True)])
def test_state_moved_with_its_model_sits_where_an_optimizer_made_on_the_gpu_keeps_it(make):
    "Each state tensor on the device (and in the dtype) that the same optimizer made on the GPU uses: step counts too."
    from teachloop.callback.core import state_to_params_devices
    def stepped(model):
        opt = make(list(model.parameters()))
        model(torch.ones(3, 2, device=model.weight.device)).sum().backward()
        opt.step()
        return opt
    def placement(opt):
        return [{k: (v.device.type, v.dtype) for k, v in state.items() if torch.is_tensor(v)} for state in opt.state.values()]
    moved = nn.Linear(2, 1)
    opt = stepped(moved)
    moved.cuda()
    state_to_params_devices(opt)
    assert placement(opt) == placement(stepped(nn.Linear(2, 1).cuda()))
    moved(torch.ones(3, 2, device='cuda')).sum().backward()
    opt.step()  # the fused kernels need every tensor on the parameters' device


# ---- BatchNormAtAverage

class Batches(Callback):
    "The inputs of every training batch, in order."
    def before_fit(self): self.seen = []
    def before_batch(self):
        if self.training: self.seen.append(self.learn.x.clone())


def shuffled_learner(*cbs, bs=8, n_train=32, batch_norm=False, dropout=0., opt_func=partial(SGD, mom=0.9), lr=0.05):
    "An MLP in float64 on `n_train` items (8 more to validate), shuffled by a generator of its own; no default callbacks."
    set_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n_train + 8, 4, generator=generator, dtype=torch.float64)
    y = torch.tanh(x @ torch.tensor([1., -2., 0.5, 3.], dtype=torch.float64))[:, None]
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=bs, shuffle=True,
                       generator=torch.Generator().manual_seed(2))
    dls = DataLoaders(train, DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=8))
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if batch_norm else []) + [nn.Tanh(), nn.Dropout(dropout),
                                                                                 nn.Linear(8, 1)]
    return Learner(dls, nn.Sequential(*layers).double(), F.mse_loss, opt_func=opt_func, lr=lr, default_cbs=False,
                   cbs=[Recorder(), *cbs])


@pytest.mark.numeric
def test_batch_norm_at_average_leaves_the_batches_dropout_and_generators_of_the_fit_without_it():
    fits = {}
    for name, extra in (('without', []), ('with', [BatchNormAtAverage(n_batches=2)])):
        batches = Batches()
        learn = shuffled_learner(batches, *extra, batch_norm=True, dropout=0.25, opt_func=ScheduleFreeAdamW, lr=1e-2)
        learn.fit(3)
        fits[name] = (learn, batches.seen, rng_states(), learn.dls.train.generator.get_state())
    (plain, plain_batches, plain_rng, plain_order), (averaged, batches, rng, order) = fits['without'], fits['with']
    assert len(batches) == 12 and all(map(torch.equal, batches, plain_batches))
    assert torch.equal(order, plain_order) and all(same_state(rng[k], plain_rng[k]) for k in ('torch', 'numpy', 'random'))
    assert all(map(torch.equal, averaged.model.parameters(), plain.model.parameters()))  # the same dropout too
    assert not torch.equal(averaged.model[1].running_mean, plain.model[1].running_mean)  # recomputed


# ---- GradientAccumulation

class StepProbe(Callback):
    "At each optimizer step (after every callback that changes the gradients): the gradients, weights and hypers."
    order = 100
    def before_fit(self): self.steps = []
    def before_step(self):
        learn = self.learn
        self.steps.append({'batch': learn.train_iter, 'grads': [p.grad.clone() for p in learn.model.parameters()],
                           'weights': [p.detach().clone() for p in learn.model.parameters()],
                           'hypers': dict(learn.opt.hypers[0])})


class BatchLog(Callback):
    "Every training batch: its items and its loss, unscaled."
    def before_fit(self): self.batches = []
    def after_loss(self):
        if self.training: self.batches.append((self.learn.x.clone(), self.learn.y.clone(), self.learn.loss.item()))


def mean_loss_gradient(model, weights, batches):
    "The gradient of the mean loss over all the items of `batches`, for `model` with `weights`: one big batch."
    model = with_weights(model, weights)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def max_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a, b))


class InfAt(Callback):
    "An infinite gradient at training batch `at` (counted from 0 over the fit), before MixedPrecision checks it."
    order = 5
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.train_iter == self.at: next(self.learn.model.parameters()).grad.view(-1)[0] = float('inf')


class CancelAfterBackward(Callback):
    "Cancel training batch `at` (counted from 0 over the fit) after its backward."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.train_iter == self.at: raise CancelBatchException()


# 22 training items in batches of 4: 4, 4, 4, 4, 4, 2; 12 to a step: steps after batches 2 and 5 (4 + 4 + 2 items)
ACCUMULATED = dict(bs=4, n_train=22)


@pytest.mark.float32
@pytest.mark.numeric
@pytest.mark.parametrize('left_out', [None, 'mixed precision skips its step', 'cancelled after its backward'])
def test_each_step_has_the_gradient_of_one_batch_of_all_its_items(left_out):
    "Against a big batch computed by hand, in float64, with an uneven last group. A batch cancelled after its backward"
    " is left out of its step; an inf in a batch's gradients skips its whole step (torch's recipe with a GradScaler)."
    probe, log = StepProbe(), BatchLog()
    extra = {None: [], 'mixed precision skips its step': [MixedPrecision(torch.float16), InfAt(1)],
             'cancelled after its backward': [CancelAfterBackward(1)]}[left_out]
    learn = shuffled_learner(GradientAccumulation(12), probe, log, *extra, **ACCUMULATED)
    learn.fit(2)
    cancelled = left_out == 'cancelled after its backward'
    kept = [b for i, b in enumerate(log.batches) if not (cancelled and i == 1)]
    sizes, step_batches = ([12, 6, 12, 10], [3, 5, 8, 11]) if cancelled else ([12, 10, 12, 10], [2, 5, 8, 11])
    groups, start = [], 0
    for size in sizes:
        stop = start
        while sum(len(b[0]) for b in kept[start:stop]) < size: stop += 1
        groups.append(kept[start:stop])
        start = stop
    assert start == len(kept) and [s['batch'] for s in probe.steps] == step_batches
    skipped = left_out == 'mixed precision skips its step'
    for i, (step, group) in enumerate(zip(probe.steps, groups)):
        if skipped and i == 0:  # the inf went into the step's sum: the step is skipped, the weights stay
            assert not all(bool(g.isfinite().all()) for g in step['grads'])
            assert all(map(torch.equal, step['weights'], probe.steps[1]['weights']))
            continue
        assert max_diff(step['grads'], mean_loss_gradient(learn.model, step['weights'], group)) < 1e-10
    if skipped: assert learn.mixed_precision.skipped == 1
    # the Recorder has every batch's own loss (a left-out one's too), not the scaled one its backward saw
    weights = [next(s['weights'] for s in probe.steps if s['batch'] >= i) for i in range(len(log.batches))]
    own = [F.mse_loss(with_weights(learn.model, w)(x), y).item() for w, (x, y, _) in zip(weights, log.batches)]  # float64
    assert learn.recorder.losses == own


def with_weights(model, weights):
    "A copy of `model` with `weights`."
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights): p.copy_(w)
    return model


@pytest.mark.numeric
@pytest.mark.parametrize('clipped', [False, True], ids=['plain', 'clipped'])
def test_a_fit_with_accumulation_equals_the_fit_with_the_big_batches(clipped):
    "Batches of 4 added up to 12 against a loader of 12 (same items, same order): GradientClipping clips the sum."
    extra = lambda: [GradientClipping(max_norm=0.05)] if clipped else []
    accumulated = shuffled_learner(GradientAccumulation(12), *extra(), **ACCUMULATED)
    big = shuffled_learner(*extra(), bs=12, n_train=22)
    accumulated.fit(3)
    big.fit(3)
    # float64: the same items' gradients summed in another order, 1e-16 a step
    assert max_diff(accumulated.model.parameters(), big.model.parameters()) < 1e-10
    assert len(accumulated.recorder.losses) == 18 and len(big.recorder.losses) == 6


@pytest.mark.numeric
def test_a_schedule_counts_batches_and_a_step_takes_the_values_of_the_batch_that_completes_it():
    probe, log = StepProbe(), BatchLog()
    learn = shuffled_learner(GradientAccumulation(12), probe, log, **ACCUMULATED)
    learn.fit_one_cycle(2, 0.05)
    step_batches = [s['batch'] for s in probe.steps]
    assert step_batches == [2, 5, 8, 11]
    for name in ('lr', 'mom'):
        assert [s['hypers'][name] for s in probe.steps] == [learn.recorder.hps[name][i] for i in step_batches]
    # the reference: torch's SGD on the big batches with those values
    reference = shuffled_learner(**ACCUMULATED).model
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    bounds = [0] + [i + 1 for i in step_batches]
    for step, start, stop in zip(probe.steps, bounds, bounds[1:]):
        opt.param_groups[0].update(lr=step['hypers']['lr'], momentum=step['hypers']['mom'])
        x, y = torch.cat([b[0] for b in log.batches[start:stop]]), torch.cat([b[1] for b in log.batches[start:stop]])
        F.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert max_diff(learn.model.parameters(), reference.parameters()) < 1e-10


class CtrlCAfter(Callback):
    "A Ctrl-C during training batch `at` (counted from 0 over the fit): the fit stops once that batch is whole."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.train_iter == self.at: os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.numeric
def test_a_fit_interrupted_between_two_steps_resumes_with_the_gradients_set_aside(tmp_path):
    whole = shuffled_learner(GradientAccumulation(12), **ACCUMULATED)
    whole.fit(2)
    first = shuffled_learner(GradientAccumulation(12), Checkpoint(tmp_path), **ACCUMULATED)
    with pytest.raises(KeyboardInterrupt): first.fit(2, cbs=[CtrlCAfter(7)])  # the second batch of the second epoch
    saved = read_checkpoint(tmp_path / 'interrupted.pt')['step']  # the training step's: its gradients set aside
    assert saved['samples'] == 8 and all(torch.is_tensor(g) for g in saved['kept'])
    second = shuffled_learner(GradientAccumulation(12), Checkpoint(tmp_path / 'again'), **ACCUMULATED)
    second.fit(2, resume=tmp_path / 'interrupted.pt')
    assert all(map(torch.equal, second.model.parameters(), whole.model.parameters()))
    assert second.recorder.losses == whole.recorder.losses


class TakeTurns(nn.Module):
    "Two linear layers taking turns over the training batches: the first alone, then the second alone, then both."
    def __init__(self):
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(2, 1), nn.Linear(2, 1), 0
    def forward(self, x):
        if not self.training: return self.a(x) + self.b(x)
        turn, self.calls = self.calls % 3, self.calls + 1
        return self.a(x) if turn == 0 else self.b(x) if turn == 1 else self.a(x) + self.b(x)


@pytest.mark.numeric
def test_a_layer_left_out_of_some_batches_of_a_step_keeps_the_gradients_of_the_others():
    "Three batches a step: the first gives `b` no gradient, the second `a` none. Each step has the sum of all three,"
    " as a hand-written loop gets it from torch's own `.grad` accumulation (float64: equal to rounding)."
    set_seed(0)
    model = TakeTurns().double()
    by_hand = copy.deepcopy(model)
    dls = tiny_dls(n_batches=6, bs=4, dtype=torch.float64)
    learn = Learner(dls, model, F.mse_loss, opt_func=SGD, lr=0.1, default_cbs=False, cbs=[GradientAccumulation(12)])
    learn.fit(1)
    for i, (x, y) in enumerate(dls.train):
        (F.mse_loss(by_hand(x), y) * (len(x) / 12)).backward()
        if i % 3 == 2:
            with torch.no_grad():
                for p in by_hand.parameters(): p -= 0.1 * p.grad
            by_hand.zero_grad()
    assert by_hand.calls == model.calls == 6  # both took the same turns
    assert max_diff(model.parameters(), by_hand.parameters()) < 1e-14  # two sums of three terms: a few ulps of 1


class Unsized:
    "Batches of a loader without len()."
    def __init__(self, batches): self.batches = batches
    def __iter__(self): return iter(self.batches)


@pytest.mark.parametrize('n_acc', [0, 2.5, True])
def test_accumulation_refuses_a_count_that_is_not_a_whole_number(n_acc):
    with pytest.raises(ValueError, match='n_acc must be a whole number'): GradientAccumulation(n_acc)


def test_accumulation_refuses_a_loader_without_a_length_before_anything_changes():
    learn = shuffled_learner(GradientAccumulation(12), **ACCUMULATED)
    learn.dls = DataLoaders(Unsized(list(learn.dls.train)), learn.dls.valid)
    before = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(ValueError, match='len'): learn.fit(1)
    assert learn.opt is None and all(torch.equal(v, before[k]) for k, v in learn.model.state_dict().items())


def accumulated_float16_fit(sync_free, *cbs):
    learn = shuffled_learner(*cbs, GradientAccumulation(12), InfAt(1), MixedPrecision(torch.float16, sync_free=sync_free),
                             **ACCUMULATED)
    learn.fit(2)
    return learn


@pytest.mark.float32
@pytest.mark.numeric
def test_mixed_precision_without_waiting_skips_an_accumulated_step_as_the_waiting_one_does():
    "The step's check comes once its gradients are added up: taken and undone on the device, or skipped, alike."
    waiting, not_waiting = accumulated_float16_fit(False), accumulated_float16_fit(True)
    assert not_waiting.mixed_precision._deferred and waiting.mixed_precision.skipped == not_waiting.mixed_precision.skipped == 1
    assert all(map(torch.equal, waiting.model.parameters(), not_waiting.model.parameters()))


@pytest.mark.cuda
def test_on_a_gpu_mixed_precision_does_not_wait_for_its_checks_while_gradients_accumulate():
    default, waiting = accumulated_float16_fit(None, DeviceCallback('cuda')), accumulated_float16_fit(False, DeviceCallback('cuda'))
    assert default.mixed_precision._deferred and default.mixed_precision.skipped == waiting.mixed_precision.skipped == 1
    assert all(map(torch.equal, default.model.parameters(), waiting.model.parameters()))


# ---- metrics: any number, and metrics of the whole set (AccumMetric)

def rmse(pred, target): return torch.sqrt(F.mse_loss(pred, target))


def regression_learner(metrics, valid_sizes=(32, 7, 13), seed=0):
    "A linear model in float64 on a regression whose noise grows along the validation set, cut into `valid_sizes` batches."
    generator = torch.Generator().manual_seed(seed)
    n_valid = sum(valid_sizes)
    x = torch.randn(64 + n_valid, 2, dtype=torch.float64, generator=generator)
    scale = torch.cat([torch.ones(64, dtype=torch.float64), torch.linspace(0.1, 4, n_valid, dtype=torch.float64)])
    y = (x @ torch.tensor([2., -1.], dtype=torch.float64) + torch.randn(len(x), dtype=torch.float64,
                                                                       generator=generator) * scale)[:, None]
    ends = torch.tensor([64, *valid_sizes]).cumsum(0).tolist()
    valid = [(x[a:b], y[a:b]) for a, b in zip(ends, ends[1:])]
    set_seed(seed)
    learn = Learner(DataLoaders([(x[:32], y[:32]), (x[32:64], y[32:64])], valid), nn.Linear(2, 1).double(), F.mse_loss,
                    opt_func=SGD, lr=0.05, metrics=metrics, default_cbs=False, cbs=[Recorder()])
    return learn, torch.cat([b[0] for b in valid]), torch.cat([b[1] for b in valid])


@pytest.mark.numeric
def test_accum_metric_is_the_rmse_of_the_whole_set_and_the_batch_average_is_not():
    learn, x_valid, y_valid = regression_learner([rmse, AccumMetric(rmse, name='rmse_whole')])
    learn.fit(1)
    _, averaged, whole = learn.recorder.values[-1][2:5]
    with torch.no_grad(): errors = (learn.model(x_valid) - y_valid).squeeze(1)
    by_hand = (sum(e * e for e in errors.tolist()) / len(errors)) ** 0.5  # in Python floats, item by item
    assert learn.recorder.metric_names[3:5] == ['rmse', 'rmse_whole']
    assert abs(whole - by_hand) < 1e-12 * by_hand  # float64 sums in another order: 1e-16 an addition
    assert abs(averaged - by_hand) > 0.05
    assert learn.metrics[1].preds == []  # the batches are let go once the value is read


@pytest.mark.numeric
def test_accum_metric_with_scikit_learns_auc_and_f1_equals_them_on_the_whole_set():
    from sklearn.metrics import f1_score, roc_auc_score
    set_seed(0)
    x, y = torch.randn(120, 5, dtype=torch.float64), torch.randint(0, 3, (120,))
    model = nn.Linear(5, 3).double()
    valid = [(x[a:b], y[a:b]) for a, b in ((0, 50), (50, 57), (57, 120))]
    metrics = [AccumMetric(roc_auc_score, activation='softmax', flatten=False, to_np=True, invert_arg=True,
                           multi_class='ovr', name='auc'),
               AccumMetric(f1_score, dim_argmax=-1, to_np=True, invert_arg=True, average='macro', name='f1')]
    learn = Learner(DataLoaders(valid, valid), model, F.cross_entropy, metrics=metrics, default_cbs=False, cbs=[Recorder()])
    _, auc, f1 = learn.validate()
    with torch.no_grad(): probabilities = torch.softmax(model(x), dim=-1).numpy()
    assert auc == roc_auc_score(y.numpy(), probabilities, multi_class='ovr')
    assert f1 == f1_score(y.numpy(), probabilities.argmax(-1), average='macro')
    per_batch = [f1_score(t.numpy(), probabilities[a:b].argmax(-1), average='macro')
                 for (a, b), (_, t) in zip(((0, 50), (50, 57), (57, 120)), valid)]
    assert abs(sum(f * len(t) for f, (_, t) in zip(per_batch, valid)) / 120 - f1) > 1e-3  # averaging would be wrong


def test_accum_metric_prepares_predictions_as_fastai_does_with_zero_counting():
    from sklearn.metrics import f1_score
    scores, labels = torch.tensor([[-1., 0.5], [2., -3.], [0., 0.1]]), torch.tensor([[0, 1], [1, 0], [1, 1]])
    multi_label = AccumMetric(f1_score, activation='sigmoid', thresh=0.6, flatten=False, to_np=True, invert_arg=True,
                              average='micro')
    assert multi_label(scores, labels) == f1_score(labels.numpy(), (torch.sigmoid(scores) >= 0.6).numpy(), average='micro')
    kept = AccumMetric(lambda pred, targ: pred, thresh=0.)  # fastai ignores a threshold of 0 (it tests its truth)
    assert kept(scores, scores).tolist() == (scores >= 0).reshape(-1).tolist()
    by_column = AccumMetric(lambda pred, targ: pred, dim_argmax=0, flatten=False)  # fastai ignores dim_argmax=0 too
    assert by_column(scores, labels).tolist() == [1, 0]
    from sklearn.metrics import roc_auc_score
    binary = AccumMetric(roc_auc_score, activation='binarysoftmax', to_np=True, invert_arg=True)
    positive = torch.softmax(scores.double(), dim=-1)[:, 1].numpy()
    assert binary(scores.double(), torch.tensor([0, 1, 1])) == roc_auc_score([0, 1, 1], positive)
    half = AccumMetric(lambda pred, targ: pred.dtype, flatten=False)
    half.accum_values(scores.bfloat16(), labels)  # mixed precision's outputs: func computes in float32 at least
    assert half.value == torch.float32 and AccumMetric(rmse).value is None


@pytest.mark.parametrize('args, error, match', [
    (dict(func=rmse, activation='relu'), ValueError, 'activation'), (dict(func='rmse'), TypeError, 'func')])
def test_accum_metric_refuses_bad_arguments_when_made(args, error, match):
    with pytest.raises(error, match=match): AccumMetric(**args)


def test_accum_metric_says_how_to_give_it_class_scores():
    with pytest.raises(ValueError, match='dim_argmax=-1'): AccumMetric(rmse)(torch.randn(4, 3), torch.arange(4))


@pytest.mark.parametrize('value', [0.25, 2, np.float32(0.5), np.float64(0.75), np.array(1.5), torch.tensor([3.]), True],
                         ids=['float', 'int', 'numpy float32', 'numpy float64', '0-d array', 'tensor of one', 'bool'])
def test_a_metric_may_return_a_python_or_numpy_number(value):
    learn, _, _ = regression_learner([lambda pred, target: value])
    assert learn.validate()[1] == float(value.item() if hasattr(value, 'item') else value)  # exact in float32 too


@pytest.mark.numeric
def test_a_metric_returning_numbers_per_batch_is_averaged_by_batch_size():
    learn, _, _ = regression_learner([lambda pred, target: float(len(target))])
    sizes = (32, 7, 13)
    # float32 mean of three exact products: each operation rounds by at most 2**-24 relative
    assert abs(learn.validate()[1] - sum(n * n for n in sizes) / sum(sizes)) < 1e-6 * 32


@pytest.mark.parametrize('value, error, match', [([1., 2.], ValueError, 'returned 2 numbers'),
                                                 (torch.ones(2), ValueError, 'returned 2 numbers'),
                                                 ('high', TypeError, 'must return a number')])
def test_a_metric_returning_anything_but_one_number_is_refused_with_its_name(value, error, match):
    def odd_metric(pred, target): return value
    learn, _, _ = regression_learner([odd_metric])
    with pytest.raises(error, match=f"odd_metric.*{match}"): learn.validate()


class ShardOnly:
    "An accumulating metric object of one's own, without `gather`: it would see its own shard only."
    name = 'shard_only'
    def reset(self): self.seen = 0
    def accumulate(self, learn): self.seen += len(learn.y)
    @property
    def value(self): return self.seen


def whole_set_learner(n_valid=52, with_shard_only=False):
    "The regression's learner on torch DataLoaders, with the RMSE and an AUC of the whole validation set."
    from sklearn.metrics import roc_auc_score
    learn, x, y = regression_learner([], valid_sizes=(n_valid,))
    learn.dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=8))
    learn.metrics = [AccumMetric(rmse), AccumMetric(lambda p, t: roc_auc_score(t > 0, p), to_np=True, name='auc')]
    if with_shard_only: learn.metrics.append(ShardOnly())
    return learn


def validate_in_a_rank(n_valid, with_shard_only):
    learn = whole_set_learner(n_valid, with_shard_only)
    try:
        with learn.distributed(): return learn.validate()
    except ValueError as e: return str(e)


@pytest.mark.ranks
@pytest.mark.numeric
def test_under_two_processes_accum_metric_gathers_the_whole_set():
    from teachloop.callback.distributed import run_ranks
    rank0, rank1 = run_ranks(validate_in_a_rank, 52, False, world_size=2, start_method='fork', timeout=120)
    alone = whole_set_learner().validate()
    assert rank0 == rank1
    # the items in another order (each rank's shard in turn): float64 sums in another order, 1e-16 an addition
    assert abs(rank0[1] - alone[1]) < 1e-12 * alone[1] and rank0[2] == alone[2]


@pytest.mark.ranks
@pytest.mark.parametrize('n_valid, with_shard_only, said', [(52, True, "'shard_only' accumulates its batches but has no"),
                                                            (1, False, 'processes [1] had no validation item')])
def test_under_two_processes_what_cannot_see_the_whole_set_is_refused_in_every_process(n_valid, with_shard_only, said):
    from teachloop.callback.distributed import run_ranks
    ranks = run_ranks(validate_in_a_rank, n_valid, with_shard_only, world_size=2, start_method='fork', timeout=120)
    assert all(isinstance(r, str) and said in r for r in ranks), ranks


def test_mixed_precision_predicts_and_validates_before_any_fit():
    "Its device and dtype are chosen when first needed: a baseline validation or get_preds before training works."
    from teachloop.callback.core import MixedPrecision
    from teachloop.testing import digits_learner
    learn = digits_learner(MixedPrecision())
    probs, targets = learn.get_preds()
    x = torch.cat([b[0] for b in learn.dls.valid])
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16): out = learn.model(x)
    assert probs.dtype == torch.float32 and torch.equal(probs, out.float().softmax(1))
    # the mean of per-batch float32 means against one float32 mean: they differ by a few roundings (~1e-7 each)
    assert learn.validate()[0] == pytest.approx(torch.nn.functional.cross_entropy(out.float(), targets).item(), rel=1e-6)


def test_metrics_see_float32_predictions_under_mixed_precision():
    "As fastai's MixedPrecision does: a metric that hands the predictions to numpy works (numpy has no bfloat16)."
    from teachloop.callback.core import MixedPrecision
    from teachloop.testing import digits_learner
    seen = []
    def numpy_accuracy(pred, y):
        seen.append(pred.dtype)
        return (pred.softmax(1).numpy().argmax(1) == y.numpy()).mean()
    learn = digits_learner(MixedPrecision(), metrics=[numpy_accuracy])
    learn.fit(1)
    row = dict(zip(learn.recorder.metric_names, learn.recorder.values[-1]))
    assert set(seen) == {torch.float32} and 0 <= row['numpy_accuracy'] <= 1


def test_two_metrics_of_one_name_are_refused_before_the_fit():
    from functools import partial
    from teachloop.callback.core import AccumMetric
    from teachloop.testing import digits_learner
    from sklearn.metrics import f1_score
    macro = AccumMetric(partial(f1_score, average='macro'), dim_argmax=-1, to_np=True, name='f1_score')
    micro = AccumMetric(partial(f1_score, average='micro'), dim_argmax=-1, to_np=True, name='f1_score')
    learn = digits_learner(metrics=[macro, micro])
    before = [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=r"named \['f1_score'\]"): learn.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters())) and learn.recorder.values == []
    def valid_loss(pred, y): return 0.
    with pytest.raises(ValueError, match=r"named \['valid_loss'\]"): digits_learner(metrics=[valid_loss]).fit(1)
    micro.name = 'f1_micro'
    learn.fit(1)
    assert learn.recorder.metric_names[3:5] == ['f1_score', 'f1_micro']


def test_the_hyper_parameters_read_follow_a_callback_changed_in_place():
    "A callback object whose `__call__` is redefined, or a function whose code is replaced (autoreload), is read again."
    from teachloop.optim.core import Optimizer

    class Step:
        def __call__(self, p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)

    def step_fn(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)
    def with_mom(p, lr, mom, **kwargs): p.data.add_(p.grad, alpha=-lr)

    param = nn.Parameter(torch.ones(2))
    step = Step()
    make = lambda cb: Optimizer([param], [cb], lr=0.1, mom=0.9, fast=False)
    assert hypers_read(make(step)) == {'lr'} and hypers_read(make(step_fn)) == {'lr'}
    Step.__call__ = lambda self, p, lr, mom, **kwargs: p.data.add_(p.grad, alpha=-lr)  # what fastcore's @patch does
    step_fn.__code__ = with_mom.__code__  # what %autoreload does to a function it reloads
    assert hypers_read(make(step)) == {'lr', 'mom'} and hypers_read(make(step_fn)) == {'lr', 'mom'}
