"""Schedules, ParamScheduler, the fit_* policies and lr_find, checked against the formulas and exact restoration."""
import copy
import itertools
import math
from functools import partial

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from torch import nn

from teachloop.callback.core import smooth_values
from teachloop.data import DataLoaders, regression_2d
from teachloop.learner import EventLog, Learner
from teachloop.optim.core import SGD, Adam, Optimizer, sgd_step
from teachloop.callback.schedule import (LRFinder, ParamScheduler, Stepper, annealing_cos, annealing_exp, annealing_linear,
                                annealing_no, annealing_poly, combine_scheds, combined_cos, longest_descent, minimum,
                                one_cycle_scheds, preview_values, schedule_pct, sgdr_epochs, slide, steep,
                                suggest_lrs, valley)
from teachloop.testing import digits_learner, quiet, tiny_dls, tiny_learner

PCTS = [0., 0.1, 0.25, 0.5, 0.77, 1.]


# --- annealing functions, against their formulas -------------------------------------------------------------------

@pytest.mark.parametrize('pct', PCTS)
def test_annealing_functions_match_formulas(pct):
    start, end = 3.0, 0.2
    assert annealing_no(start, end, pct) == start
    assert math.isclose(annealing_linear(start, end, pct), start * (1 - pct) + end * pct)
    assert math.isclose(annealing_cos(start, end, pct), start + (end - start) * (1 - np.cos(np.pi * pct)) / 2)
    assert math.isclose(annealing_exp(start, end, pct), math.exp(math.log(start) * (1 - pct) + math.log(end) * pct))
    for degree in (1, 2, 3.5):
        assert math.isclose(annealing_poly(degree)(start, end, pct), end + (start - end) * (1 - pct) ** degree)


def test_annealing_poly_degree_one_is_linear():
    for pct in PCTS: assert math.isclose(annealing_poly(1)(5., 1., pct), annealing_linear(5., 1., pct))


# --- stepping and combining -----------------------------------------------------------------------------------------

def test_schedule_pct_and_stepper_hit_both_ends():
    assert [schedule_pct(i, 5) for i in range(5)] == [0., 0.25, 0.5, 0.75, 1.]
    assert schedule_pct(0, 1) == 0.
    values = list(Stepper(partial(annealing_exp, 1e-3, 1e1), 5))
    assert len(values) == 5 and values[0] == 1e-3 and math.isclose(values[-1], 10.)
    assert all(math.isclose(b / a, 10.) for a, b in zip(values, values[1:]))


def test_stepper_rejects_bad_input():
    with pytest.raises(ValueError, match='n_steps'): Stepper(partial(annealing_no, 1, 1), 0)
    with pytest.raises(TypeError, match='function of pct'): Stepper(0.1, 3)


def test_combine_scheds_boundaries():
    first, second = partial(annealing_linear, 0., 1.), partial(annealing_linear, 10., 20.)
    sched = combine_scheds([0.4, 0.6], [first, second])
    assert sched(0.) == 0.
    assert math.isclose(sched(0.2), 0.5)
    assert math.isclose(sched(0.4 - 1e-9), 1., abs_tol=1e-8)  # the end of the first part
    assert sched(0.4) == 10.  # at the boundary the second part has begun
    assert math.isclose(sched(0.7), 15.)
    assert sched(1.) == 20.


def test_combine_scheds_three_parts_and_combined_cos():
    parts = [partial(annealing_no, v, None) for v in (1., 2., 3.)]
    sched = combine_scheds([0.25, 0.25, 0.5], parts)
    assert [sched(p) for p in (0., 0.24, 0.25, 0.49, 0.5, 1.)] == [1., 1., 2., 2., 3., 3.]
    cc = combined_cos(0.3, 1., 5., 2.)
    assert cc(0.) == 1. and math.isclose(cc(0.3), 5.) and math.isclose(cc(1.), 2.)
    assert math.isclose(cc(0.15), 3.)


@pytest.mark.parametrize('pcts, match', [([0.5, 0.4], 'add up to 1'), ([1.2, -0.2], '> 0'), ([1.], 'one share per')])
def test_combine_scheds_rejects_bad_shares(pcts, match):
    with pytest.raises(ValueError, match=match):
        combine_scheds(pcts, [partial(annealing_no, 1., None)] * 2)


