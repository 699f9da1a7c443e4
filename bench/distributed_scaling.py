"""Samples per second of data-parallel training on the CPU, in 1 and 2 processes (gloo, one thread each): teachloop's
`learn.distributed()` against a plain loop of torch's own (DistributedDataParallel, DistributedSampler, torch.optim.SGD),
the same model, data, batch and work per epoch (a training pass and a validation pass whose loss and accuracy are summed
over the processes). Both run in the same processes, in turn, many times (so that the load of a shared machine falls
on both alike), each going first in every other pair (so that neither gains from the order): samples a second from the
medians of the slowest rank's times, and the median over the pairs of the ratio of teachloop's time to the plain loop's.

    OMP_NUM_THREADS=1 python bench/distributed_scaling.py [--epochs 8] [--repeats 16] [--bs 64]
"""
import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from teachloop.data import digits_cnn, load_digits_tensors, tensor_dls
from teachloop.callback.distributed import ShardSampler, run_ranks
from teachloop.learner import Learner
from teachloop.optim.core import SGD
from teachloop.random_state import set_seed


def teachloop_learner(bs):
    set_seed(0)
    learn = Learner(tensor_dls(*load_digits_tensors(), bs=bs), digits_cnn(), F.cross_entropy,
                    opt_func=partial(SGD, mom=0.9), lr=0.05, metrics=[])
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def plain_epoch(model, opt, train, valid, epoch):
    "One epoch of a plain torch loop: DDP, a DistributedSampler, torch.optim.SGD, validation on shards summed."
    train.sampler.set_epoch(epoch)
    model.train()
    for xb, yb in train:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.module.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for xb, yb in valid: totals += torch.stack([F.cross_entropy(model.module(xb), yb, reduction='sum'),
                                                     torch.tensor(float(len(yb)))])
    dist.all_reduce(totals)
    return totals[0] / totals[1]


def plain_loop(bs):
    "A function running `n` epochs of the plain loop on the same data and model."
    set_seed(0)
    dls = tensor_dls(*load_digits_tensors(), bs=bs)
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(dls.train.dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
    train = DataLoader(dls.train.dataset, batch_size=bs, sampler=sampler)
    valid = DataLoader(dls.valid.dataset, batch_size=bs * 2, sampler=ShardSampler(len(dls.valid.dataset), rank, world))
    model = DistributedDataParallel(digits_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochs = iter(range(10**6))
    def run(n):
        for _ in range(n): plain_epoch(model, opt, train, valid, next(epochs))
    return run, len(sampler) * world


def timed(run, n):
    dist.barrier()
    start = time.perf_counter()
    run(n)
    return time.perf_counter() - start


def both_in_turn(bs, epochs, repeats):
    "In this rank: seconds of `epochs` epochs of teachloop's fit and of the plain loop, in turn, `repeats` times each."
    learn = teachloop_learner(bs)
    plain, samples = plain_loop(bs)
    with learn.distributed():
        learn.fit(1); plain(1)  # warm-up
        times = []
        for i in range(repeats):  # (teachloop's time, the plain loop's), the plain loop first in every other pair
            if i % 2: times.append(tuple(reversed((timed(plain, epochs), timed(learn.fit, epochs)))))
            else: times.append((timed(learn.fit, epochs), timed(plain, epochs)))
    return times, samples * epochs


def samples_per_second(world_size, bs, epochs, repeats):
    "Samples a second for teachloop and for the plain loop (medians of the slowest rank), and the median of their ratios."
    ranks = run_ranks(both_in_turn, bs, epochs, repeats, world_size=world_size, threads=1)
    samples = ranks[0][1]
    slowest = [tuple(max(rank[0][i][k] for rank in ranks) for k in (0, 1)) for i in range(repeats)]
    # each teachloop run is compared with the plain run next to it, which met about the same load
    ratio = statistics.median(ours / plain for ours, plain in slowest)
    return (*(samples / statistics.median(t[k] for t in slowest) for k in (0, 1)), ratio)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--epochs', type=int, default=8, help='epochs a timed run')
    parser.add_argument('--repeats', type=int, default=16, help='pairs of timed runs')
    parser.add_argument('--bs', type=int, default=64, help='items per batch in each process')
    args = parser.parse_args(argv)
    print(f"digits CNN, batches of {args.bs} per process, SGD with momentum, {args.epochs} epochs timed, "
          f"medians of {args.repeats} runs each, torch {torch.__version__}")
    print(f"{'processes':>9}  {'teachloop samples/s':>19}  {'plain DDP samples/s':>19}  {'time ratio (median of pairs)':>28}")
    for world_size in (1, 2):
        ours, plain, ratio = samples_per_second(world_size, args.bs, args.epochs, args.repeats)
        print(f"{world_size:>9}  {ours:>19.0f}  {plain:>19.0f}  {ratio:>28.3f}")


if __name__ == '__main__':
    main()
