"""Cost of `TrainingDashboard` on a fit of the digits CNN on the CPU, measured side by side in one run.

Same model, initial weights, data order and default callbacks (progress bar off), Adam, one torch thread. Each pair
runs the fit without and with the dashboard (which goes first alternates) and the ratio of the two fit times is taken;
the figure is the median of the per-pair ratios (neighbouring fits share the machine's load, which on a shared
2-core machine moves whole fits by 10-40 %).

Also printed: the fastest fit with the dashboard over the fastest without (the least disturbed of each), and two more
figures robust to the machine's load (other processes on a shared machine stretch wall times, not the
CPU time a thread uses): the paired ratio of the training thread's CPU time (`time.thread_time`), and the time spent
inside the dashboard's event handlers (ticks included) as a share of the fit's time. For the headless variant, where
the dashboard has no thread of its own, the CPU-time ratio is the figure to trust; for the live one it leaves out the
display thread, so there only the wall-time ratio counts.

Variants:
- `headless`: the default dashboard as a script or `nbdev-test` runs it (ticks every 0.25 s: buffers drained, effective
  learning rates computed; the final figure not drawn since nobody would see it).
- `live`: the same with `live=True`: a display thread draws every tick's frame (PNG into an ipywidgets Image without
  a frontend). Drawing competes with the fit for the CPU and the GIL, so this is the cost of watching on a CPU fit.
- `panels`: the headless dashboard with a `LayerStats` callback at its default tick (every 100 batches) and the
  effective learning rates kept over the fit (read at every tick, as when a figure will be shown): the cost of the
  new panels' measurements, to hold to 1.05 of a fit without the dashboard.
- `panels-live`: the same, drawn live with the third row of panels.

Then the cost of one `Sharpness` estimate (20 power iterations) on the same model, in training steps: it is not
cheap, so it is measured and printed rather than hidden in a ratio; every `every` steps it adds estimate / every.

The live variant runs longer fits (`--live-epochs`): its cost has a fixed part (the widgets and the figure are made)
and a steady part (the display thread draws in at most ~20 % of the time, by design, but holds the GIL meanwhile).

    .venv/bin/python bench/dashboard_overhead.py [--runs 11] [--epochs 5] [--live-epochs 15]
        [--variants headless live panels panels-live]
"""
import argparse
import statistics
import time

import torch
from torch.nn import functional as F

import teachloop.all  # noqa: F401  (every module: the default callbacks, the fast optimizer steps)
from teachloop.dashboard.live import TrainingDashboard
from teachloop.data import digits_cnn, digits_dls
from teachloop.diagnostics.layer_stats import LayerStats
from teachloop.learner import Learner
from teachloop.diagnostics.sharpness import Sharpness


HANDLERS = ('before_fit', 'before_batch', 'before_step', 'after_step', 'after_batch', 'after_train', 'after_validate',
            'cleanup_fit')


class TimedDashboard(TrainingDashboard):
    "The dashboard, adding up the time spent in its event handlers."
    seconds = 0.

def _timed(name):
    def handler(self):
        start = time.perf_counter()
        try:
            getattr(TrainingDashboard, name)(self)
            # as when a figure will be shown (a notebook, a file), without the cost of drawing it at the end
            if name == 'before_fit' and getattr(self, 'reads_effective_lrs', False): self._seen = True
        finally: self.seconds += time.perf_counter() - start
    handler.__name__ = name
    return handler

for _name in HANDLERS: setattr(TimedDashboard, _name, _timed(_name))


def digits_learner():
    torch.manual_seed(0)
    learn = Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, lr=3e-3)
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def fit_seconds(epochs, dashboard=None):
    "Wall time and the training thread's CPU time of one fit from the same start (weights, data order)."
    learn = digits_learner()
    cbs = None if dashboard is None else [dashboard] + getattr(dashboard, 'companions', [])
    start, start_cpu = time.perf_counter(), time.thread_time()
    learn.fit(epochs, cbs=cbs)
    return time.perf_counter() - start, time.thread_time() - start_cpu


