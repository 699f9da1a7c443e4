"""Wall time of `Learner.fit` with its default callbacks against a hand-written PyTorch loop.

Same model and initial weights, same digits data and batch order, same optimizer, same number of steps, a
validation pass per epoch in both. The progress bar runs, its output discarded. Runs alternate; the median of the
per-pair ratios is printed.

    .venv/bin/python bench/loop_overhead.py [--runs 7] [--epochs 3] [--device cpu]
"""
import argparse
import contextlib
import copy
import io
import statistics
import time

import torch
from torch.nn import functional as F

import teachloop.all  # noqa: F401  (every module: the default callbacks, the fast optimizer steps)
from teachloop.callback.core import accuracy
from teachloop.data import digits_cnn, digits_dls
from teachloop.learner import Learner
from teachloop.optim.core import SGD


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize()


def hand_written_fit(model, dls, epochs, device):
    "The loop a careful user writes: losses kept on the device, read once per epoch."
    model.to(device)
    opt = SGD(model.parameters(), lr=0.05, mom=0.9)
    rows = []
    for _ in range(epochs):
        model.train()
        train_losses = []
        for xb, yb in dls.train:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward(); opt.step(); opt.zero_grad()
            train_losses.append(loss.detach())
        model.eval()
        valid_loss, correct, n = 0., 0, 0
        with torch.no_grad():
            for xb, yb in dls.valid:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                out = model(xb)
                valid_loss = valid_loss + F.cross_entropy(out, yb, reduction='sum')
                correct = correct + (out.argmax(-1) == yb).sum()
                n += len(yb)
        rows.append([torch.stack(train_losses).mean().item(), (valid_loss / n).item(), (correct / n).item()])
    sync(device)
    return rows


def learner_fit(model, dls, epochs, device):
    learn = Learner(dls, model, F.cross_entropy, opt_func=lambda p, lr: SGD(p, lr=lr, mom=0.9), lr=0.05,
                    metrics=[accuracy])
    learn.device.device = device
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        learn.fit(epochs)
    sync(device)
    return learn.recorder.values


def timed(fn, *args):
    "Wall time and this process's CPU time of `fn(*args)`; CPU time is steadier when other work shares the cores."
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--runs', type=int, default=7)
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model0 = digits_cnn()
    def run(fn): return timed(fn, copy.deepcopy(model0), digits_dls(bs=64, seed=0), args.epochs, device)
    run(hand_written_fit); run(learner_fit)  # warm-up: first-call costs of both
    hand, learner = [], []
    for i in range(args.runs):
        order = (hand_written_fit, learner_fit) if i % 2 == 0 else (learner_fit, hand_written_fit)
        for fn in order: (hand if fn is hand_written_fit else learner).append(run(fn))
    steps = args.epochs * len(digits_dls(bs=64).train)
    print(f"device {device}, {args.epochs} epochs = {steps} steps + validation, {args.runs} alternating runs")
    for i, clock in enumerate(('wall', 'cpu')):
        h, l = [t[i] for t in hand], [t[i] for t in learner]
        ratios = [a / b for a, b in zip(l, h)]
        print(f"{clock:>4} time: hand-written {statistics.median(h) * 1e3:7.1f} ms, Learner.fit "
              f"{statistics.median(l) * 1e3:7.1f} ms, ratio median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == '__main__':
    main()
