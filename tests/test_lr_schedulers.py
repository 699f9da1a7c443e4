"""torch's schedulers in a fit (`LRSchedulerCallback`), checked against torch's own loop in float64, resumed exactly; and
the precedence of the callbacks that set a hyper-parameter: two writers of one name refused before the fit."""
import os
import signal
from functools import partial

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from teachloop.callback.checkpoint import Checkpoint, read_checkpoint
from teachloop.callback.schedule import LRFinder, LRSchedulerCallback, ParamScheduler, annealing_cos, preview_values
from teachloop.callback.tracker import ReduceLROnPlateau
from teachloop.dashboard.controls import SteeringCallback
from teachloop.data import regression_2d, tensor_dls
from teachloop.learner import Callback, Learner
from teachloop.optim.core import SGD, Adam
from teachloop.optim.interop import OptimWrapper
from teachloop.testing import quiet

N_EPOCH, N_ITER = 3, 8  # the fits below: 3 epochs of 8 training batches


def data():
    "160 items of the 2-d regression in float64: 8 training batches of 16, shuffled by a generator of their own."
    x, y = regression_2d(n=160)
    return tensor_dls(x.double(), y.double(), bs=16, seed=0)


def model():
    torch.manual_seed(0)
    return nn.Linear(2, 1).double()


def learner(opt_func=partial(SGD, mom=0.9), lr=0.05, cbs=(), **kwargs):
    return quiet(Learner(data(), model(), nn.functional.mse_loss, opt_func=opt_func, lr=lr, cbs=list(cbs), **kwargs))


def torch_loop(make_opt, make_scheduler, per_batch, n_epoch=N_EPOCH):
    "torch's own loop on the same model and batches: the model, and the lr (and momentum) each batch trained with."
    net, dls = model(), data()
    opt = make_opt(net.parameters())
    scheduler, lrs, moms = make_scheduler(opt), [], []
    for _ in range(n_epoch):
        for xb, yb in dls.train:
            group = opt.param_groups[0]
            lrs.append(group['lr']); moms.append(group['betas'][0] if 'betas' in group else group.get('momentum'))
            nn.functional.mse_loss(net(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            if per_batch: scheduler.step()
        if not per_batch: scheduler.step()
    return net, lrs, moms


def weights(learn_or_model):
    module = getattr(learn_or_model, 'model', learn_or_model)
    return [p.detach().clone() for p in module.parameters()]


# --- against torch's own loop -------------------------------------------------------------------------------------------

TOTAL = N_EPOCH * N_ITER
SCHEDULES = {  # name: (the callback's class and arguments, the scheduler in torch's loop, steps per batch)
    'OneCycleLR': ((lr_scheduler.OneCycleLR,), {'max_lr': 0.1}, lambda o: lr_scheduler.OneCycleLR(o, 0.1, total_steps=TOTAL), True),
    'OneCycleLR, epochs x steps': ((lr_scheduler.OneCycleLR, 0.1), {'epochs': N_EPOCH, 'steps_per_epoch': N_ITER},
                                   lambda o: lr_scheduler.OneCycleLR(o, 0.1, epochs=N_EPOCH, steps_per_epoch=N_ITER), True),
    'CyclicLR': ((lr_scheduler.CyclicLR, 0.01, 0.1), {'step_size_up': 5},
                 lambda o: lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=5), True),
    'CosineAnnealingLR per batch': ((lr_scheduler.CosineAnnealingLR,), {'T_max': TOTAL, 'step': 'batch'},
                                    lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=TOTAL), True),
    'LinearLR warm-up per batch': ((lr_scheduler.LinearLR,), {'start_factor': 0.1, 'total_iters': 5, 'step': 'batch'},
                                   lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5), True),
    'StepLR': ((lr_scheduler.StepLR, 1), {'gamma': 0.5}, lambda o: lr_scheduler.StepLR(o, 1, gamma=0.5), False),
    'ExponentialLR': ((lr_scheduler.ExponentialLR, 0.7), {}, lambda o: lr_scheduler.ExponentialLR(o, 0.7), False),
    'CosineAnnealingLR': ((lr_scheduler.CosineAnnealingLR, N_EPOCH), {}, lambda o: lr_scheduler.CosineAnnealingLR(o, N_EPOCH), False),
    'MultiStepLR': ((lr_scheduler.MultiStepLR, [1, 2]), {'gamma': 0.3}, lambda o: lr_scheduler.MultiStepLR(o, [1, 2], 0.3), False),
}


