"The fast (multi-tensor and fused) step against the per-parameter callbacks, which stay the reference."
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from teachloop.data import digits_cnn
from teachloop.optim.fast import FastStep, plan_fast_step
from teachloop.optim.core import SGD, Adam, Optimizer, RMSProp, weight_decay
from teachloop.optim.more import LARC, LARS, Lamb, Lion, Lookahead, Nesterov, QHAdam, RAdam
from teachloop.testing import digits_batches

pytestmark = pytest.mark.numeric

N_STEPS = 40  # past what changes over an optimizer's first steps (RAdam rectifies from step 6, Lookahead syncs every 3-5)
# Both paths run in float64: in float32 the kernels' rounding depends on the CPU's vector width (AVX-512, AVX2,
# none) and 100 Adam steps amplify a 1-ulp difference to 1e-3; in float64 the same comparison agrees to ~1e-16, so
# 1e-10 still fails on any real difference (a missed weight decay moves weights by >1e-4 in 30 steps).
TOL = 1e-10

OPTIMIZERS = {
    'sgd': partial(SGD, lr=0.05, wd=0.01), 'sgd_momentum': partial(SGD, lr=0.02, mom=0.9),
    'sgd_momentum_l2': partial(SGD, lr=0.02, mom=0.9, wd=0.01, decouple_wd=False),
    'rmsprop': partial(RMSProp, lr=1e-3), 'rmsprop_momentum': partial(RMSProp, lr=1e-4, mom=0.9),
    'adamw': partial(Adam, lr=1e-3, wd=0.05), 'adam_l2': partial(Adam, lr=1e-3, wd=0.05, decouple_wd=False),
    'nesterov': partial(Nesterov, lr=0.02), 'qhadam': QHAdam, 'radam': partial(RAdam, wd=0.01), 'lamb': Lamb,
    'lars': partial(LARS, lr=1., wd=5e-4), 'larc': partial(LARC, lr=0.1, wd=5e-4, trust_coeff=0.01),
    'lion': partial(Lion, wd=0.1),
    'qhadam_low_momentum': partial(QHAdam, mom=0.3),  # its debiasing's 1 - mom, also below 0.5
    'lookahead_adam': lambda params, fast: Lookahead(Adam(params, lr=1e-3, fast=fast)),
    'lookahead_sgd': lambda params, fast: Lookahead(SGD(params, lr=0.02, mom=0.9, fast=fast), k=3),
}


@pytest.fixture(scope='module')
def batches(): return digits_batches(N_STEPS)


def train(opt_func, fast, batches, no_wd_on_biases=False, switch_at=None):
    torch.manual_seed(0)
    model = digits_cnn().double()
    opt = opt_func(model.parameters(), fast=fast)
    if no_wd_on_biases:
        for p in model.parameters():
            if p.dim() == 1: opt.state[p]['do_wd'] = False
    for i, (xb, yb) in enumerate(batches):
        if i == switch_at: opt.fast = not fast
        F.cross_entropy(model(xb.double()), yb).backward()
        opt.step(); opt.zero_grad()
    return model, opt


def max_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize('name', OPTIMIZERS)
def test_fast_step_matches_callbacks(name, batches):
    reference, reference_opt = train(OPTIMIZERS[name], False, batches)
    fast, fast_opt = train(OPTIMIZERS[name], True, batches)
    for p in fast.parameters(): p.grad = torch.zeros_like(p)
    assert isinstance(fast_opt.fast_step_for(list(fast.parameters())), FastStep)
    assert max_diff(reference, fast) <= TOL
    for p, q in zip(reference.parameters(), fast.parameters()):
        assert reference_opt.state[p].keys() == fast_opt.state[q].keys()


@pytest.mark.parametrize('name', ['adamw', 'lamb', 'lars', 'radam', 'lion', 'sgd_momentum_l2'])
def test_parameters_without_weight_decay(name, batches):
    reference, _ = train(OPTIMIZERS[name], False, batches[:30], no_wd_on_biases=True)
    fast, _ = train(OPTIMIZERS[name], True, batches[:30], no_wd_on_biases=True)
    decayed_everywhere, _ = train(OPTIMIZERS[name], True, batches[:30])
    assert max_diff(reference, fast) <= TOL and max_diff(fast, decayed_everywhere) > 1e-6


@pytest.mark.parametrize('name', ['adamw', 'lamb', 'rmsprop'])
def test_switching_path_mid_training(name, batches):
    reference, _ = train(OPTIMIZERS[name], False, batches[:40])
    switched, _ = train(OPTIMIZERS[name], True, batches[:40], switch_at=20)
    assert max_diff(reference, switched) <= TOL