# --- ParamScheduler and fit_one_cycle on a tiny problem ---------------------------------------------------------------

# the setting this file's expected values were worked out on: Adam at 1e-3, batches of 4 from data seed 1
def schedule_learner(n_batches, *cbs, opt_func=Adam, lr=1e-3, **kwargs):
    return tiny_learner(*cbs, dls=tiny_dls(n_batches, bs=4, seed=1, valid_bs=8), opt_func=opt_func, lr=lr,
                        default_cbs=True, **kwargs)


def one_cycle_reference(i, n_steps, lr_max, div, div_final, pct_start, moms):
    "Learning rate and momentum of batch i of a one-cycle fit, written out from the definition."
    pct = i / (n_steps - 1)
    def cos_between(a, b, t): return b + (a - b) * (1 + np.cos(np.pi * t)) / 2
    if pct < pct_start:
        t = pct / pct_start
        return cos_between(lr_max / div, lr_max, t), cos_between(moms[0], moms[1], t)
    t = (pct - pct_start) / (1 - pct_start)
    return cos_between(lr_max, lr_max / div_final, t), cos_between(moms[1], moms[2], t)


@pytest.mark.parametrize('n_epoch, n_batches', [(1, 17), (3, 3)])
def test_fit_one_cycle_start_peak_end(n_epoch, n_batches):
    lr_max, div, div_final, pct_start = 3e-2, 25., 1e5, 0.25
    learn = schedule_learner(n_batches)
    learn.fit_one_cycle(n_epoch, lr_max=lr_max)
    lrs, moms = learn.recorder.hps['lr'], learn.recorder.hps['mom']
    n_steps = n_epoch * n_batches
    peak = round(pct_start * (n_steps - 1))  # a whole number for these lengths: a batch lands on the peak
    assert len(lrs) == n_steps and peak == pct_start * (n_steps - 1)
    for got, want in ((lrs[0], lr_max / div), (lrs[peak], lr_max), (lrs[-1], lr_max / div_final), (max(lrs), lr_max),
                      (moms[0], 0.95), (moms[peak], 0.85), (moms[-1], 0.95), (min(moms), 0.85)):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12), (got, want)
    for i in range(n_steps):
        lr, mom = one_cycle_reference(i, n_steps, lr_max, div, div_final, pct_start, (0.95, 0.85, 0.95))
        assert math.isclose(lrs[i], lr, rel_tol=1e-9) and math.isclose(moms[i], mom, rel_tol=1e-9)


def test_fit_one_cycle_custom_moms_and_learner_default_lr():
    learn = schedule_learner(9, lr=1e-2)
    learn.fit_one_cycle(1, div=10., div_final=100., pct_start=0.5, moms=(0.9, 0.7, 0.8))
    lrs, moms = learn.recorder.hps['lr'], learn.recorder.hps['mom']
    assert math.isclose(lrs[0], 1e-3) and math.isclose(lrs[4], 1e-2) and math.isclose(lrs[-1], 1e-4)
    assert math.isclose(moms[0], 0.9) and math.isclose(moms[4], 0.7) and math.isclose(moms[-1], 0.8)


def test_param_scheduler_records_what_it_set_and_matches_preview():
    learn = schedule_learner(5)
    scheds = {'lr': partial(annealing_cos, 0.1, 0.001), 'sqr_mom': partial(annealing_linear, 0.9, 0.99)}
    scheduler = ParamScheduler(scheds)
    learn.fit(2, cbs=[scheduler])
    assert scheduler.hps == preview_values(scheds, 10)
    assert learn.recorder.hps['lr'] == scheduler.hps['lr'] and learn.recorder.hps['sqr_mom'] == scheduler.hps['sqr_mom']
    assert learn.opt.hypers[0]['lr'] == scheduler.hps['lr'][-1] == 0.001


