"The optimizers of notebook 07 against torch.optim or plain-tensor implementations of their papers' updates."
import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from teachloop.data import digits_cnn
from teachloop.optim.core import SGD, Adam
from teachloop.optim.more import LARC, LARS, Lamb, Lion, Lookahead, Nesterov, QHAdam, RAdam
from teachloop.testing import digits_batches

pytestmark = pytest.mark.numeric

N_STEPS = 40  # past what changes over an optimizer's first steps (RAdam rectifies from step 6, Lookahead syncs every 3-5)


@pytest.fixture(scope='module')
def batches(): return digits_batches(N_STEPS)


class PaperReference:
    "A plain-tensor optimizer: `update(w, g, state, t)` changes the weight `w` in place at step `t`."
    def __init__(self, params, update):
        self.params, self.update, self.t = list(params), update, 0
        self.states = [{} for _ in self.params]

    @torch.no_grad()
    def step(self):
        self.t += 1
        for w, state in zip(self.params, self.states): self.update(w, w.grad.clone(), state, self.t)

    def zero_grad(self):
        for w in self.params: w.grad = None


def reference(update): return lambda params: PaperReference(params, update)


def qhadam_update(w, g, s, t, lr, b1, b2, nu1, nu2, eps):
    s['m'] = b1 * s.get('m', torch.zeros_like(w)) + (1 - b1) * g
    s['v'] = b2 * s.get('v', torch.zeros_like(w)) + (1 - b2) * g * g
    m_hat, v_hat = s['m'] / (1 - b1 ** t), s['v'] / (1 - b2 ** t)
    w -= lr * ((1 - nu1) * g + nu1 * m_hat) / (((1 - nu2) * g * g + nu2 * v_hat).sqrt() + eps)


def lamb_update(w, g, s, t, lr, b1, b2, eps, wd):
    s['m'] = b1 * s.get('m', torch.zeros_like(w)) + (1 - b1) * g
    s['v'] = b2 * s.get('v', torch.zeros_like(w)) + (1 - b2) * g * g
    r = (s['m'] / (1 - b1 ** t)) / ((s['v'] / (1 - b2 ** t)).sqrt() + eps) + wd * w
    w_norm, r_norm = w.norm(), r.norm()
    ratio = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.
    w -= lr * ratio * r


def lars_update(w, g, s, t, lr, mom, wd, eta, eps, clip):
    w_norm, g_norm = w.norm(), g.norm()
    local = eta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else torch.tensor(1.)
    if clip: local = min(local / lr, 1.)
    s['v'] = mom * s.get('v', torch.zeros_like(w)) + local * (g + wd * w)
    w -= lr * s['v']


def lion_update(w, g, s, t, lr, b1, b2, wd):
    m = s.get('m', torch.zeros_like(w))
    w *= 1 - lr * wd
    w -= lr * torch.sign(b1 * m + (1 - b1) * g)
    s['m'] = b2 * m + (1 - b2) * g


def sgd_momentum_lookahead_update(w, g, s, t, lr, mom, k, alpha):
    if 'slow' not in s: s['slow'] = w.clone()
    s['v'] = mom * s.get('v', torch.zeros_like(w)) + g
    w -= lr * s['v']
    if t % k == 0:
        s['slow'] += alpha * (w - s['slow'])
        w.copy_(s['slow'])


