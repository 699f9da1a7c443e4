"Parity of teachloop's callback optimizers with torch.optim, and the checks on their hyper-parameters."
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from teachloop.data import digits_cnn
from teachloop.optim.core import SGD, RMSProp, Adam, Optimizer, sgd_step, spread_hyper
from teachloop.testing import digits_batches

pytestmark = pytest.mark.numeric

N_STEPS = 40  # past what changes over an optimizer's first steps (RAdam rectifies from step 6, Lookahead syncs every 3-5)
# Parity is checked in float64: float32 rounding depends on the CPU's vector width (AVX-512, AVX2, none) and 100
# Adam steps amplify one ulp to 1e-3, while in float64 the two optimizers agree to ~1e-16.
TOL = 1e-10


@pytest.fixture(scope='module')
def batches(): return digits_batches(N_STEPS)


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


def double_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def steps(model, opt, n=5, scheduler=None):
    data = torch.randn(n, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for xb in data:
        model(xb).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        if scheduler is not None: scheduler.step()


def weights_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def test_group_dicts_with_generators_train_like_torch():
    ours, theirs = double_model(), double_model()
    opt = SGD([{'params': ours[0].parameters(), 'lr': 0.1}, {'params': ours[2].parameters()}], lr=0.05, mom=0.9)
    ref = torch.optim.SGD([{'params': theirs[0].parameters(), 'lr': 0.1}, {'params': theirs[2].parameters()}],
                          lr=0.05, momentum=0.9)
    assert [len(g['params']) for g in opt.param_groups] == [2, 2]
    steps(ours, opt); steps(theirs, ref)
    assert weights_diff(ours, theirs) <= TOL and weights_diff(ours, double_model()) > 1e-3


def test_a_bare_tensor_is_refused_with_torchs_advice():
    with pytest.raises(TypeError, match=r'single tensor of shape \(3, 2\).*\[tensor\]'):
        SGD(torch.nn.Parameter(torch.zeros(3, 2)), lr=0.1)
    assert len(SGD([torch.nn.Parameter(torch.zeros(3, 2))], lr=0.1).param_groups[0]['params']) == 1


def test_complex_parameters_are_refused():
    with pytest.raises(TypeError, match='complex.*view_as_real'):
        Adam([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], lr=0.1)


def test_clear_state_keeps_per_parameter_settings():
    model = double_model()
    opt = Adam(model.parameters(), lr=0.1, wd=0.5)
    bias = model[0].bias
    opt.state[bias]['do_wd'] = False
    steps(model, opt, 2)
    opt.clear_state()
    assert dict(opt.state[bias]) == {'do_wd': False} and model[0].weight not in opt.state
    before = bias.detach().clone()
    bias.grad = torch.zeros_like(bias)
    opt.step()
    assert torch.equal(bias, before)  # zero gradient and no decay: Adam leaves it where it was


@pytest.mark.parametrize('ours,theirs', [
    (partial(Adam, sqr_mom=0.999, eps=1e-8, wd=0.01), partial(torch.optim.AdamW, eps=1e-8, weight_decay=0.01)),
    (partial(SGD, mom=0.9), partial(torch.optim.SGD, momentum=0.9)),
])
@pytest.mark.parametrize('fast', [None, False])
def test_torchs_momentum_cycling_schedulers_drive_our_optimizers(ours, theirs, fast):
    a, b = double_model(), double_model()
    opt_a, opt_b = ours(a.parameters(), lr=0.01, fast=fast), theirs(b.parameters(), lr=0.01)
    sched_a = torch.optim.lr_scheduler.OneCycleLR(opt_a, max_lr=0.05, total_steps=6)  # cycle_momentum=True
    sched_b = torch.optim.lr_scheduler.OneCycleLR(opt_b, max_lr=0.05, total_steps=6)
    steps(a, opt_a, 5, sched_a); steps(b, opt_b, 5, sched_b)
    assert weights_diff(a, b) <= TOL
    name = 'betas' if 'betas' in opt_b.defaults else 'momentum'
    assert opt_a.param_groups[0][name] == opt_b.param_groups[0][name]
    mom = opt_b.param_groups[0][name][0] if name == 'betas' else opt_b.param_groups[0][name]
    assert opt_a.hypers[0]['mom'] == mom != 0.9 and name not in opt_a.hypers[0]
    opt_a.set_hyper('mom', 0.5)
    assert (opt_a.param_groups[0][name][0] if name == 'betas' else opt_a.param_groups[0][name]) == 0.5
    opt_a.load_state_dict(opt_a.state_dict())
    opt_a.param_groups[0][name] = (0.7, 0.99) if name == 'betas' else 0.7
    assert opt_a.hypers[0]['mom'] == 0.7