def test_one_schedule_per_parameter_group():
    def two_groups(model): return [[model.weight], [model.bias]]
    learn = schedule_learner(4, opt_func=partial(SGD, mom=0.9), splitter=two_groups)
    learn.fit_one_cycle(1, lr_max=slice(1e-3, 1e-1))
    assert [h['lr'] for h in learn.opt.hypers] == pytest.approx([1e-3 / 1e5, 1e-1 / 1e5], rel=1e-9)
    scheduler = ParamScheduler(one_cycle_scheds([1e-3, 1e-1]))
    learn.fit(1, cbs=[scheduler])
    assert scheduler.hps['lr'][0] == pytest.approx([1e-3 / 25, 1e-1 / 25], rel=1e-9)
    assert [h['lr'] for h in learn.opt.hypers] == scheduler.hps['lr'][-1]
    assert learn.recorder.hps['lr'] == [v[-1] for v in scheduler.hps['lr']]  # the Recorder keeps the last group's


def test_param_scheduler_follows_pct_train():
    "The schedule is a function of the learner's progress only, so a resumed fit continues it."
    learn = schedule_learner(4)
    scheduler = ParamScheduler({'lr': partial(annealing_linear, 1.0, 0.0)})
    learn.add_cbs([scheduler])
    learn.n_epoch, learn.n_iter = 2, 4
    for done in range(8):
        learn.pct_train = done / 8
        assert math.isclose(scheduler.schedule_pct(), done / 7)


def test_fit_flat_cos_and_sgdr():
    learn = schedule_learner(5)
    learn.fit_flat_cos(2, lr=1e-2, pct_start=0.5)
    lrs = learn.recorder.hps['lr']
    assert all(math.isclose(v, 1e-2) for v in lrs[:5]) and math.isclose(lrs[-1], 1e-7) and lrs[6] < 1e-2
    assert sgdr_epochs(3, 1, 2) == [1, 2, 4]
    learn = schedule_learner(5)
    learn.fit_sgdr(2, 1, lr_max=1e-2, cycle_mult=3)  # cycles of 1 and 3 epochs: 20 batches, restart at 1/4 of the fit
    lrs = learn.recorder.hps['lr']
    restart = next(i for i in range(1, 20) if lrs[i] > lrs[i - 1])
    assert len(lrs) == 20 and lrs[0] == 1e-2 and restart == 5 and lrs[-1] < 1e-10
    assert lrs[restart] == pytest.approx(annealing_cos(1e-2, 0., (5 / 19 - 0.25) / 0.75), rel=1e-9)


# --- bad input: clear errors, nothing touched -----------------------------------------------------------------------

@pytest.mark.parametrize('kwargs, match', [
    ({'pct_start': 0.}, 'pct_start'), ({'pct_start': 1.}, 'pct_start'), ({'pct_start': 1.5}, 'pct_start'),
    ({'div': 0}, 'div'), ({'div_final': -1.}, 'div_final'), ({'moms': (0.9, 0.8)}, 'moms'),
    ({'moms': (0.9, 1.2, 0.9)}, 'mom'), ({'lr_max': -1.}, 'lr'), ({'wd': -0.1}, 'wd')])
def test_fit_one_cycle_rejects_bad_input_before_touching_anything(kwargs, match):
    learn = schedule_learner(4)
    weights = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(ValueError, match=match): learn.fit_one_cycle(1, **kwargs)
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in weights.items())
    assert learn.recorder.losses == [] and learn.opt is None


@pytest.mark.parametrize('fit', [lambda learn: learn.fit_flat_cos(1, lr=-1e-2),
                                 lambda learn: learn.fit_sgdr(2, 1, lr_max=slice(-1e-3, 1e-2)),
                                 lambda learn: learn.fit_one_cycle(1, lr_max=slice(0., 1e-2))])
def test_flat_cos_and_sgdr_reject_bad_lrs_without_creating_an_optimizer(fit):
    learn = schedule_learner(4, splitter=lambda m: [[m.weight], [m.bias]])
    with pytest.raises(ValueError, match='lr|both ends'): fit(learn)
    assert learn.opt is None and learn.recorder.losses == []