@pytest.mark.float32
@pytest.mark.numeric
@pytest.mark.parametrize('name', SCHEDULES)
def test_the_rates_and_weights_are_those_of_torchs_loop(name):
    "Through an OptimWrapper the optimizer is torch's own: the same values and the same weights, to the bit."
    args, kwargs, make_scheduler, per_batch = SCHEDULES[name]
    learn = learner(partial(OptimWrapper, opt=torch.optim.SGD, momentum=0.9))
    learn.fit(N_EPOCH, cbs=[LRSchedulerCallback(*args, **kwargs)])
    net, lrs, moms = torch_loop(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), make_scheduler, per_batch)
    assert learn.recorder.hps['lr'] == lrs and learn.recorder.hps['mom'] == moms
    assert len(set(lrs)) > 1  # the schedule moved the rate
    assert all(map(torch.equal, weights(learn), weights(net)))


def throwaway_optimizer():
    "A torch optimizer that no fit uses: what a user made a scheduler on before handing it to the callback."
    return torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.5, momentum=0.5)


@pytest.mark.float32
@pytest.mark.numeric
@pytest.mark.parametrize('name', [name for name in SCHEDULES if not name.startswith(('OneCycleLR', 'CyclicLR'))])
def test_a_scheduler_made_on_another_optimizer_is_made_again_on_the_fits(name):
    "A scheduler instance: its arguments read back, the scheduler made on the fit's optimizer, torch's loop's values."
    _, kwargs, make_scheduler, per_batch = SCHEDULES[name]
    scheduler = make_scheduler(throwaway_optimizer())
    handed_over = dict(scheduler.optimizer.param_groups[0], params=None), scheduler.state_dict()
    learn = learner(partial(OptimWrapper, opt=torch.optim.SGD, momentum=0.9))
    learn.fit(N_EPOCH, cbs=[LRSchedulerCallback(scheduler, step=kwargs.get('step'))])
    net, lrs, _ = torch_loop(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), make_scheduler, per_batch)
    assert learn.recorder.hps['lr'] == lrs and len(set(lrs)) > 1
    assert all(map(torch.equal, weights(learn), weights(net)))
    assert (dict(scheduler.optimizer.param_groups[0], params=None), scheduler.state_dict()) == handed_over  # untouched


@pytest.mark.numeric
def test_a_lambda_schedule_made_on_another_optimizer_keeps_its_function():
    scheduler = lr_scheduler.LambdaLR(throwaway_optimizer(), lambda epoch: 0.5 ** epoch)
    learn = learner()
    learn.fit(N_EPOCH, cbs=[LRSchedulerCallback(scheduler)])
    assert learn.recorder.hps['lr'][::N_ITER] == [0.05, 0.025, 0.0125]


@pytest.mark.parametrize('make, error, match', [
    (lambda o: lr_scheduler.OneCycleLR(o, 0.1, total_steps=TOTAL), TypeError,
     r"give the class and its arguments instead, LRSchedulerCallback\(OneCycleLR, total_steps=24, max_lr=\.\.\.\)"),
    (lambda o: lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=5), TypeError,
     r"LRSchedulerCallback\(CyclicLR, base_lr=0.01, max_lr=0.1\), with those of step_size_up, step_size_down"),
    (lambda o: lr_scheduler.ReduceLROnPlateau(o), ValueError, "teachloop's ReduceLROnPlateau"),
    (lambda o: lr_scheduler.SequentialLR(o, [lr_scheduler.StepLR(o, 1), lr_scheduler.StepLR(o, 2)], [1]), ValueError,
     'chain the schedules themselves'),
])
def test_a_scheduler_that_cannot_be_made_again_is_refused_with_the_call_that_works(make, error, match):
    with pytest.raises(error, match=match): LRSchedulerCallback(make(throwaway_optimizer()))


