"""Cost of `NaNCapture` per training step of the digits CNN on the CPU, measured side by side in one run.

Same model and initial weights, same data and batch order, default callbacks (progress bar off), SGD with momentum,
one thread. Two measurements:

1. Interleaved (the figure to trust on a shared machine): in one fit the callback works on even training steps only,
   and each step's time is recorded (from the first `before_batch` handler to the last `after_batch` handler). The
   ratio is median(steps with the callback) / median(steps without it). Neighbouring steps share the machine's
   load, which on a shared 2-core machine changes the speed of whole fits by 10-40 %, drowning a 1 % effect.
   Median over `--runs` fits.
2. Whole fits with and without the callback, alternating (which goes first alternating too): the median of the
   per-pair ratios of total fit times, and of the fits' median step times. These include what the callback costs on
   every step (its handlers are called even on steps it does not check), which (1) cancels out. The wall-time figure
   swings by several percent on a shared machine; the median step time is robust to short bursts of other load. The
   same pairs with no callback in either fit show the method's own noise, to read the first figure against.

Both are printed for the default `NaNCapture(path)` (`rngs='auto'`: a generator's state is read at every step only if
the first step drew from it, and the digits CNN's steps draw from none). The interleaved figure is also printed for
`rngs='every_step'` (torch's, numpy's and Python's random states read at every step).
With `check_every=k` the work is done on one step in k, so its cost per step is the interleaved cost divided by k.

    .venv/bin/python bench/nan_capture_overhead.py [--runs 9] [--epochs 4] [--pairs 21]
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import teachloop.all  # noqa: F401  (every module: the default callbacks, the fast optimizer steps)
from teachloop.data import digits_cnn, digits_dls
from teachloop.learner import Callback, Learner
from teachloop.callback.nan_capture import NaNCapture
from teachloop.optim.core import SGD


class StepStart(Callback):
    "Note when a training step starts, before any other callback."
    order, run_valid = -1000, False
    def __init__(self): self.started, self.times = 0., []
    def before_batch(self): self.started = time.perf_counter()


class StepEnd(Callback):
    "Record the step's duration (with its step count), after every other callback."
    order, run_valid = 1000, False
    def after_batch(self): self.step_start.times.append((self.train_iter, time.perf_counter() - self.step_start.started))


class OnEvenSteps(NaNCapture):
    "`NaNCapture` that works on even training steps only."
    def __init__(self, path, rngs): super().__init__(path, rngs=rngs)
    def before_batch(self):
        if self.train_iter % 2 == 0: super().before_batch()
    def before_step(self):
        if self.train_iter % 2 == 0: super().before_step()


def make_learner(dls, init, cbs):
    model = digits_cnn()
    model.load_state_dict(init)
    learn = Learner(dls, model, F.cross_entropy, opt_func=SGD, lr=0.05, cbs=cbs)
    learn.progress.show_bar, learn.progress.print_rows = False, False
    return learn


def interleaved_ratio(dls, init, epochs, path, rngs):
    "median step time with the callback / without, from one fit where it works on every other step."
    start = StepStart()
    capture = OnEvenSteps(path, rngs)
    make_learner(dls, init, [capture, start, StepEnd()]).fit(epochs)
    assert capture.captured is None, "the benchmark fit should not produce NaNs"
    # train_iter is counted in after_batch (order -10), before StepEnd: a step's own count is one less
    on = [t for i, t in start.times if (i - 1) % 2 == 0]
    off = [t for i, t in start.times if (i - 1) % 2 == 1]
    return statistics.median(on) / statistics.median(off), statistics.median(on) - statistics.median(off), statistics.median(off)


def fit_time(dls, init, epochs, cbs):
    "The fit's wall time, and its median training-step time (a step timed as in the interleaved measurement)."
    steps = StepStart()
    learn = make_learner(dls, init, [*cbs, steps, StepEnd()])
    start = time.perf_counter()
    learn.fit(epochs)
    return time.perf_counter() - start, statistics.median(t for _, t in steps.times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=9)
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--pairs', type=int, default=21, help='whole-fit pairs (they are noisy: use many)')
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dls, init = digits_dls(bs=64), digits_cnn().state_dict()
    path = Path(tempfile.mkdtemp()) / 'nan.pt'
    fit_time(dls, init, 1, [])  # warm-up
    print(f"digits CNN, CPU, 1 thread, {args.epochs} epochs x {len(dls.train)} steps, {args.runs} interleaved runs, "
          f"{args.pairs} whole-fit pairs")
    for rngs in ('auto', 'every_step'):
        results = [interleaved_ratio(dls, init, args.epochs, path, rngs) for _ in range(args.runs)]
        ratios = sorted(r for r, _, _ in results)
        cost, step = statistics.median(c for _, c, _ in results), statistics.median(s for _, _, s in results)
        print(f"interleaved, check_every=1, rngs={rngs!r}: median ratio {statistics.median(ratios):.4f} "
              f"(runs {', '.join(f'{r:.3f}' for r in ratios)}); {cost * 1e6:.0f} us on a {step * 1e3:.2f} ms step; "
              f"so check_every=4 about {1 + (statistics.median(ratios) - 1) / 4:.4f}")
    for title, callbacks in (('default NaNCapture(path)', lambda: [NaNCapture(path)]),
                             ('no callback in either fit (the method\'s own noise)', lambda: [])):
        totals, steps = [], []
        for run in range(args.pairs):
            timings = {}
            for name in (('without', 'with') if run % 2 == 0 else ('with', 'without')):
                timings[name] = fit_time(dls, init, args.epochs, callbacks() if name == 'with' else [])
            totals.append(timings['with'][0] / timings['without'][0])
            steps.append(timings['with'][1] / timings['without'][1])
        for label, pairs in (('wall time', totals), ('median step time', steps)):
            quartiles = statistics.quantiles(pairs, n=4)
            print(f"whole fits, {title}, {label}: median ratio {statistics.median(pairs):.4f} "
                  f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})")


if __name__ == '__main__':
    main()