def test_fit_one_cycle_rejects_bad_n_epoch_and_moms_without_momentum():
    learn = schedule_learner(4)
    with pytest.raises(ValueError, match='n_epoch'): learn.fit_one_cycle(0)
    assert learn.opt is None
    learn = schedule_learner(4, opt_func=lambda params, lr: Optimizer(params, [sgd_step], lr=lr))
    with pytest.raises(ValueError, match="reads 'mom'"): learn.fit_one_cycle(1, moms=(0.9, 0.8, 0.9))
    assert learn.recorder.losses == []
    learn.fit_one_cycle(1)  # without `moms`, only the learning rate is scheduled
    assert 'mom' not in learn.recorder.hps and len(learn.recorder.hps['lr']) == 4


def test_unknown_hyper_name_fails_before_any_batch():
    learn = schedule_learner(4, EventLog())
    weights = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(ValueError, match="no hyper-parameter 'moms'.*'mom'"):
        learn.fit(1, cbs=[ParamScheduler({'moms': partial(annealing_no, 0.9, None)})])
    assert 'before_batch' not in learn.event_log.events
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in weights.items())


@pytest.mark.parametrize('sched', [{'moms': partial(annealing_no, 0.9, None)}, {'mom': partial(annealing_no, 0.9, None)}])
def test_a_refused_schedule_changes_nothing(sched):
    "Misspelt, or read by no callback (SGD without momentum): refused before any event, counter or hyper-parameter changes."
    learn = schedule_learner(4, EventLog(), opt_func=SGD)
    with pytest.raises(ValueError, match="'moms'|reads 'mom'"): learn.fit(1, cbs=[ParamScheduler(sched)])
    assert learn.opt is None  # the optimizer made for the refused fit is dropped again
    learn.fit(2, lr=0.05)
    opt, state = learn.opt, (learn.train_iter, learn.pct_train, learn.n_epoch, list(learn.recorder.losses))
    learn.event_log.events.clear()
    for reset_opt in (False, True):
        with pytest.raises(ValueError, match="'moms'|reads 'mom'"):
            learn.fit(3, lr=1., reset_opt=reset_opt, cbs=[ParamScheduler(sched)])
    assert learn.event_log.events == [] and learn.opt is opt and learn.opt.hypers[0]['lr'] == 0.05
    assert (learn.train_iter, learn.pct_train, learn.n_epoch, learn.recorder.losses) == state


def test_param_scheduler_rejects_bad_schedules():
    with pytest.raises(TypeError, match='dict'): ParamScheduler([partial(annealing_no, 1., None)])
    with pytest.raises(TypeError, match="'lr'"): ParamScheduler({'lr': 0.1})
    learn = schedule_learner(4)
    with pytest.raises(ValueError, match='2 schedules'):
        learn.fit(1, cbs=[ParamScheduler({'lr': [partial(annealing_no, 0.1, None)] * 2})])


@pytest.mark.parametrize('kwargs, match', [({'start_lr': 0}, 'start_lr'), ({'end_lr': 1e-8}, 'end_lr'),
                                           ({'num_it': 1}, 'num_it'), ({'num_it': 2.5}, 'num_it')])
def test_lr_find_rejects_bad_input(kwargs, match):
    learn = schedule_learner(4)
    with pytest.raises(ValueError, match=match): learn.lr_find(show_plot=False, **kwargs)
    assert learn.opt is None


# --- lr_find -----------------------------------------------------------------------------------------------------------

def opt_states_equal(a, b):
    if a.keys() != b.keys() or a['param_groups'] != b['param_groups']: return False
    for key in a['state']:
        sa, sb = a['state'][key], b['state'][key]
        if sa.keys() != sb.keys(): return False
        for name in sa:
            same = torch.equal(sa[name], sb[name]) if torch.is_tensor(sa[name]) else sa[name] == sb[name]
            if not same: return False
    return a['state'].keys() == b['state'].keys()