def test_a_scheduler_that_has_stepped_is_refused():
    scheduler = lr_scheduler.StepLR(throwaway_optimizer(), 1)
    scheduler.optimizer.step(); scheduler.step()
    with pytest.raises(ValueError, match='has stepped 1 times'): LRSchedulerCallback(scheduler)


@pytest.mark.numeric
@pytest.mark.parametrize('ours, theirs', [
    (partial(SGD, mom=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    (partial(Adam, wd=0.), lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.9, 0.99), eps=1e-5)),
])
@pytest.mark.float32
def test_teachloops_optimizers_get_torchs_values_and_momentum_cycled_as_beta1(ours, theirs):
    "One cycle with momentum cycled: torch's `momentum`, or Adam's beta1, is our `mom`."
    learn = learner(ours)
    learn.fit(N_EPOCH, cbs=[LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=0.1)])
    net, lrs, moms = torch_loop(theirs, lambda o: lr_scheduler.OneCycleLR(o, 0.1, total_steps=TOTAL), True)
    assert learn.recorder.hps['lr'] == lrs and learn.recorder.hps['mom'] == moms and min(moms) < 0.86
    # float64: the two optimizers round differently in the last bit, about 2e-16 of the weights a step; 24 steps, each
    # carried on by momentum (at most 1 / (1 - 0.85) ~ 7 times), stay below 24 * 7 * 2.2e-16 ~ 4e-14 of weights near 1
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(weights(learn), weights(net)))


@pytest.mark.float32
@pytest.mark.numeric
def test_one_value_per_parameter_group_and_the_fits_lr_as_the_start():
    "Two groups, a max_lr each; StepLR starts from `fit(lr=...)`, as from a torch optimizer made with that lr."
    learn = learner(splitter=lambda m: [[m.weight], [m.bias]])
    learn.fit(N_EPOCH, cbs=[LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=[0.1, 0.2])])
    assert [h['lr'] for h in learn.opt.hypers] == [0.1 / 25 / 1e4, 0.2 / 25 / 1e4]  # torch's final_div_factor
    learn.fit(2, lr=0.3, cbs=[LRSchedulerCallback(lr_scheduler.StepLR, 1, gamma=0.5)])
    assert learn.recorder.hps['lr'][::N_ITER] == [0.3, 0.15] and [h['lr'] for h in learn.opt.hypers] == [0.075, 0.075]


def test_the_optimizer_keeps_no_trace_of_torchs_bookkeeping():
    learn = learner()
    learn.fit(1, cbs=[LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=0.1)])
    assert set(learn.opt.hypers[0]) == {'lr', 'mom', 'wd'} and not hasattr(learn.opt.step, '_wrapped_by_lr_sched')


# --- refused, before anything changes -----------------------------------------------------------------------------------

@pytest.mark.parametrize('make, error, match', [
    (lambda: LRSchedulerCallback(lr_scheduler.ReduceLROnPlateau), ValueError, "teachloop's ReduceLROnPlateau"),
    (lambda: LRSchedulerCallback(torch.optim.SGD), TypeError, 'a class of torch.optim.lr_scheduler'),
    (lambda: LRSchedulerCallback(lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 2), 3),
     TypeError, 'give the scheduler alone'),
    (lambda: LRSchedulerCallback(lr_scheduler.StepLR, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 2),
     TypeError, 'leave the optimizer out'),
    (lambda: LRSchedulerCallback(lr_scheduler.StepLR, step_sise=2), TypeError, r"StepLR\(optimizer"),
    (lambda: LRSchedulerCallback(lr_scheduler.StepLR, 2, step='step'), ValueError, "step must be 'batch', 'epoch'"),
])
def test_what_the_constructor_refuses(make, error, match):
    with pytest.raises(error, match=match): make()


