"""Wall time of fits of the digits CNN with and without `NaNCapture`, on one device, side by side.

Same model and initial weights, same data and batch order, default callbacks (progress bar off), SGD with
momentum. Fits with and without the callback alternate, which one goes first alternating too, so that load from
other processes hits both alike; the median of the per-pair ratios is printed, with the median time per training
step, and the same for `check_every=4`.

    .venv/bin/python bench/nan_capture_overhead.py [--runs 9] [--epochs 2] [--device cpu]
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from teachloop.data import digits_cnn, digits_dls
from teachloop.learner import Learner
from teachloop.nan_capture import NaNCapture
from teachloop.optimizer import SGD


def timed_fit(dls, init, epochs, device, cbs):
    "Seconds for one fit from the weights `init`."
    model = digits_cnn()
    model.load_state_dict(init)
    learn = Learner(dls, model.to(device), F.cross_entropy, opt_func=SGD, lr=0.05, cbs=cbs)
    learn.progress.show_bar, learn.progress.print_rows = False, False
    if device.type == 'cuda': torch.cuda.synchronize()
    start = time.perf_counter()
    learn.fit(epochs)
    if device.type == 'cuda': torch.cuda.synchronize()
    assert all(c.captured is None for c in cbs), "the benchmark fit should not produce NaNs"
    return time.perf_counter() - start


def paired_ratios(dls, init, args, device, make_cb):
    "Per-pair ratios (with / without the callback) and the times with it."
    ratios, with_times = [], []
    for run in range(args.runs):
        def with_cb(): return timed_fit(dls, init, args.epochs, device, [make_cb()])
        def without(): return timed_fit(dls, init, args.epochs, device, [])
        if run % 2: t_with, t_without = with_cb(), without()
        else: t_without, t_with = without(), with_cb()
        ratios.append(t_with / t_without)
        with_times.append(t_with)
    return ratios, with_times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=9)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--device', default='cpu')
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    dls, init = digits_dls(bs=64), digits_cnn().state_dict()
    steps = args.epochs * len(dls.train)
    folder = Path(tempfile.mkdtemp())
    timed_fit(dls, init, 1, device, [])  # warm-up
    base = [timed_fit(dls, init, args.epochs, device, []) for _ in range(3)]
    print(f"digits CNN, {device}, {args.epochs} epochs ({steps} training steps), {args.runs} pairs; "
          f"fit without NaNCapture: {statistics.median(base) / steps * 1e3:.2f} ms per training step")
    for check_every in (1, 4):
        ratios, _ = paired_ratios(dls, init, args, device, lambda: NaNCapture(folder / 'nan.pt', check_every=check_every))
        print(f"check_every={check_every}: median ratio with/without {statistics.median(ratios):.4f} "
              f"(pairs: {', '.join(f'{r:.3f}' for r in sorted(ratios))})")


if __name__ == '__main__':
    main()