def test_lr_find_restores_model_and_optimizer_exactly():
    learn = digits_learner(lr=1e-3)
    learn.fit(1, lr=3e-3)
    weights, opt_state = copy.deepcopy(learn.model.state_dict()), copy.deepcopy(learn.opt.state_dict())
    opt, history = learn.opt, (learn.recorder.values, learn.recorder.losses, learn.recorder.lrs)
    suggestions = learn.lr_find(num_it=40, show_plot=False)
    assert learn.opt is opt and opt_states_equal(learn.opt.state_dict(), opt_state)
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in weights.items())
    assert learn.opt.hypers[0]['lr'] == 3e-3
    assert suggestions._fields == ('valley', 'minimum', 'steep', 'slide')
    finder = learn.lr_range_test  # the run did happen, and its values are kept beside the history
    assert len(finder.lrs) == len(finder.losses) == len(finder.smooth_losses) == 40
    assert finder.lrs == pytest.approx([1e-7 * 1e8 ** (i / 39) for i in range(40)])
    assert finder.smooth_losses == pytest.approx(smooth_values(finder.losses))
    # and the Recorder still holds the fit before it, not the range test
    assert (learn.recorder.values, learn.recorder.losses, learn.recorder.lrs) == history and len(history[2]) == 23


def test_a_checkpoint_written_after_lr_find_continues_the_fit_before_it(tmp_path):
    import teachloop.callback.checkpoint  # noqa: F401  (adds Learner.save_checkpoint)
    learn = digits_learner(lr=1e-3)
    learn.fit(2, lr=3e-3)
    learn.save_checkpoint(tmp_path / 'before.pt')
    counters = {name: getattr(learn, name) for name in ('n_epoch', 'epoch', 'iter', 'n_iter', 'train_iter', 'pct_train')}
    learn.lr_find(num_it=30, show_plot=False)
    assert {name: getattr(learn, name) for name in counters} == counters
    learn.save_checkpoint(tmp_path / 'after.pt')
    before, after = (torch.load(tmp_path / f, weights_only=False) for f in ('before.pt', 'after.pt'))
    assert after['progress'] == before['progress'] and after['progress']['epochs_done'] == 2


@pytest.mark.slow
def test_fit_after_lr_find_equals_fit_without():
    learn = digits_learner(lr=1e-3)
    learn.lr_find(num_it=30, show_plot=False)
    assert learn.opt is None
    learn.fit(1, lr=3e-3)
    twin = digits_learner(lr=1e-3)
    twin.fit(1, lr=3e-3)
    assert all(torch.equal(v, twin.model.state_dict()[k]) for k, v in learn.model.state_dict().items())


def test_lr_find_runs_no_validation_and_works_without_validation_set():
    class Steps(EventLog): observes = False  # a callback that acts on the fit stays for the range test; observers not
    learn = digits_learner(Steps(), EventLog(), lr=1e-3)
    learn.lr_find(num_it=30, show_plot=False)  # 23 batches per epoch: the search spans two epochs
    events = learn.steps.events
    assert learn.event_log.events == ['after_create']  # set aside: it would have recorded the range test
    assert events.count('before_epoch') == 2 and 'before_validate' not in events
    assert learn.dls.valid is not None
    x, y = regression_2d(n=64)
    learn = quiet(Learner(DataLoaders([(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)], None), nn.Linear(2, 1),
                          nn.functional.mse_loss, opt_func=SGD))
    learn.lr_find(num_it=20, end_lr=1e-1, show_plot=False)
    assert learn.recorder.lrs == [] and learn.recorder.values == []  # no fit yet: lr_find leaves no history


def test_lr_finder_lrs_and_smoothing_without_stopping():
    learn = schedule_learner(6, opt_func=SGD)
    finder = LRFinder(1e-4, 1e-1, num_it=10, stop_div=False)
    learn.fit(3, cbs=[finder])
    assert len(finder.lrs) == 10 and finder.lrs[0] == 1e-4 and math.isclose(finder.lrs[-1], 1e-1)
    assert all(math.isclose(b / a, 1e3 ** (1 / 9)) for a, b in zip(finder.lrs, finder.lrs[1:]))
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(finder.smooth_losses, smooth_values(finder.losses)))
    assert finder.lrs == learn.recorder.lrs