@pytest.mark.parametrize('opt_func, cb, match', [
    (SGD, LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=0.1), 'pass cycle_momentum=False'),
    (partial(OptimWrapper, opt=torch.optim.Adagrad), LRSchedulerCallback(lr_scheduler.CyclicLR, 0.01, 0.1),
     'pass cycle_momentum=False'),
    (partial(SGD, mom=0.9), LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=[0.1, 0.2]), 'cannot drive'),
    (partial(SGD, mom=0.9), LRSchedulerCallback(lr_scheduler.OneCycleLR, 0.1, total_steps=5), 'is 5 steps long'),
    (partial(SGD, mom=0.9), LRSchedulerCallback(lr_scheduler.OneCycleLR, 0.1, epochs=3), 'epochs AND steps_per_epoch'),
])
def test_a_scheduler_the_optimizer_cannot_take_is_refused_before_the_fit(opt_func, cb, match):
    learn = learner(opt_func)
    before = weights(learn)
    with pytest.raises(ValueError, match=match): learn.fit(1, cbs=[cb])
    assert all(map(torch.equal, weights(learn), before)) and learn.opt is None


def test_a_one_cycle_shorter_than_the_fit_is_refused_before_its_first_batch():
    learn = learner()
    before = weights(learn)
    with pytest.raises(ValueError, match='OneCycleLR is 12 steps long, and this fit steps it 24 times'):
        learn.fit(N_EPOCH, cbs=[LRSchedulerCallback(lr_scheduler.OneCycleLR, 0.1, total_steps=12)])
    assert all(map(torch.equal, weights(learn), before)) and learn.train_iter == 0


# --- resumed exactly --------------------------------------------------------------------------------------------------

class CtrlCAt(Callback):
    "A Ctrl-C (SIGINT to this process) during the backward of training step `at`, counted from 1 over the fit."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.learn.train_iter + 1 == self.at: os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.numeric
@pytest.mark.parametrize('at, file', [(11, 'interrupted.pt'), (12, 'epoch-001.pt')])
@pytest.mark.parametrize('schedule', [(lr_scheduler.StepLR, 1), (lr_scheduler.CyclicLR, 0.01, 0.1)],
                         ids=['StepLR per epoch', 'CyclicLR per batch'])
def test_a_resumed_fit_reaches_the_weights_of_the_whole_one(schedule, at, file, tmp_path):
    "Interrupted in the middle of the second epoch and resumed from there, or from the end of the first epoch."
    whole = learner(cbs=[LRSchedulerCallback(*schedule), Checkpoint(tmp_path / 'whole')])
    whole.fit(N_EPOCH)
    first = learner(cbs=[LRSchedulerCallback(*schedule), Checkpoint(tmp_path / 'run')])
    with pytest.raises(KeyboardInterrupt): first.fit(N_EPOCH, cbs=[CtrlCAt(at)])
    resumed = learner(cbs=[LRSchedulerCallback(*schedule), Checkpoint(tmp_path / 'run')])
    resumed.fit(N_EPOCH, resume=tmp_path / 'run' / file)
    assert all(map(torch.equal, weights(resumed), weights(whole)))
    assert resumed.recorder.hps['lr'] == whole.recorder.hps['lr'] and len(set(whole.recorder.hps['lr'])) > 1


