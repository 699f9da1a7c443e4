"""teachloop's optimizers against torch.optim on drawn set-ups, in float64 to 1e-10.

Hypothesis draws the parameters (shapes, frozen ones), how they are grouped (one list, lists of lists, torch-style
dicts whose 'params' are generators, with per-group hyper-parameters), which parameters have no gradient on which
step, the fast or the callback path, how gradients are zeroed, and a state_dict round trip into a new optimizer in
the middle of the run. Gradients are drawn, not computed, so that both sides see exactly the same ones.

The normal run draws 50 set-ups (`DIFFERENTIAL_EXAMPLES` changes that); the `slow` test draws 500.
"""
import math
import os
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teachloop.optim.core import SGD, Adam, RMSProp
from teachloop.optim.more import Nesterov, RAdam

pytestmark = pytest.mark.numeric

TOL = 1e-10  # float64 on both sides: the same formulas agree to ~1e-16 per step, a real difference shows far above

# name: (ours(groups, fast, **teachloop hypers), theirs(groups, **torch hypers), hypers -> torch hypers, drawn hypers)
PAIRS = {
    'sgd': (partial(SGD, decouple_wd=False), torch.optim.SGD,
            lambda h: dict(lr=h['lr'], weight_decay=h['wd']), dict(wd=(0., 0.1))),
    'sgd_momentum': (partial(SGD, decouple_wd=False), torch.optim.SGD,
                     lambda h: dict(lr=h['lr'], momentum=h['mom'], weight_decay=h['wd']), dict(mom=(0.5, 0.95), wd=(0., 0.1))),
    'nesterov': (partial(Nesterov, decouple_wd=False), partial(torch.optim.SGD, nesterov=True),
                 lambda h: dict(lr=h['lr'], momentum=h['mom'], weight_decay=h['wd']), dict(mom=(0.5, 0.95), wd=(0., 0.1))),
    'rmsprop': (partial(RMSProp, decouple_wd=False), torch.optim.RMSprop,
                lambda h: dict(lr=h['lr'], alpha=h['sqr_mom'], eps=h['eps'], weight_decay=h['wd']),
                dict(sqr_mom=(0.8, 0.999), eps=(1e-8, 1e-3), wd=(0., 0.1))),
    'adam_l2': (partial(Adam, decouple_wd=False), torch.optim.Adam,
                lambda h: dict(lr=h['lr'], betas=(h['mom'], h['sqr_mom']), eps=h['eps'], weight_decay=h['wd']),
                dict(mom=(0.5, 0.95), sqr_mom=(0.8, 0.999), eps=(1e-8, 1e-3), wd=(0., 0.1))),
    'adamw': (Adam, torch.optim.AdamW,
              lambda h: dict(lr=h['lr'], betas=(h['mom'], h['sqr_mom']), eps=h['eps'], weight_decay=h['wd']),
              dict(mom=(0.5, 0.95), sqr_mom=(0.8, 0.999), eps=(1e-8, 1e-3), wd=(0., 0.1))),
    'radam': (partial(RAdam, decouple_wd=False), torch.optim.RAdam,
              lambda h: dict(lr=h['lr'], betas=(h['mom'], h['sqr_mom']), eps=h['eps'], weight_decay=h['wd']),
              dict(mom=(0.5, 0.95), sqr_mom=(0.8, 0.999), eps=(1e-8, 1e-3), wd=(0., 0.1))),
}

EXAMPLES = int(os.environ.get('DIFFERENTIAL_EXAMPLES', 50))
SLOW_EXAMPLES = 500


def hyper(name, bounds):
    lo, hi = bounds
    if name == 'eps': return st.floats(math.log10(lo), math.log10(hi)).map(lambda e: 10 ** e)
    return st.sampled_from([0., hi]) if name == 'wd' else st.floats(lo, hi)


