"Parity of teachloop's callback optimizers with torch.optim, and the checks on their hyper-parameters."
import copy
import io
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


@pytest.mark.float32
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


@pytest.mark.float32
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


@pytest.mark.parametrize('fast', ['yes', 'auto', 2, 0, 1.0])  # 0 == False, 1.0 == True: neither is one
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


# ---- what the optimizer checks and fills in by itself (tests found missing by mutation testing, tools/mutate.py)

@pytest.mark.parametrize('make, name', [(partial(Adam, lr=1e-3), 'betas'),
                                        (partial(SGD, lr=1e-3, mom=0.9), 'momentum')])
def test_an_optimizer_saved_whole_or_copied_still_follows_torchs_momentum_name(make, name):
    "A scheduler of torch's writes `betas` or `momentum` (OneCycleLR's cycle_momentum), also into a loaded or copied one."
    buffer = io.BytesIO()
    torch.save(make(double_model().parameters()), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # (every string in it a new object: pickle does not intern them)
    copied = copy.deepcopy(make(double_model().parameters()))
    for opt in (loaded, copied):
        opt.param_groups[0][name] = (0.7, 0.99) if name == 'betas' else 0.7
        assert opt.hypers[0]['mom'] == 0.7 and opt.param_groups[0][name] == ((0.7, 0.99) if name == 'betas' else 0.7)


def test_rmsprop_at_its_defaults_is_torchs_rmsprop_at_its_defaults():
    "eps 1e-8 and a square average of 0.99 when none is given: small gradients, where eps weighs, in float64."
    ours, theirs = (torch.nn.Parameter(torch.linspace(-1, 1, 6, dtype=torch.float64)) for _ in range(2))
    opt_ours, opt_theirs = RMSProp([ours], lr=1e-2), torch.optim.RMSprop([theirs], lr=1e-2)
    for step in range(5):
        for p, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            p.grad = torch.full_like(p, 1e-7 * (step + 1))
            opt.step()
    assert (ours - theirs).abs().max().item() < 1e-15 and (ours - torch.linspace(-1, 1, 6).double()).abs().min() > 1e-4


def test_a_parameter_given_twice_is_refused():
    w, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))
    for params in ([w, b, w], [{'params': [w]}, {'params': [b, w]}]):
        with pytest.raises(ValueError, match=r'a parameter of shape \(2, 3\) is given to the optimizer twice'):
            SGD(params, lr=0.1)


def test_a_bad_hyper_parameter_in_a_group_is_refused_like_one_for_all():
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match='lr'): SGD([{'params': [w]}, {'params': [b], 'lr': -1.}], lr=0.1)
    with pytest.raises(ValueError, match='eps'): Adam([{'params': [w], 'eps': 0.}], lr=0.1)
    with pytest.raises(ValueError, match='wd'): SGD([{'params': [w], 'wd': -1.}], lr=0.1)  # a name after 'params' too


def test_without_wd_the_optimizers_take_the_plain_step():
    "No weight decay unless asked: SGD, and an optimizer built from the weight-decay callback, step w - lr * g exactly."
    from teachloop.optim.core import weight_decay
    start, g = torch.linspace(-1, 1, 5, dtype=torch.float64), torch.linspace(0.5, 2.5, 5, dtype=torch.float64)
    for make in (lambda ps: SGD(ps, lr=0.1), lambda ps: Optimizer(ps, [weight_decay, sgd_step], lr=0.1)):
        w = torch.nn.Parameter(start.clone())
        opt = make([w])
        w.grad = g.clone()
        opt.step()
        assert opt.hypers[0]['wd'] == 0 and torch.equal(w.detach(), start - 0.1 * g)