def with_panels(dashboard):
    "The dashboard, with the callbacks its third row of panels reads (fitted alongside it)."
    dashboard.companions, dashboard.reads_effective_lrs = [LayerStats()], True
    return dashboard


def sharpness_cost(power_iters=20, repeats=5):
    "Seconds of one sharpness estimate, and of one training step, on the digits CNN (median of `repeats`)."
    learn = digits_learner()
    sharp = Sharpness(every=10 ** 9, power_iters=power_iters)
    learn.fit(1, cbs=[sharp])  # takes the fixed batch; `every` is too large for an estimate during the fit
    sharp.learn = learn
    estimates = []
    for _ in range(repeats):
        start = time.perf_counter(); sharp.estimate(learn.opt.param_groups[0]['lr']); estimates.append(time.perf_counter() - start)
    steps = [fit_seconds(1)[0] / len(learn.dls.train) for _ in range(repeats)]
    return statistics.median(estimates), statistics.median(steps)


def paired_ratios(runs, epochs, make_dashboard):
    "Per pair of fits (without, with the dashboard; the order alternates): wall and CPU ratios, fastest fits, dashboards."
    ratios, cpu_ratios, dashboards, fastest = [], [], [], {False: float('inf'), True: float('inf')}
    for i in range(runs):
        order = (False, True) if i % 2 == 0 else (True, False)
        wall, cpu = {}, {}
        for with_dashboard in order:
            dashboard = make_dashboard() if with_dashboard else None
            wall[with_dashboard], cpu[with_dashboard] = fit_seconds(epochs, dashboard)
            fastest[with_dashboard] = min(fastest[with_dashboard], wall[with_dashboard])
            if dashboard is not None: dashboards.append((dashboard, wall[True]))
        ratios.append(wall[True] / wall[False])
        cpu_ratios.append(cpu[True] / cpu[False])
    return ratios, cpu_ratios, dashboards, fastest[True] / fastest[False]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=11)
    parser.add_argument('--epochs', type=int, default=5)
    parser.add_argument('--live-epochs', type=int, default=15)
    variants = ['headless', 'live', 'panels', 'panels-live']
    parser.add_argument('--variants', nargs='+', default=variants, choices=variants)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fit_seconds(1)  # warm up
    print(f"digits CNN, CPU, 1 thread, {args.runs} pairs per variant")
    makers = {'headless': lambda: TimedDashboard(live=False), 'live': lambda: TimedDashboard(live=True),
              'panels': lambda: with_panels(TimedDashboard(live=False)),
              'panels-live': lambda: with_panels(TimedDashboard(live=True))}
    for variant in args.variants:
        epochs = args.live_epochs if variant.endswith('live') else args.epochs
        base, _ = fit_seconds(epochs)
        ratios, cpu_ratios, dashboards, fastest_ratio = paired_ratios(args.runs, epochs, makers[variant])
        print(f"{variant:>8}, {epochs} epochs (~{base:.1f} s a fit), with / without the dashboard:\n"
              f"          wall time ratio {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}), "
              f"training-thread CPU time ratio {statistics.median(cpu_ratios):.3f} (pairs {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}),\n"
              f"          fastest fit with / fastest without {fastest_ratio:.3f}, "
              f"time in its handlers {statistics.median([d.seconds / wall for d, wall in dashboards]):.1%} of the fit, "
              f"ticks per fit {statistics.median([d.ticks for d, _ in dashboards]):.0f}, "
              f"frames per fit {statistics.median([d.frames for d, _ in dashboards]):.0f}")
    estimate, step = sharpness_cost()
    print(f"sharpness, one estimate of 20 power iterations: {estimate * 1e3:.0f} ms = {estimate / step:.0f} training steps "
          f"({step * 1e3:.1f} ms each); every 500 steps it adds {estimate / (500 * step):.1%}")


if __name__ == '__main__':
    main()
