"""Cost of dispatching events to callbacks: teachloop's per-event tables against calling every method of every callback.

For 0, 5 and 20 callbacks that each implement one training batch event, measured side by side in one run:
- dispatch only: firing the 8 events of a training batch, no model (calls per batch, microseconds per batch);
- a whole fit of a tiny linear model (microseconds per batch), to see dispatch against the rest of a batch.
Run: OMP_NUM_THREADS=1 .venv/bin/python bench/callback_dispatch.py
"""
import math
import time

import torch
from torch import nn

import teachloop.all  # noqa: F401  (every module: the default callbacks, the fast optimizer steps)
from teachloop.designs.callback_designs import AllEventsCallback, CallEveryCallback, dispatch_cost, one_event_callbacks
from teachloop.data import regression_dls
from teachloop.learner import Callback, Learner
from teachloop.optim.core import SGD

COUNTS = (0, 5, 20)


def _fit_learner(n_callbacks, call_every):
    learner_class, base = (CallEveryCallback, AllEventsCallback) if call_every else (Learner, Callback)
    learn = learner_class(regression_dls(n=2560, bs=4), nn.Linear(2, 1), nn.functional.mse_loss, opt_func=SGD, lr=0.01,
                          default_cbs=False)
    learn.add_cbs(one_event_callbacks(n_callbacks, [0], base))
    return learn


def fit_costs(n_callbacks, repeats=7):
    "Microseconds per batch of a one-epoch fit of a tiny linear model: (tables, call-every), best of `repeats`."
    # The two learners take turns, so that load from elsewhere on the machine hits both alike.
    learners = [_fit_learner(n_callbacks, False), _fit_learner(n_callbacks, True)]
    n_batches = len(learners[0].dls.train) + len(learners[0].dls.valid)
    best = [math.inf, math.inf]
    for _ in range(repeats):
        for i, learn in enumerate(learners):
            start = time.perf_counter()
            learn.fit(1)
            best[i] = min(best[i], time.perf_counter() - start)
    return [b / n_batches * 1e6 for b in best]


def main():
    torch.set_num_threads(1)
    print("dispatch only (8 events per training batch)")
    print(f"{'callbacks':>9} | {'tables calls':>12} {'µs/batch':>9} | {'call-every calls':>16} {'µs/batch':>9} | ratio")
    for n in COUNTS:
        tables_calls, tables_us = dispatch_cost(n, n_batches=5000)
        every_calls, every_us = dispatch_cost(n, call_every=True, n_batches=5000)
        print(f"{n:>9} | {tables_calls:>12.0f} {tables_us:>9.2f} | {every_calls:>16.0f} {every_us:>9.2f} | {every_us / tables_us:5.1f}x")
    print("\nwhole fit of a tiny linear model (µs per batch, training and validation batches)")
    print(f"{'callbacks':>9} | {'tables':>9} | {'call-every':>10} | ratio")
    for n in COUNTS:
        tables_us, every_us = fit_costs(n)
        print(f"{n:>9} | {tables_us:>9.1f} | {every_us:>10.1f} | {every_us / tables_us:5.2f}x")


if __name__ == '__main__':
    main()