PAIRS = {
    'nesterov': (partial(Nesterov, lr=0.02, fast=False), partial(torch.optim.SGD, lr=0.02, momentum=0.9, nesterov=True)),
    'nesterov_l2': (partial(Nesterov, lr=0.02, wd=0.01, decouple_wd=False, fast=False),
                    partial(torch.optim.SGD, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01)),
    'radam': (partial(RAdam, fast=False), partial(torch.optim.RAdam)),
    'radam_decoupled_wd': (partial(RAdam, wd=0.1, fast=False),
                           partial(torch.optim.RAdam, weight_decay=0.1, decoupled_weight_decay=True)),
    'qhadam': (partial(QHAdam, fast=False),
               reference(partial(qhadam_update, lr=1e-3, b1=0.995, b2=0.999, nu1=0.7, nu2=1.0, eps=1e-8))),
    'qhadam_nu2': (partial(QHAdam, mom=0.9, nu2=0.5, fast=False),
                   reference(partial(qhadam_update, lr=1e-3, b1=0.9, b2=0.999, nu1=0.7, nu2=0.5, eps=1e-8))),
    'lamb': (partial(Lamb, fast=False), reference(partial(lamb_update, lr=1e-3, b1=0.9, b2=0.999, eps=1e-6, wd=0.01))),
    'lars': (partial(LARS, lr=1., wd=5e-4, fast=False),
             reference(partial(lars_update, lr=1., mom=0.9, wd=5e-4, eta=1e-3, eps=1e-8, clip=False))),
    'larc': (partial(LARC, lr=0.1, wd=5e-4, trust_coeff=0.01, fast=False),
             reference(partial(lars_update, lr=0.1, mom=0.9, wd=5e-4, eta=0.01, eps=1e-8, clip=True))),
    'lion': (partial(Lion, wd=0.1, fast=False), reference(partial(lion_update, lr=1e-4, b1=0.9, b2=0.99, wd=0.1))),
    'lookahead_sgd': (lambda ps: Lookahead(SGD(ps, lr=0.02, mom=0.9, fast=False)),
                      reference(partial(sgd_momentum_lookahead_update, lr=0.02, mom=0.9, k=5, alpha=0.5))),
}


def train(model, opt, batches):
    for xb, yb in batches:
        F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb).backward()
        opt.step(); opt.zero_grad()


def trained_pair(ours, theirs, batches, seed=0):
    torch.manual_seed(seed)
    model = digits_cnn().double()  # float64: float32 rounding depends on the CPU, and these steps amplify it
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    train(m1, ours(list(m1.parameters())), batches)
    train(m2, theirs(list(m2.parameters())), batches)
    return model, m1, m2


@pytest.mark.parametrize('name', PAIRS)
def test_matches_independent_implementation(name, batches):
    start, ours, theirs = trained_pair(*PAIRS[name], batches)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), start.parameters()))
    assert diff <= 1e-10 and moved > 1e-4, (diff, moved)


@pytest.mark.float32
def test_lars_trust_ratio_in_state():
    w = torch.nn.Parameter(torch.full((4,), 2.))
    opt = LARS([w], lr=0.1, trust_coeff=0.01)
    w.grad = torch.full((4,), 0.5)
    opt.step()
    assert math.isclose(opt.state[w]['trust_ratio'].item(), 0.01 * 4. / (1. + 1e-8), rel_tol=1e-6)


@pytest.mark.parametrize('wrapped', [torch.optim.SGD, None, 'sgd'])
def test_lookahead_refuses_non_optimizers(wrapped):
    if wrapped is torch.optim.SGD: wrapped = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match='Lookahead wraps a teachloop Optimizer'):
        Lookahead(wrapped)


def test_lookahead_keeps_inner_state_and_hypers():
    w = torch.nn.Parameter(torch.ones(3))
    inner = Adam([w], lr=0.1)
    w.grad = torch.ones(3); inner.step()
    opt = Lookahead(inner, k=3)
    assert opt.state[w]['step'] == 1 and opt.hypers[0]['k'] == 3 and opt.hypers[0]['lr'] == 0.1


@pytest.mark.parametrize('factory,hypers,name', [
    (QHAdam, dict(nu1=1.5), 'nu1'), (QHAdam, dict(nu2=-0.1), 'nu2'), (Lion, dict(avg_mom=1.0), 'avg_mom'),
    (LARS, dict(lr=0.1, trust_coeff=0.), 'trust_coeff'), (RAdam, dict(sqr_mom=1.0), 'sqr_mom'),
    (Lamb, dict(eps=0.), 'eps'), (Nesterov, dict(lr=0.1, mom=1.), 'mom'),
])
def test_bad_hypers_raise(factory, hypers, name):
    with pytest.raises(ValueError, match=name):
        factory(torch.nn.Linear(2, 1).parameters(), **hypers)


@pytest.mark.parametrize('k,alpha', [(0, 0.5), (2.5, 0.5), (5, 0.), (5, 1.5)])
def test_bad_lookahead_hypers_raise(k, alpha):
    with pytest.raises(ValueError):
        Lookahead(SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), k=k, alpha=alpha)