@st.composite
def setups(draw):
    name = draw(st.sampled_from(sorted(PAIRS)))
    shapes = draw(st.lists(st.sampled_from([(3,), (2, 3), (4, 1, 2), ()]), min_size=1, max_size=5))
    frozen = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    if all(frozen): frozen[0] = False
    n_groups = draw(st.integers(1, min(3, len(shapes))))
    group_of = [i % n_groups for i in range(len(shapes))]
    layout = draw(st.sampled_from(['flat', 'lists', 'dicts']) if n_groups > 1 else st.sampled_from(['flat', 'dicts']))
    drawn = PAIRS[name][3]
    base = {'lr': draw(st.floats(1e-3, 0.1)), **{k: draw(hyper(k, b)) for k, b in drawn.items()}}
    per_group = [{'lr': draw(st.floats(1e-3, 0.1)), **({'wd': draw(hyper('wd', drawn['wd']))} if 'wd' in drawn else {})}
                 if layout == 'dicts' else {} for _ in range(n_groups)]
    n_steps = draw(st.integers(1, 6))
    missing = [draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes))) for _ in range(n_steps)]
    return dict(name=name, shapes=shapes, frozen=frozen, group_of=group_of, n_groups=n_groups, layout=layout,
                base=base, per_group=per_group, n_steps=n_steps, missing=missing, fast=draw(st.sampled_from([None, False])),
                set_to_none=draw(st.booleans()), reload_at=draw(st.integers(0, n_steps)), seed=draw(st.integers(0, 2**16)))


def make_params(s):
    g = torch.Generator().manual_seed(s['seed'])
    params = [torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64)) for shape in s['shapes']]
    for p, frozen in zip(params, s['frozen']): p.requires_grad_(not frozen)
    return params


def grouped(s, params, translate):
    "The parameters as `s['layout']` says, with per-group hyper-parameters named by `translate`."
    groups = [[p for p, g in zip(params, s['group_of']) if g == i] for i in range(s['n_groups'])]
    if s['layout'] == 'flat': return params
    if s['layout'] == 'lists':  # teachloop's shorthand; torch takes the same groups as dicts
        return groups if translate is ours_translate else [{'params': group} for group in groups]
    return [{'params': (p for p in group), **translate(hypers)} for group, hypers in zip(groups, s['per_group'])]


def ours_translate(h): return dict(h)
def torch_group_translate(h): return {({'wd': 'weight_decay'}).get(k, k): v for k, v in h.items()}


def run(s, params, make_opt, steps_grads):
    opt = make_opt(params)
    for step, grads in enumerate(steps_grads):
        if step == s['reload_at'] and step > 0:  # a state_dict round trip into a new optimizer mid-run
            state = opt.state_dict()
            opt = make_opt(params)
            opt.load_state_dict(state)
        for p, grad in zip(params, grads):
            if p.requires_grad: p.grad = None if grad is None else grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=s['set_to_none'])
    return params


def drawn_grads(s):
    g = torch.Generator().manual_seed(s['seed'] + 1)
    return [[None if missing else torch.randn(shape, generator=g, dtype=torch.float64)
             for shape, missing in zip(s['shapes'], step_missing)] for step_missing in s['missing']]


def check(s):
    ours_func, theirs_func, to_torch, _ = PAIRS[s['name']]
    grads = drawn_grads(s)
    def ours(params): return ours_func(grouped(s, params, ours_translate), fast=s['fast'], **s['base'])
    def theirs(params): return theirs_func(grouped(s, params, torch_group_translate), **to_torch(s['base']))
    a, b = run(s, make_params(s), ours, grads), run(s, make_params(s), theirs, grads)
    diff = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert diff <= TOL, (s['name'], diff)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_optimizers_agree_with_torch(s):
    check(s)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_optimizers_agree_with_torch_many_examples(s):
    check(s)


@pytest.mark.parametrize('name', sorted(PAIRS))
def test_every_pair_moves_the_weights(name):
    "The agreement above is not met by two optimizers that do nothing: each pair changes the weights."
    s = dict(name=name, shapes=[(3,)], frozen=[False], group_of=[0], n_groups=1, layout='flat',
             base={'lr': 0.1, **{k: b[1] if k != 'wd' else 0.1 for k, b in PAIRS[name][3].items()}}, per_group=[{}],
             n_steps=3, missing=[[False]] * 3, fast=None, set_to_none=True, reload_at=2, seed=0)
    check(s)
    before = make_params(s)[0].detach().clone()
    after = run(s, make_params(s), lambda ps: PAIRS[name][0](ps, fast=None, **s['base']), drawn_grads(s))[0]
    assert (after - before).abs().max() > 1e-3
