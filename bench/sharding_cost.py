"""What sharding costs and saves on the CPU: the digits CNN with Adam trained by teachloop in one process without
`learn.distributed()`, and in 1 and 2 processes (gloo, one thread each) with DDP (`strategy='ddp'`: every rank holds the
whole model and optimizer state) and FSDP2 (`strategy='fsdp'`: each rank its rows of every parameter, gradient and state).
The three fits run in the same processes, in turn, many times (so that a shared machine's load falls on them alike),
in a rotating order; samples a second from the medians of the slowest rank's times, each time ratio the median over
the rounds of one fit's time over the DDP fit's beside it, and the bytes each rank holds of parameters and of the
optimizer's state (the tensors this rank's fit reads and writes: its shards under FSDP2).

    OMP_NUM_THREADS=1 python bench/sharding_cost.py [--epochs 4] [--repeats 9] [--bs 64]
"""
import argparse
import statistics
import time
from contextlib import ExitStack
from functools import partial

import torch
import torch.distributed as dist
from torch.nn import functional as F

from teachloop.callback.distributed import run_ranks
from teachloop.data import digits_cnn, load_digits_tensors, tensor_dls
from teachloop.learner import Learner
from teachloop.optim.core import Adam, _sharded
from teachloop.random_state import set_seed

FITS = ('alone', 'ddp', 'fsdp')


def learner(bs):
    set_seed(0)
    learn = Learner(tensor_dls(*load_digits_tensors(), bs=bs), digits_cnn(), F.cross_entropy,
                    opt_func=partial(Adam, wd=0.01), lr=1e-3, metrics=[])
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def local(t): return t.to_local() if _sharded(t) else t


def bytes_held(learn):
    "Bytes of parameters and of optimizer state tensors this process holds (its shards of sharded ones)."
    params = sum(local(p).numel() * p.element_size() for p in learn.model.parameters())
    state = sum(local(v).numel() * v.element_size() for s in learn.opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return params, state


def timed(fit, epochs):
    if dist.is_initialized(): dist.barrier()
    start = time.perf_counter()
    fit(epochs)
    return time.perf_counter() - start


def in_turn(bs, epochs, repeats):
    "In this rank: seconds of `epochs` epochs of each fit, in a rotating order, `repeats` times; the bytes each holds."
    learners = {name: learner(bs) for name in FITS}
    with ExitStack() as blocks:
        for name in ('ddp', 'fsdp'): blocks.enter_context(learners[name].distributed(strategy=name))
        # alone: a fit of this process's own, on the whole data (a world of 1 only: the others would wait for it)
        fits = {name: learn.fit for name, learn in learners.items() if name != 'alone' or dist.get_world_size() == 1}
        for fit in fits.values(): fit(1)  # warm-up
        times = []
        for i in range(repeats):
            order = list(fits)[i % len(fits):] + list(fits)[:i % len(fits)]
            times.append({name: timed(fits[name], epochs) for name in order})
        held = {name: bytes_held(learners[name]) for name in fits}
    samples = len(learners['ddp'].dls.train.dataset) * epochs
    return times, held, samples


def report(world_size, bs, epochs, repeats):
    ranks = run_ranks(in_turn, bs, epochs, repeats, world_size=world_size, threads=1, timeout=3600.)
    samples = ranks[0][2]
    held = {name: tuple(max(rank[1][name][k] for rank in ranks) for k in (0, 1)) for name in ranks[0][1]}  # the largest
    slowest = [{name: max(rank[0][i][name] for rank in ranks) for name in held} for i in range(repeats)]
    rows = []
    for name in held:
        speed = samples / statistics.median(t[name] for t in slowest)
        ratio = statistics.median(t[name] / t['ddp'] for t in slowest)
        rows.append((world_size, name, speed, ratio, *held[name]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--epochs', type=int, default=4, help='epochs a timed run')
    parser.add_argument('--repeats', type=int, default=9, help='rounds of timed runs (each fit once a round)')
    parser.add_argument('--bs', type=int, default=64, help='items per batch in each process')
    args = parser.parse_args(argv)
    print(f"digits CNN, Adam, batches of {args.bs} per process, {args.epochs} epochs timed, medians of "
          f"{args.repeats} rounds, torch {torch.__version__}")
    print(f"{'processes':>9}  {'fit':>6}  {'samples/s':>9}  {'time / DDP':>10}  {'param bytes/rank':>16}  {'state bytes/rank':>16}")
    for world_size in (1, 2):
        for row in report(world_size, args.bs, args.epochs, args.repeats):
            print("{:>9}  {:>6}  {:>9.0f}  {:>10.3f}  {:>16,}  {:>16,}".format(*row))


if __name__ == '__main__':
    main()
