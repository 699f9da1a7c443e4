"""Microseconds per optimizer `step()` on a 20 x (Linear 256 + LayerNorm) MLP (1.3 M parameters): teachloop's
callbacks, teachloop's fast step, and the reference implementations (torch.optim's for-loop, foreach and fused modes;
the `schedulefree` package for Schedule-Free AdamW), measured side by side. Muon steps the 20 weight matrices only.

Muon's Newton-Schulz multiplies in bfloat16 in torch.optim.Muon, and in teachloop's Muon where bfloat16 is fast (a GPU,
a CPU with bfloat16 instructions); on a CPU that emulates bfloat16, teachloop multiplies in float32 (`ns_dtype_for`).
`--emulate-bfloat16` switches oneDNN off, so that bfloat16 products take torch's generic loop as on such a CPU; its
slow steps are timed with fewer steps per round (as many as fit in about half a second, at least one):

    python bench/optimizer_step.py [--steps 50] [--rounds 5] [--device cpu|cuda] [--threads 1] [--only Muon AdEMAMix]
    python bench/optimizer_step.py --only Muon --emulate-bfloat16 --rounds 3
"""
import argparse
import statistics
import time
from functools import partial

import torch
from torch import nn

from teachloop.all import SGD, Adam, RMSProp  # teachloop.all switches the fast path on (teachloop.optim.fast)
from teachloop.all import AdEMAMix, Adafactor, Lamb, Muon, ScheduleFreeAdamW
from teachloop.optim.recent import ns_dtype_for

try: import schedulefree
except ImportError: schedulefree = None  # a test-only dependency: its contender is left out without it


def mlp(n_layers=20, width=256):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(n_layers)])


def torch_modes(cls, **kwargs):
    "The for-loop, foreach and fused variants of a torch.optim optimizer (fused where torch has it)."
    modes = {'torch for-loop': partial(cls, foreach=False, **kwargs), 'torch foreach': partial(cls, foreach=True, **kwargs)}
    if 'fused' in cls.__init__.__code__.co_varnames: modes['torch fused'] = partial(cls, fused=True, **kwargs)
    return modes


def matrices_only(make, params, **kwargs):
    "`make` given only the 2-D parameters (Muon's)."
    return make([p for p in params if p.dim() == 2], **kwargs)


def train_mode(make, params, **kwargs):
    "The optimizer from `make`, switched to train mode (the schedulefree package starts in eval mode)."
    opt = make(params, **kwargs)
    opt.train()
    return opt


def schedulefree_modes():
    "The package's for-loop and foreach variants of Schedule-Free AdamW, if it is installed."
    if schedulefree is None: return {}
    return {f'schedulefree {name}': partial(train_mode, schedulefree.AdamWScheduleFree, lr=1e-3, foreach=foreach)
            for name, foreach in (('for-loop', False), ('foreach', True))}


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
        'Muon': {'teachloop callbacks': partial(matrices_only, Muon, lr=0.02, fast=False),
                 'teachloop fast': partial(matrices_only, Muon, lr=0.02),
                 'teachloop fast, bfloat16': partial(matrices_only, Muon, lr=0.02, ns_dtype=torch.bfloat16),
                 'torch': partial(matrices_only, torch.optim.Muon, lr=0.02)},
        'Adafactor': {'teachloop callbacks': partial(Adafactor, fast=False), 'teachloop fast': Adafactor,
                      **torch_modes(torch.optim.Adafactor)},
        'Schedule-Free AdamW': {'teachloop callbacks': partial(ScheduleFreeAdamW, lr=1e-3, fast=False),
                                'teachloop fast': partial(ScheduleFreeAdamW, lr=1e-3), **schedulefree_modes()},
        'AdEMAMix': {'teachloop callbacks': partial(AdEMAMix, fast=False), 'teachloop fast': AdEMAMix},
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


def bench(algorithm_contenders, n_steps, n_rounds, device, round_seconds=0.5):
    "Median over rounds of the time per step; the contenders take turns within each round."
    opts = {name: make(f, device) for name, f in algorithm_contenders.items()}
    steps_per_round = {}
    for name, opt in opts.items():
        first = time_steps(opt, 1, device)  # plans the fast step
        if first < round_seconds: time_steps(opt, 2, device)
        steps_per_round[name] = max(1, min(n_steps, int(round_seconds / first)))  # a slow step: fewer per round
    times = {name: [] for name in opts}
    for _ in range(n_rounds):
        for name, opt in opts.items(): times[name].append(time_steps(opt, steps_per_round[name], device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(algorithm, times):
    print(f"\n{algorithm}")
    for name, t in times.items(): print(f"  {name:<26} {t * 1e6:10.0f} us")
    fast = times['teachloop fast']
    for other in times:
        if other != 'teachloop fast': print(f"  teachloop fast / {other:<26} {fast / times[other]:6.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=50)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--only', nargs='*', default=None, help="the algorithms to time (default: all)")
    parser.add_argument('--emulate-bfloat16', action='store_true',
                        help="switch oneDNN off: bfloat16 products as on a CPU without bfloat16 instructions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.emulate_bfloat16: torch.backends.mkldnn.enabled = False
    n_params = sum(p.numel() for p in mlp().parameters())
    print(f"optimizer step on a 20 x (Linear 256 + LayerNorm) MLP, {n_params / 1e6:.2f} M parameters, "
          f"{args.device}, {args.threads} thread(s), torch {torch.__version__}; teachloop's Muon multiplies in "
          f"{ns_dtype_for(args.device)}{' (bfloat16 emulated)' if args.emulate_bfloat16 else ''}")
    for algorithm, algorithm_contenders in contenders().items():
        if args.only and algorithm not in args.only: continue
        report(algorithm, bench(algorithm_contenders, args.steps, args.rounds, args.device))


if __name__ == '__main__':
    main()
