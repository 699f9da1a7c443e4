"""Microseconds per optimizer `step()` on a 20 x (Linear 256 + LayerNorm) MLP (1.3 M parameters): teachloop's
callbacks, teachloop's fast step, and torch.optim's for-loop, foreach and fused modes, measured side by side.

    python bench/optimizer_step.py [--steps 50] [--rounds 5] [--device cpu|cuda] [--threads 1]
"""
import argparse
import statistics
import time
from functools import partial

import torch
from torch import nn

from teachloop.all import SGD, Adam, RMSProp  # teachloop.all switches the fast path on (teachloop.fast)
from teachloop.all import Lamb


def mlp(n_layers=20, width=256):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(n_layers)])


def torch_modes(cls, **kwargs):
    "The for-loop, foreach and fused variants of a torch.optim optimizer (fused where torch has it)."
    modes = {'torch for-loop': partial(cls, foreach=False, **kwargs), 'torch foreach': partial(cls, foreach=True, **kwargs)}
    if 'fused' in cls.__init__.__code__.co_varnames: modes['torch fused'] = partial(cls, fused=True, **kwargs)
    return modes


def contenders():
    "For each algorithm, the optimizers that compute it."
    return {
        'SGD momentum': {'teachloop callbacks': partial(SGD, lr=1e-3, mom=0.9, fast=False),
                         'teachloop fast': partial(SGD, lr=1e-3, mom=0.9),
                         **torch_modes(torch.optim.SGD, lr=1e-3, momentum=0.9)},
        'RMSProp': {'teachloop callbacks': partial(RMSProp, lr=1e-3, fast=False),
                    'teachloop fast': partial(RMSProp, lr=1e-3), **torch_modes(torch.optim.RMSprop, lr=1e-3)},
        'AdamW': {'teachloop callbacks': partial(Adam, lr=1e-3, fast=False), 'teachloop fast': partial(Adam, lr=1e-3),
                  **torch_modes(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01)},
        'Adam (L2)': {'teachloop callbacks': partial(Adam, lr=1e-3, decouple_wd=False, fast=False),
                      'teachloop fast': partial(Adam, lr=1e-3, decouple_wd=False),
                      **torch_modes(torch.optim.Adam, lr=1e-3, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01)},
        'LAMB': {'teachloop callbacks': partial(Lamb, fast=False), 'teachloop fast': Lamb},
    }


def make(opt_func, device):
    torch.manual_seed(0)
    model = mlp().to(device)
    for p in model.parameters(): p.grad = torch.randn_like(p) * 1e-3
    return opt_func(model.parameters())


def time_steps(opt, n_steps, device):
    "Mean seconds per step over `n_steps` steps."
    if device == 'cuda': torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n_steps): opt.step()
    if device == 'cuda': torch.cuda.synchronize()
    return (time.perf_counter() - start) / n_steps


def bench(algorithm_contenders, n_steps, n_rounds, device):
    "Median over rounds of the time per step; the contenders take turns within each round."
    opts = {name: make(f, device) for name, f in algorithm_contenders.items()}
    for opt in opts.values(): time_steps(opt, 3, device)
    times = {name: [] for name in opts}
    for _ in range(n_rounds):
        for name, opt in opts.items(): times[name].append(time_steps(opt, n_steps, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(algorithm, times):
    print(f"\n{algorithm}")
    for name, t in times.items(): print(f"  {name:<20} {t * 1e6:10.0f} us")
    fast = times['teachloop fast']
    for other in ('teachloop callbacks', 'torch for-loop', 'torch foreach', 'torch fused'):
        if other in times: print(f"  teachloop fast / {other:<19} {fast / times[other]:6.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=50)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n_params = sum(p.numel() for p in mlp().parameters())
    print(f"optimizer step on a 20 x (Linear 256 + LayerNorm) MLP, {n_params / 1e6:.2f} M parameters, "
          f"{args.device}, {args.threads} thread(s), torch {torch.__version__}")
    for algorithm, algorithm_contenders in contenders().items():
        report(algorithm, bench(algorithm_contenders, args.steps, args.rounds, args.device))


if __name__ == '__main__':
    main()