def test_automatic_choice_and_override():
    model = digits_cnn()
    params = list(model.parameters())
    for p in params: p.grad = torch.zeros_like(p)
    assert Adam(params, lr=1e-3).fast_step_for(params) is not None
    assert Adam(params, lr=1e-3, fast=False).fast_step_for(params) is None
    custom = Optimizer(params, [lambda p, lr, **kwargs: p.add_(p.grad, alpha=-lr)], lr=0.1)
    assert custom.fast_step_for(params) is None and plan_fast_step(custom.cbs) is None


def test_forcing_the_fast_step_where_it_cannot_run_raises():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    a.grad, b.grad = torch.ones(2), torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match='no multi-tensor step'):
        Adam([a, b], lr=0.1, fast=True).step()
    auto = Adam([a, b], lr=0.1)
    auto.step()
    assert auto.state[a]['step'] == auto.state[b]['step'] == 1


@pytest.mark.parametrize('ours,theirs', [
    (partial(SGD, lr=0.1, mom=0.9), partial(torch.optim.SGD, lr=0.1, momentum=0.9)),
    (partial(RMSProp, lr=0.1), partial(torch.optim.RMSprop, lr=0.1)),
    (partial(Adam, lr=0.1), partial(torch.optim.AdamW, lr=0.1)),
    (partial(Lion, lr=0.1), partial(torch.optim.SGD, lr=0.1, momentum=0.9)),
])
def test_state_no_larger_than_torch(ours, theirs):
    "Lion keeps as much as SGD with momentum; the others as much as their torch twins."
    def state_numel(opt_func):
        model = digits_cnn()
        opt = opt_func(model.parameters())
        F.cross_entropy(model(torch.rand(4, 1, 8, 8)), torch.arange(4)).backward(); opt.step()
        return sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    assert state_numel(ours) <= state_numel(theirs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize('name', ['adamw', 'lamb', 'sgd_momentum', 'lion'])
def test_fast_step_matches_callbacks_on_cuda(name):
    torch.manual_seed(0)
    model = digits_cnn().double().cuda()
    models = [copy.deepcopy(model), copy.deepcopy(model)]
    opts = [OPTIMIZERS[name](m.parameters(), fast=fast) for m, fast in zip(models, (False, True))]
    xb = torch.rand(64, 1, 8, 8, device='cuda', dtype=torch.float64)
    yb = torch.randint(0, 10, (64,), device='cuda')
    for _ in range(50):
        for m, opt in zip(models, opts):
            F.cross_entropy(m(xb), yb).backward(); opt.step(); opt.zero_grad()
    # float64, as on the CPU: the two models' convolution gradients differ run to run by the order of cuDNN's atomic
    # adds (relative 1e-16 in float64); 50 steps amplify a float32 difference past 1e-4, a float64 one stays < 1e-10
    assert max_diff(*models) <= 1e-10


@pytest.mark.float32
@pytest.mark.parametrize('factory', [partial(SGD, lr=0.05, mom=0.9), partial(Nesterov, lr=0.05)])
def test_momentum_set_to_zero_mid_training(factory, batches):
    "The fused momentum kernel skips the average at momentum 0; the fast step must still keep it like the callbacks."
    def run(fast):
        torch.manual_seed(0)
        model = digits_cnn()
        opt = factory(model.parameters(), fast=fast)
        for i, (xb, yb) in enumerate(batches[:20]):
            if i == 10: opt.set_hyper('mom', 0.)
            F.cross_entropy(model(xb), yb).backward(); opt.step(); opt.zero_grad()
        return model, opt
    (m1, o1), (m2, o2) = run(False), run(True)
    assert max_diff(m1, m2) <= 1e-6
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(o1.state[p]['grad_avg'], o2.state[q]['grad_avg'], atol=1e-7)


def small_double_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)).double()


