"Effective learning rates and update ratios against torch.optim's state, the realised steps, and the definitions."
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from teachloop.data import digits_cnn, digits_dls
from teachloop.diagnostics.effective_lr import EffectiveLRTracker, UpdateRatio, effective_lr_stats, effective_lrs
from teachloop.optim.interop import OptimWrapper
from teachloop.learner import Learner
from teachloop.optim.core import SGD, Adam, RMSProp
from teachloop.optim.more import LARS, Lamb, Lion, Nesterov, QHAdam, RAdam
from teachloop.testing import digits_batches

pytestmark = pytest.mark.numeric
# Models and data in float64: float32 results depend on the CPU's vector width, and a realised step p - w of 1e-3
# on weights of 0.1 keeps only 4 significant float32 digits; float64 keeps 13, so 1e-9 relative is a tight check.
RTOL = 1e-9


def train(model, opt, data):
    for xb, yb in data:
        F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb).backward(); opt.step(); opt.zero_grad()


def twin_models():
    torch.manual_seed(0)
    model = digits_cnn().double()
    return copy.deepcopy(model), copy.deepcopy(model)


@pytest.mark.parametrize('ours,theirs,formula', [
    (partial(Adam, lr=2e-3, wd=0.), partial(torch.optim.Adam, lr=2e-3, betas=(0.9, 0.99), eps=1e-5),
     lambda s, t: 2e-3 / ((s['exp_avg_sq'] / (1 - 0.99 ** t)).sqrt() + 1e-5)),
    (partial(RMSProp, lr=1e-3), partial(torch.optim.RMSprop, lr=1e-3, alpha=0.99, eps=1e-8),
     lambda s, t: 1e-3 / (s['square_avg'].sqrt() + 1e-8)),
])
@pytest.mark.float32
def test_matches_torch_state(ours, theirs, formula):
    a, b = twin_models()
    opt_a, opt_b = ours(a.parameters()), theirs(b.parameters())
    data = digits_batches(20)
    train(a, opt_a, data); train(b, opt_b, data)
    ours_lrs = effective_lrs(opt_a, a)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(ours_lrs[name], formula(opt_b.state[q], 20), rtol=RTOL)
    for wrapped in (opt_b, OptimWrapper(b.parameters(), opt=lambda groups, lr: opt_b)):
        for (name, lrs), q in zip(effective_lrs(wrapped, b).items(), b.parameters()):
            assert torch.allclose(lrs, formula(opt_b.state[q], 20), rtol=RTOL)


@pytest.mark.parametrize('factory', [partial(Adam, lr=1e-3, wd=0.), partial(QHAdam, nu1=1.), partial(RAdam, lr=1e-3),
                                     partial(Lamb, wd=0.)])
@pytest.mark.float32
@pytest.mark.parametrize('n_steps', [1, 3, 12])
def test_realised_step_is_effective_lr_times_average_gradient(factory, n_steps):
    "For Adam-like optimizers without weight decay, the step taken is -effective lr x debiased average gradient."
    model, _ = twin_models()
    opt = factory(model.parameters(), fast=False)
    data = digits_batches(n_steps)
    train(model, opt, data[:-1])
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, data[-1:])
    lrs = effective_lrs(opt)
    for (name, lr), p, w in zip(lrs.items(), model.parameters(), before):
        state, hypers = opt.state[p], opt.param_groups[0]
        average = state['grad_avg'] / (1 - hypers['mom'] ** state['step'])
        assert torch.allclose(p - w, -lr * average, atol=1e-15, rtol=RTOL), name


@pytest.mark.parametrize('factory,lr', [(partial(SGD, lr=0.1, mom=0.9), 0.1), (partial(Nesterov, lr=0.05), 0.05),
                                        (partial(Lion, lr=1e-4), 1e-4)])
@pytest.mark.float32
def test_constant_for_sgd_like(factory, lr):
    model, _ = twin_models()
    opt = factory(model.parameters())
    train(model, opt, digits_batches(3))
    for lrs in effective_lrs(opt).values(): assert torch.equal(lrs, torch.full_like(lrs, lr))


@pytest.mark.float32
def test_lars_first_step_is_effective_lr_times_gradient():
    model, _ = twin_models()
    opt = LARS(model.parameters(), lr=1.)
    xb, yb = digits_batches(1)[0]
    F.cross_entropy(model(xb.double()), yb).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for lr, g, w, p in zip(effective_lrs(opt).values(), grads, before, model.parameters()):
        assert torch.allclose(p - w, -lr * g, atol=1e-15, rtol=RTOL)


