import math

import torch
from torch import nn

from teachloop.designs.callback_designs import (SETTINGS, TRAINING_BATCH_EVENTS, AllEventsCallback, CallEveryCallback,
                                        dispatch_cost, fit_gluon_style, fit_teachloop_style, fit_v1_style,
                                        one_event_callbacks)
from teachloop.data import digits_dls
from teachloop.learner import EventLog, Learner
from teachloop.optim.core import SGD
from teachloop.testing import tiny_dls


def test_three_designs_give_identical_results():
    settings = dict(SETTINGS, n_epoch=2, min_delta=0.)
    runs = [fit(**settings) for fit in (fit_teachloop_style, fit_v1_style, fit_gluon_style)]
    reference = runs[0]
    assert len(reference.logged) == (2 * len(digits_dls().train)) // settings['log_every'] and reference.epochs_run == 2
    for run in runs[1:]:
        assert run.logged == reference.logged and run.epochs_run == reference.epochs_run
        assert len(run.valid_losses) == 2
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(run.valid_losses, reference.valid_losses))
        assert all(torch.equal(run.weights[k], reference.weights[k]) for k in reference.weights)


def test_clipping_and_early_stopping_change_the_result():
    base = dict(SETTINGS, n_epoch=2, min_delta=0.)
    clipped, unclipped = fit_v1_style(**base), fit_v1_style(**dict(base, clip=100.))
    assert not all(torch.equal(clipped.weights[k], unclipped.weights[k]) for k in clipped.weights)
    stopped = fit_gluon_style(**dict(base, n_epoch=3, min_delta=100.))  # the second epoch cannot improve enough
    assert stopped.epochs_run == 2 and len(stopped.valid_losses) == 2


def test_dispatch_call_counts_per_batch():
    for n in (0, 3, 8, 20):
        assert dispatch_cost(n, n_batches=10, repeats=2)[0] == n
        assert dispatch_cost(n, call_every=True, n_batches=10, repeats=2)[0] == len(TRAINING_BATCH_EVENTS) * n


def test_call_every_calls_every_method_of_every_callback_in_a_fit():
    k = 4
    for learner_class, base in ((CallEveryCallback, AllEventsCallback), (Learner, None)):
        tally, log = [0], EventLog()
        learn = learner_class(tiny_dls(3, valid_bs=16), nn.Linear(2, 1), nn.functional.mse_loss, opt_func=SGD,
                              default_cbs=False)
        cbs = one_event_callbacks(k, tally, base) if base else one_event_callbacks(k, tally)
        learn.add_cbs([log] + cbs)
        learn.fit(2)
        if base: assert tally[0] == k * len(log.events)
        else: assert tally[0] == sum(log.events.count(TRAINING_BATCH_EVENTS[i]) for i in range(k))


def test_call_every_trains_like_the_learner():
    def train(learner_class):
        torch.manual_seed(0)
        learn = learner_class(tiny_dls(3, valid_bs=16), nn.Linear(2, 1), nn.functional.mse_loss, opt_func=SGD, lr=0.1,
                              default_cbs=False)
        learn.fit(3)
        return learn.model.weight.detach().clone(), learn.train_iter
    (w_tables, iters_tables), (w_every, iters_every) = train(Learner), train(CallEveryCallback)
    assert torch.equal(w_tables, w_every) and iters_tables == iters_every == 9