def test_a_checkpoint_asked_for_before_an_epoch_steps_the_schedule_waits_for_it(tmp_path):
    "Saved by a callback that hears the epoch's end before LRSchedulerCallback: written once it has stepped."
    class SaveFirst(Callback):
        order = -1  # before LRSchedulerCallback (0) at the epoch's end
        def after_epoch(self): self.learn.save_checkpoint(tmp_path / 'early.pt')
    saved = learner(cbs=[LRSchedulerCallback(lr_scheduler.StepLR, 1), SaveFirst()])
    saved.fit(1)
    assert read_checkpoint(tmp_path / 'early.pt')['callbacks']['lr_scheduler']['epochs_seen'] == 1
    whole = learner(cbs=[LRSchedulerCallback(lr_scheduler.StepLR, 1)])
    whole.fit(2)
    resumed = learner(cbs=[LRSchedulerCallback(lr_scheduler.StepLR, 1)])
    resumed.fit(2, resume=tmp_path / 'early.pt')
    assert all(map(torch.equal, weights(resumed), weights(whole))) and resumed.recorder.hps['lr'] == whole.recorder.hps['lr']


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path):
    first = learner(cbs=[LRSchedulerCallback(lr_scheduler.StepLR, 1), Checkpoint(tmp_path)])
    first.fit(2)
    other = learner(cbs=[LRSchedulerCallback(lr_scheduler.ExponentialLR, 0.5), Checkpoint(tmp_path)])
    with pytest.raises(ValueError, match='StepLR stepped each epoch, this callback.s ExponentialLR'):
        other.fit(2, resume=tmp_path / 'epoch-001.pt')


# --- who sets a hyper-parameter -----------------------------------------------------------------------------------------

def lr_schedule(): return ParamScheduler({'lr': partial(annealing_cos, 0.05, 0.005)})
def mom_schedule(): return ParamScheduler({'mom': partial(annealing_cos, 0.95, 0.85)})
def step_lr(): return LRSchedulerCallback(lr_scheduler.StepLR, 1)
def one_cycle(): return LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=0.1)
def plateau(monitor='valid_loss'): return ReduceLROnPlateau(monitor, patience=1)

CLASHES = {  # two writers, the hyper-parameter both set
    'ParamScheduler + LRSchedulerCallback per epoch': ([lr_schedule, step_lr], 'lr'),
    'ParamScheduler + LRSchedulerCallback per batch': ([lr_schedule, one_cycle], 'lr'),
    'ParamScheduler + LRFinder': ([lr_schedule, LRFinder], 'lr'),
    'ParamScheduler + ReduceLROnPlateau': ([lr_schedule, plateau], 'lr'),
    'two ParamSchedulers of mom': ([mom_schedule, mom_schedule], 'mom'),
    'ParamScheduler of mom + OneCycleLR cycling it': ([mom_schedule, one_cycle], 'mom'),
    'two LRSchedulerCallbacks': ([step_lr, lambda: LRSchedulerCallback(lr_scheduler.ExponentialLR, 0.5)], 'lr'),
    'LRSchedulerCallback + ReduceLROnPlateau': ([step_lr, plateau], 'lr'),
    'LRSchedulerCallback + LRFinder': ([one_cycle, LRFinder], 'lr'),
    'LRFinder + ReduceLROnPlateau': ([LRFinder, plateau], 'lr'),
    'two ReduceLROnPlateau': ([plateau, partial(plateau, 'train_loss')], 'lr'),
}


@pytest.mark.parametrize('name', CLASHES)
@pytest.mark.parametrize('where', ['fit', 'learner'])
def test_two_writers_of_one_hyper_parameter_are_refused_before_the_fit(name, where):
    makers, hyper = CLASHES[name]
    cbs = [make() for make in makers]
    if cbs[0].name == cbs[1].name: cbs[1].name = 'second'  # a learner reaches each callback by its name
    learn = learner(cbs=cbs if where == 'learner' else ())
    before = weights(learn)
    with pytest.raises(ValueError) as refusal: learn.fit(2, cbs=cbs if where == 'fit' else None)
    first, second = [type(cb).__name__ + (" 'second'" if cb.name == 'second' else '')
                     for cb in sorted(cbs, key=lambda cb: cb.order)]
    assert str(refusal.value).startswith(f"{first} sets {hyper!r} ") and f" and {second} sets it " in str(refusal.value)
    assert all(map(torch.equal, weights(learn), before)) and learn.opt is None