@pytest.mark.parametrize('factory', [partial(Adam, lr=1e-3), Lamb, partial(LARS, lr=1.), partial(RAdam)])
def test_leaves_state_unchanged(factory):
    model, _ = twin_models()
    opt = factory(model.parameters())
    train(model, opt, digits_batches(3))
    before = copy.deepcopy(opt.state_dict())
    effective_lr_stats(opt, model); effective_lr_stats(opt, model, per='param')
    after = opt.state_dict()
    for i, state in before['state'].items():
        for k, v in state.items(): assert torch.equal(torch.as_tensor(after['state'][i][k]), torch.as_tensor(v))


@pytest.mark.float32
def test_quantiles_per_layer_and_param():
    model, _ = twin_models()
    model.float()
    opt = Adam(model.parameters(), lr=1e-3)
    train(model, opt, digits_batches(2))
    lrs = effective_lrs(opt, model)
    per_layer = effective_lr_stats(opt, model, quantiles=(0.1, 0.9))
    assert set(per_layer) == {'0.0', '1.0', '2.0', '5'}
    expected = torch.quantile(torch.cat([lrs['1.0.weight'].flatten(), lrs['1.0.bias']]), torch.tensor([0.1, 0.9]))
    assert torch.allclose(per_layer['1.0'], expected)
    per_param = effective_lr_stats(opt, model, per='param')
    assert torch.allclose(per_param['5.bias'], torch.quantile(lrs['5.bias'], torch.tensor([0.05, 0.5, 0.95])))
    with pytest.raises(ValueError, match='per'):
        effective_lr_stats(opt, model, per='group')
    with pytest.raises(ValueError, match='quantiles'):
        effective_lr_stats(opt, model, quantiles=(0.5, 95))


@pytest.mark.float32
@pytest.mark.parametrize('n', [1, 2, 7, 1000])
def test_quantiles_match_torch_quantile(n):
    from teachloop.diagnostics.effective_lr import _quantiles
    values = torch.rand(n, generator=torch.Generator().manual_seed(n)).reshape(-1, 1)
    quantiles = (0., 0.05, 0.33, 0.5, 0.95, 1.)
    assert torch.allclose(_quantiles(values, quantiles), torch.quantile(values.flatten(), torch.tensor(quantiles)))


def test_no_state_before_first_step_and_unknown_optimizers():
    model = digits_cnn()
    assert effective_lr_stats(Adam(model.parameters(), lr=1e-3), model) == {}
    with pytest.raises(ValueError, match='Adagrad'):
        effective_lr_stats(torch.optim.Adagrad(model.parameters()), model)


@pytest.mark.float32
def test_update_ratio():
    model, reference = twin_models()
    tracker = UpdateRatio(model)
    opt = SGD(model.parameters(), lr=0.1)
    train(model, opt, digits_batches(2))
    ratios = tracker.ratios()
    change = sum((p - q).pow(2).sum() for p, q in zip(model[-1].parameters(), reference[-1].parameters())).sqrt()
    size = sum(q.pow(2).sum() for q in reference[-1].parameters()).sqrt()
    assert torch.isclose(ratios['5'], change / size) and ratios['5'] > 0
    assert all(r == 0 for r in tracker.ratios().values())
    assert set(tracker.ratios(per='param')) == {name for name, _ in model.named_parameters()}


@pytest.mark.float32
def test_tracker_records_on_schedule():
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, opt_func=Adam, lr=1e-3, default_cbs=False,
                    cbs=[EffectiveLRTracker(every=4)])
    learn.fit(1)
    history = learn.effective_lr_tracker.history
    assert [h['iter'] for h in history] == list(range(0, len(learn.dls.train), 4))
    assert all(set(h['effective_lr']) == {'0.0', '1.0', '2.0', '5'} for h in history)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_stays_on_device():
    model = digits_cnn().cuda()
    opt = Adam(model.parameters(), lr=1e-3)
    F.cross_entropy(model(torch.rand(8, 1, 8, 8, device='cuda')), torch.zeros(8, dtype=torch.long, device='cuda')).backward()
    opt.step()
    assert all(s.device.type == 'cuda' for s in effective_lr_stats(opt, model).values())
    assert all(r.device.type == 'cuda' for r in UpdateRatio(model).ratios().values())