def run(model, opt, n=6, before_step=None):
    xb = torch.randn(n, 5, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for i, x in enumerate(xb):
        if before_step is not None: before_step(i, model)
        model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    return model


@pytest.mark.parametrize('factory,switch', [(partial(Adam, lr=0.01, wd=0.5), {'do_wd': False}),
                                            (partial(SGD, lr=0.01, mom=0.9, wd=0.1), {'do_wd': False}),
                                            (partial(SGD, lr=0.01, mom=0.9), {'dampening': True}),
                                            (partial(LARS, lr=0.1, wd=0.01), {'clip': True})])
def test_group_level_switches_are_honoured_by_the_fast_path(factory, switch):
    "A switch set on a group (not through partial or the state) changes what the callbacks do; the fast path too."
    models = [small_double_model() for _ in range(3)]
    def groups(m): return [{'params': m[0].parameters(), **switch}, {'params': m[2].parameters()}]
    reference = run(models[0], factory(groups(models[0]), fast=False))
    fast_opt = factory(groups(models[1]))
    fast = run(models[1], fast_opt)
    without = run(models[2], factory([{'params': models[2][0].parameters()}, {'params': models[2][2].parameters()}]))
    assert max_diff(reference, fast) <= TOL and max_diff(reference, without) > 1e-6
    params = list(models[1][0].parameters())
    for p in params: p.grad = torch.zeros_like(p)
    assert fast_opt.fast_step_for(params, fast_opt.param_groups[0]) is None  # the switched group ran the callbacks
    assert fast_opt.fast_step_for(params, fast_opt.param_groups[1]) is not None


@pytest.mark.parametrize('factory', [partial(Adam, lr=0.01), partial(SGD, lr=0.01, mom=0.9), Lamb])
def test_a_model_moved_to_channels_last_after_its_state_exists(factory):
    "Fused kernels walk a parameter and its state as flat memory: a layout change must not pair the wrong elements."
    def to_channels_last(i, model):
        if i == 3: model.to(memory_format=torch.channels_last)
    reference = run(small_double_model(), factory(small_double_model().parameters(), fast=False))
    ref_model, fast_model = small_double_model(), small_double_model()
    reference = run(ref_model, factory(ref_model.parameters(), fast=False), before_step=to_channels_last)
    fast_opt = factory(fast_model.parameters())
    fast = run(fast_model, fast_opt, before_step=to_channels_last)
    assert fast_model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert max_diff(reference, fast) <= TOL


def test_fused_step_counts_are_float32_whatever_the_default_dtype(monkeypatch):
    "CUDA's fused Adam reads the step count as a float32; a float64 default dtype must not change that."
    seen = []
    kernel = torch._fused_adamw_
    def spy(*args, **kwargs):
        seen.extend(t.dtype for t in args[5])
        return kernel(*args, **kwargs)
    monkeypatch.setattr(torch, '_fused_adamw_', spy)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = torch.nn.Linear(3, 2).float()
        opt = Adam(model.parameters(), lr=0.1)
        model(torch.ones(1, 3, dtype=torch.float32)).sum().backward(); opt.step()
    finally: torch.set_default_dtype(previous)
    assert seen and set(seen) == {torch.float32}


def adam_without_decay(params, fast, **hypers):
    "Adam's callbacks less its weight decay: no fused kernel spells that, so its multi-tensor steps run."
    params = list(params)
    cbs = [cb for cb in Adam(params, lr=hypers['lr']).cbs if cb is not weight_decay]
    return Optimizer(params, cbs, fast=fast, **hypers)


@pytest.mark.parametrize('mom, sqr_mom', [(0.8, 0.9), (0.3, 0.4)])  # the debiasing's 1 - beta, also below 0.5
def test_adam_without_weight_decay_takes_the_multi_tensor_step_and_equals_torch(batches, mom, sqr_mom):
    "Debiased by each parameter's own step count: the first layer gets no gradient for its first 5 steps."
    hypers = dict(lr=1e-2, mom=mom, sqr_mom=sqr_mom, eps=1e-8)
    torch.manual_seed(0)
    model = digits_cnn().double()
    reference = copy.deepcopy(model)
    opt = adam_without_decay(model.parameters(), fast=True, **hypers)  # True: the fast step or an error, never the callbacks
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, betas=(mom, sqr_mom), eps=1e-8, weight_decay=0.)
    for i, (xb, yb) in enumerate(batches[:30]):
        for m, o in ((model, opt), (reference, torch_opt)):
            F.cross_entropy(m(xb.double()), yb).backward()
            if i < 5: next(m.parameters()).grad = None
            if o is opt:
                step = opt.fast_step_for([p for p in m.parameters() if p.grad is not None])
                assert isinstance(step, FastStep) and 'adam_step_multi' in step.names
            o.step(); o.zero_grad()
    assert opt.state[next(model.parameters())]['step'] == 25 and max_diff(model, reference) <= TOL


def test_an_undampened_average_of_squared_gradients_steps_alike_both_ways():
    "`average_sqr_grad(dampening=False)` (a sum with decay, no optimizer of the library uses it): its multi-tensor version."
    from teachloop.optim.core import Optimizer, average_sqr_grad, rms_prop_step
    torch.manual_seed(0)
    grads = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    weights = []
    for fast in (True, False):
        p = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.float64))
        opt = Optimizer([p], [partial(average_sqr_grad, dampening=False), rms_prop_step], fast=fast, lr=0.01,
                        sqr_mom=0.9, eps=1e-8)
        for g in grads:
            p.grad = g.clone()
            assert (opt.fast_step_for([p], opt.hypers[0]) is not None) == fast
            opt.step()
        weights.append(p.detach())
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-14, atol=0)  # float64, the same sums in another order


def test_a_channels_last_weight_is_dense_memory_for_the_fused_kernels():
    from teachloop.optim.fast import _dense
    conv = torch.zeros(8, 3, 3, 3).to(memory_format=torch.channels_last)
    volume = torch.zeros(8, 3, 2, 3, 3).to(memory_format=torch.channels_last_3d)
    assert not conv.is_contiguous() and _dense(conv) and _dense(volume) and not _dense(torch.zeros(4, 6)[:, ::2])