def test_fit_one_cycle_and_lr_find_name_what_they_add():
    learn = learner()
    with pytest.raises(ValueError, match=r"^ParamScheduler \(made by fit_one_cycle\(2, lr_max=0.05\)\) sets 'lr' every "
                                         "batch and ReduceLROnPlateau sets it at epoch ends"):
        learn.fit_one_cycle(2, cbs=[plateau()])
    reduce = plateau()
    learn = learner(cbs=[reduce])
    learn.lr_find(show_plot=False)  # set aside for the range test (it would lower LRFinder's rates), then back
    assert learn.opt is None and reduce in learn.cbs and reduce.learn is learn and reduce.wait == 0


def torch_lrs(make_scheduler, per_batch, n_epoch=2):
    return torch_loop(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), make_scheduler, per_batch, n_epoch)[1]


@pytest.mark.parametrize('make_lr_writer, expected_lrs', [
    (step_lr, lambda: torch_lrs(lambda o: lr_scheduler.StepLR(o, 1), False)),
    (lambda: LRSchedulerCallback(lr_scheduler.OneCycleLR, max_lr=0.1, cycle_momentum=False),
     lambda: torch_lrs(lambda o: lr_scheduler.OneCycleLR(o, 0.1, total_steps=2 * N_ITER, cycle_momentum=False), True)),
    (lambda: plateau('valid_loss'), lambda: [0.05] * 2 * N_ITER),  # the loss falls: no plateau in two epochs
], ids=['StepLR', 'OneCycleLR of lr only', 'ReduceLROnPlateau'])
def test_writers_of_different_hyper_parameters_fit_together_each_with_its_values(make_lr_writer, expected_lrs):
    moms = mom_schedule()
    learn = learner()
    learn.fit(2, cbs=[moms, make_lr_writer()])
    assert learn.recorder.hps['mom'] == preview_values(moms.scheds, 2 * N_ITER)['mom']
    assert learn.recorder.hps['lr'] == expected_lrs()


class SlideLR(Callback):
    "A person moving the learning-rate slider after training step `hold` and letting it go after step `release`."
    order = 80
    def __init__(self, controls, hold, release): self.controls, self.hold, self.release = controls, hold, release
    def after_batch(self):
        if self.train_iter == self.hold: self.controls.set_hyper('lr', 0.5)
        if self.train_iter == self.release: self.controls.clear_requests()


@pytest.mark.parametrize('schedule', [lr_schedule, one_cycle], ids=['ParamScheduler', 'LRSchedulerCallback'])
def test_the_steering_callback_wins_while_a_slider_is_held(schedule):
    steering = SteeringCallback()
    plain, steered = learner(), learner()
    plain.fit(2, cbs=[schedule()])
    steered.fit(2, cbs=[schedule(), steering, SlideLR(steering.controls, hold=3, release=6)])
    lrs, expected = steered.recorder.hps['lr'], plain.recorder.hps['lr']
    assert lrs[:3] == expected[:3] and lrs[3:6] == [0.5] * 3 and lrs[6:] == expected[6:]


@pytest.mark.parametrize('chain', [torch.optim.lr_scheduler.SequentialLR, torch.optim.lr_scheduler.ChainedScheduler])
def test_a_chain_of_schedulers_is_refused_with_the_schedule_that_does_it(chain):
    "Their inner schedulers need the optimizer, which exists only when the fit starts: combine_scheds chains schedules."
    with pytest.raises(ValueError, match=r'combine_scheds\(\[0.1, 0.9\]') as caught: LRSchedulerCallback(chain, [])
    from teachloop.callback.schedule import ParamScheduler, annealing_cos, annealing_linear, combine_scheds  # noqa: F401
    from functools import partial  # noqa: F401
    code = str(caught.value).split('chain the schedules themselves: ')[1]
    assert isinstance(eval(code), ParamScheduler)  # the advice runs as written