def test_a_partial_of_a_callback_brings_its_defaults():
    "An optimizer built from `partial(callback, ...)` still knows the callback's default hyper-parameters."
    def scaled_step(p, lr, scale, **kwargs): p.data.add_(p.grad, alpha=-lr * scale)
    scaled_step.defaults = dict(scale=0.5)
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = Optimizer([w], [partial(scaled_step)], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.hypers[0]['scale'] == 0.5 and torch.equal(w.detach(), torch.full((3,), 0.95, dtype=torch.float64))


def test_a_rule_for_a_hyper_parameter_is_declared_once():
    "A callback that declares another meaning for `lr` is refused, whatever the new meaning's wording."
    from teachloop.optim.core import declare_callback
    def stepper(p, lr, **kwargs): pass
    for meaning in ('a rate of at least zero', 'zzz: something else'):
        with pytest.raises(ValueError, match="declares a rule for 'lr' other than the one already declared"):
            declare_callback(stepper, hypers={'lr': (lambda v: v >= 0, meaning)})


def trained_adam(shape):
    w = torch.nn.Parameter(torch.ones(shape, dtype=torch.float64))
    opt = Adam([w], lr=0.1)
    w.grad = torch.arange(w.numel(), dtype=torch.float64).reshape(shape)
    opt.step()
    return w, opt


def test_a_state_saved_without_the_parameters_shapes_is_checked_against_its_tensors():
    "As torch saves it (no 'param_shapes'): it loads into a model of the same shapes, and is refused for a transposed one."
    _, saved = trained_adam((2, 3))
    state = saved.state_dict()
    del state['param_shapes']
    w, same = trained_adam((2, 3))
    same.load_state_dict(copy.deepcopy(state))
    assert torch.equal(same.state[w]['grad_avg'], saved.state[next(iter(saved.state))]['grad_avg'])
    _, transposed = trained_adam((3, 2))
    with pytest.raises(ValueError, match=r"has shape \(2, 3\) but the parameter has shape \(3, 2\)"):
        transposed.load_state_dict(copy.deepcopy(state))


def test_a_fast_step_planner_added_beside_teachloops_keeps_its_fast_steps(monkeypatch):
    "A library's own planner (here one that never has a step) joins the list; one of the same name replaces it."
    from teachloop.optim import core
    monkeypatch.setattr(core, 'FAST_STEP_PLANNERS', list(core.FAST_STEP_PLANNERS))
    def a_planner_of_ones_own(cbs): return None
    for _ in range(2): core.add_fast_step_planner(a_planner_of_ones_own)
    assert [p.__name__ for p in core.FAST_STEP_PLANNERS].count('a_planner_of_ones_own') == 1
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    assert Adam([p], lr=1e-3).fast_step_for([p]) is not None  # teachloop's planner is still asked


def test_torchs_name_for_the_momentum_is_followed_whatever_string_object_names_it():
    "A key read from a config file is a string made at run time, not the literal in the code."
    opt = Adam([torch.nn.Parameter(torch.ones(2))], lr=1e-3)
    key = ''.join(['be', 'tas'])
    opt.param_groups[0][key] = (0.5, 0.6)
    assert opt.hypers[0]['mom'] == 0.5 and opt.hypers[0]['sqr_mom'] == 0.6


def test_the_effective_lr_rules_of_rmsprop_and_adam_give_the_step_each_weight_took():
    "Each weight moved by its effective learning rate times its direction: the gradient (RMSProp), the debiased average (Adam)."
    from teachloop.optim.core import Adam, RMSProp, adam_step, callback_facts, debias, rms_prop_step
    torch.manual_seed(0)
    # sqr_mom below 0.5: there `1 % sqr_mom` is not `1 - sqr_mom` (above it the two are equal, float for float)
    for make, cb in ((partial(RMSProp, lr=0.01, mom=0., wd=0.), rms_prop_step),
                     (partial(Adam, lr=0.01, sqr_mom=0.3, wd=0.), adam_step)):
        p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
        opt = make([p])
        for _ in range(3):
            p.grad = torch.randn(5, dtype=torch.float64)
            before = p.detach().clone()
            opt.step()
        state, group = opt.state[p], opt.param_groups[0]
        factor = callback_facts(cb).effective_lr(p, state, **{k: v for k, v in group.items() if k != 'params'})
        direction = p.grad if cb is rms_prop_step else state['grad_avg'] / debias(group['mom'], 1 - group['mom'], state['step'])
        # float64: the rule and the step compute the same quotient in another order (1e-16 apart)
        torch.testing.assert_close(before - p.detach(), factor * direction, rtol=1e-12, atol=0)


def test_rmsprop_has_torch_as_its_reference_at_its_defaults():
    "The reference the contract suite compares RMSProp with: torch's RMSprop, for RMSProp's default settings."
    from teachloop.optim.core import OPTIMIZERS
    p = torch.nn.Parameter(torch.zeros(3))
    assert isinstance(OPTIMIZERS['RMSProp'].reference([p], lr=0.1), torch.optim.RMSprop)
