"Parity of teachloop's callback optimizers with torch.optim, and the checks on their hyper-parameters."
import copy
import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from teachloop.data import digits_cnn, digits_dls
from teachloop.optimizer import SGD, RMSProp, Adam, Optimizer, sgd_step, spread_hyper

pytestmark = pytest.mark.numeric

N_STEPS = 100
# Parity is checked in float64: float32 rounding depends on the CPU's vector width (AVX-512, AVX2, none) and 100
# Adam steps amplify one ulp to 1e-3, while in float64 the two optimizers agree to ~1e-16.
TOL = 1e-10


@pytest.fixture(scope='module')
def batches():
    "The first 100 training batches of the digits, cycling over epochs."
    return list(itertools.islice(itertools.chain.from_iterable(itertools.repeat(list(digits_dls(bs=64).train), 10)),
                                 N_STEPS))


def train(model, opt, batches):
    for xb, yb in batches:
        F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb).backward()
        opt.step(); opt.zero_grad()
    return model


def max_weight_diff(opt_a, opt_b, batches, seed=0):
    torch.manual_seed(seed)
    model = digits_cnn().double()
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    train(m1, opt_a(m1.parameters()), batches)
    train(m2, opt_b(m2.parameters()), batches)
    return max((a - b).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters()))


PAIRS = {
    'sgd': (partial(SGD, lr=0.05, fast=False), partial(torch.optim.SGD, lr=0.05)),
    'sgd_momentum': (partial(SGD, lr=0.02, mom=0.9, fast=False), partial(torch.optim.SGD, lr=0.02, momentum=0.9)),
    'rmsprop': (partial(RMSProp, lr=1e-3, sqr_mom=0.9, eps=1e-6, fast=False),
                partial(torch.optim.RMSprop, lr=1e-3, alpha=0.9, eps=1e-6)),
    'adam': (partial(Adam, lr=1e-3, wd=0., fast=False), partial(torch.optim.Adam, lr=1e-3, betas=(0.9, 0.99), eps=1e-5)),
    'adamw': (partial(Adam, lr=1e-3, wd=0.05, fast=False),
              partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.05)),
    'adam_l2': (partial(Adam, lr=1e-3, wd=0.05, decouple_wd=False, fast=False),
                partial(torch.optim.Adam, lr=1e-3, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.05)),
}


@pytest.mark.parametrize('name', PAIRS)
def test_parity_with_torch(name, batches):
    ours, theirs = PAIRS[name]
    assert max_weight_diff(ours, theirs, batches) <= TOL


def test_training_moves_the_weights(batches):
    "The parity above is not met by two optimizers that leave the weights alone."
    torch.manual_seed(0)
    model = digits_cnn()
    before = copy.deepcopy(model)
    train(model, Adam(model.parameters(), lr=1e-3), batches[:5])
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), before.parameters())) > 1e-4


@pytest.mark.parametrize('factory,hypers', [
    (SGD, dict(lr=-0.1)), (SGD, dict(lr=0.1, mom=1.0)), (SGD, dict(lr=0.1, mom=-0.1)), (SGD, dict(lr=0.1, wd=-1e-4)),
    (RMSProp, dict(lr=0.1, sqr_mom=1.0)), (RMSProp, dict(lr=0.1, eps=0.)), (Adam, dict(lr=1e-3, eps=-1e-8)),
    (Adam, dict(lr=1e-3, sqr_mom=1.5)), (Adam, dict(lr=1e-3, mom=1.0)), (Adam, dict(lr=1e-3, wd=-0.01)),
])
def test_bad_hypers_raise(factory, hypers):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=next(iter(hypers)) if len(hypers) == 1 else list(hypers)[-1]):
        factory(model.parameters(), **hypers)


@pytest.mark.parametrize('factory', [SGD, RMSProp, Adam])
def test_empty_params_raise(factory):
    with pytest.raises(ValueError, match='no parameters'):
        factory([], lr=0.1)


def test_set_hyper_bad_value_leaves_optimizer_unchanged():
    opt = SGD([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))], lr=0.1)
    opt = Optimizer([[p] for p in opt.param_groups[0]['params']], [sgd_step], lr=0.1)
    with pytest.raises(ValueError, match='lr'):
        opt.set_hyper('lr', [0.1, -1.])
    with pytest.raises(KeyError, match='nesterov'):
        opt.set_hyper('nesterov', True)
    assert [h['lr'] for h in opt.hypers] == [0.1, 0.1]


@pytest.mark.parametrize('make', [lambda p: Adam(p, lr=1e-3), lambda p: SGD(p, lr=1e-3, mom=0.9)])
def test_state_dict_can_be_loaded_again_and_again(make):
    model = torch.nn.Linear(3, 2)
    opt = make(model.parameters())
    model(torch.randn(4, 3)).sum().backward(); opt.step()
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    opt.load_state_dict(opt.state_dict())
    fresh = make(model.parameters())
    fresh.load_state_dict(saved); fresh.load_state_dict(saved)
    assert fresh.state_dict()['state'].keys() == saved['state'].keys()


@pytest.mark.parametrize('value', [slice(0, 1e-2), slice(-1e-3, 1e-2), slice(1e-3, 0.)])
def test_slice_ends_must_be_positive(value):
    "A geometric spread from or to 0 (or a negative value) is refused, by the optimizer too, before anything changes."
    with pytest.raises(ValueError, match='both ends must be > 0'): spread_hyper(value, 3)
    opt = SGD([[torch.nn.Parameter(torch.ones(2))], [torch.nn.Parameter(torch.ones(2))]], lr=0.1)
    with pytest.raises(ValueError, match='both ends'): opt.set_hyper('lr', value)
    assert [h['lr'] for h in opt.hypers] == [0.1, 0.1]


def test_slice_spreads_geometrically_either_way():
    assert spread_hyper(slice(1e-2, 1e-4), 3) == pytest.approx([1e-2, 1e-3, 1e-4])
    assert spread_hyper(slice(1e-2), 3) == pytest.approx([1e-3, 1e-3, 1e-2])


@pytest.mark.parametrize('fast', ['yes', 'auto', 2])
def test_bad_fast_choice_raises(fast):
    with pytest.raises(TypeError, match='fast must be'): Adam(torch.nn.Linear(2, 1).parameters(), lr=1e-3, fast=fast)