def test_lr_finder_stops_when_the_loss_diverges():
    learn = schedule_learner(50, opt_func=SGD)
    finder = LRFinder(1e-3, 1e3, num_it=50)
    learn.fit(1, cbs=[finder])
    n = len(finder.losses)
    assert n < 50
    assert finder.smooth_losses[-1] > 4 * min(finder.smooth_losses) or not math.isfinite(finder.smooth_losses[-1])
    assert all(s <= 4 * min(finder.smooth_losses[:i + 1]) for i, s in enumerate(finder.smooth_losses[:-1]))


# --- suggestions -------------------------------------------------------------------------------------------------------

def test_longest_descent_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        losses = rng.random(9)
        best = max(len(c) for r in range(1, 10) for c in itertools.combinations(range(9), r)
                   if all(losses[a] > losses[b] for a, b in zip(c, c[1:])))
        chain = longest_descent(losses)
        assert len(chain) == best and all(losses[a] > losses[b] for a, b in zip(chain, chain[1:]))


def test_suggestion_rules_on_a_known_curve():
    lrs = np.logspace(-6, 0, 61)
    x = np.log10(lrs)
    losses = 2 - np.tanh(2 * (x + 3)) + np.where(x > -1, 30 * (x + 1) ** 2, 0)  # falls fastest at 1e-3, blows up after 1e-1
    assert math.isclose(steep(lrs, losses), 1e-3, rel_tol=1e-6)
    assert math.isclose(minimum(lrs, losses), lrs[np.argmin(losses)] / 10)
    chain = longest_descent(losses)
    assert math.isclose(valley(lrs, losses), lrs[chain[len(chain) // 2]])
    assert 1e-6 <= slide(lrs, losses) <= lrs[np.argmin(losses)]
    suggestions = suggest_lrs(list(lrs), list(losses))
    assert suggestions._fields == ('valley', 'minimum', 'steep', 'slide')


def test_lr_find_plot_marks_every_suggestion():
    learn = digits_learner(lr=1e-3)
    plt.close('all')
    suggestions = learn.lr_find(num_it=30)
    labels = [line.get_label() for line in plt.gca().get_lines()]
    for name, lr in suggestions._asdict().items(): assert f"{name}: {lr:.2e}" in labels
    assert plt.gca().get_xscale() == 'log'
    plt.close('all')


# --- OptimWrapper ------------------------------------------------------------------------------------------------------

def test_param_scheduler_with_optim_wrapper():
    from teachloop.optim.interop import OptimWrapper
    def opt_func(params, lr): return OptimWrapper(params, torch.optim.SGD, lr=lr, momentum=0.9)
    learn = schedule_learner(9, opt_func=opt_func)
    learn.fit_one_cycle(1, lr_max=0.05)
    lrs, moms = learn.recorder.hps['lr'], learn.recorder.hps['mom']
    assert math.isclose(lrs[0], 0.05 / 25) and math.isclose(lrs[2], 0.05) and math.isclose(lrs[-1], 0.05 / 1e5)
    assert math.isclose(moms[2], 0.85) and math.isclose(learn.opt.hypers[0]['lr'], 0.05 / 1e5)


def test_lr_find_sets_aside_the_callbacks_that_would_stop_record_or_write_the_range_test(tmp_path):
    "A tracker would stop the test after its first epoch (no validation: its value is missing), a Checkpoint would "
    "write the test's diverging weights over the real fit's files: both sit the range test out and come back."
    from teachloop.callback.checkpoint import Checkpoint
    from teachloop.callback.tracker import EarlyStopping
    stop, ckpt = EarlyStopping('valid_loss', patience=1), Checkpoint(tmp_path)
    learn = digits_learner(stop, ckpt, lr=1e-3)
    learn.fit(1)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    learn.lr_find(num_it=60, end_lr=1e-1, stop_div=False, show_plot=False)  # 23 batches an epoch: three epochs
    assert len(learn.lr_range_test.lrs) == 60  # not cut short after an epoch
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    assert [cb for cb in learn.cbs if cb in (stop, ckpt)] == [stop, ckpt] and stop.learn is learn and ckpt.learn is learn
    assert stop.best == learn.recorder.values[0][2]  # its count is the real fit's, untouched by the range test
