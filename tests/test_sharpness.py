"""Sharpness estimates against the exact Hessian, the stability lines against the iterations they bound, and a fit
that the estimates leave exactly as it would have been."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.diagnostics import sharpness as module
from teachloop.data import DataLoaders
from teachloop.optim.interop import OptimWrapper
from teachloop.learner import Callback, Learner
from teachloop.optim.core import SGD, Adam
from teachloop.callback.schedule import fit_one_cycle  # noqa: F401 (adds `Learner.fit_one_cycle`)
from teachloop.diagnostics.sharpness import Sharpness, hessian_vector_product, stability_threshold, top_eigenvalue
from teachloop.testing import quiet

pytestmark = pytest.mark.numeric
# Everything in float64: power iteration converges geometrically (ratio of the two top eigenvalues), so 300 steps
# leave an error far below 1e-9 relative; float64 rounding in the Hessian-vector products is ~1e-15.
RTOL = 1e-9


def small_problem(seed=0, width=3):
    torch.manual_seed(seed)
    x, y = torch.randn(40, 5, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 2)).double()
    return model, x, y


def exact_hessian(model, loss_func, x, y):
    names, params = zip(*model.named_parameters())
    def loss_of(flat):
        pieces = torch.split(flat, [p.numel() for p in params])
        weights = {n: w.reshape(p.shape) for n, w, p in zip(names, pieces, params)}
        return loss_func(torch.func.functional_call(model, weights, (x,)), y)
    return torch.autograd.functional.hessian(loss_of, torch.cat([p.detach().flatten() for p in params]))


def top_by_size(matrix):
    eigenvalues = torch.linalg.eigvalsh(matrix)
    return max(eigenvalues[0].item(), eigenvalues[-1].item(), key=abs)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_top_eigenvalue_equals_the_exact_hessians(seed):
    model, x, y = small_problem(seed)
    params = list(model.parameters())
    estimate, vector = top_eigenvalue(hessian_vector_product(F.mse_loss(model(x), y), params),
                                      [torch.randn_like(p) for p in params], power_iters=300)
    H = exact_hessian(model, F.mse_loss, x, y)
    assert estimate == pytest.approx(top_by_size(H), rel=RTOL)
    flat = torch.cat([v.flatten() for v in vector])
    assert torch.allclose(H @ flat, estimate * flat, atol=1e-7)  # and the vector is its eigenvector


def test_preconditioned_eigenvalue_is_that_of_the_scaled_hessian():
    model, x, y = small_problem(3)
    params = list(model.parameters())
    scale = [torch.rand_like(p) + 0.1 for p in params]
    estimate, _ = top_eigenvalue(hessian_vector_product(F.mse_loss(model(x), y), params),
                                 [torch.randn_like(p) for p in params], power_iters=300, scale=scale)
    D = torch.diag(torch.cat([s.flatten() for s in scale]))
    assert estimate == pytest.approx(top_by_size(D @ exact_hessian(model, F.mse_loss, x, y) @ D), rel=RTOL)


def run_on_quadratic(opt_func, lr, curvature, steps=1000):
    "|w| after `steps` of an optimizer on the 1-D quadratic curvature * w**2 / 2, from w = 1."
    w = torch.ones(1, dtype=torch.float64, requires_grad=True)
    opt = opt_func([w], lr=lr)
    for _ in range(steps):
        (0.5 * curvature * w ** 2).sum().backward(); opt.step(); opt.zero_grad()
    return w.abs().item()


@pytest.mark.parametrize('mom', [0., 0.5, 0.9])
def test_the_line_separates_convergence_from_divergence_for_sgd(mom):
    lr = 0.1
    line = stability_threshold(lr, mom)
    opt_func = lambda params, lr: SGD(params, lr=lr, mom=mom)  # teachloop's heavy ball: the average is not dampened
    assert run_on_quadratic(opt_func, lr, 0.98 * line) < 1e-2 and run_on_quadratic(opt_func, lr, 1.02 * line) > 1e2


def test_the_dampened_line_bounds_a_dampened_average():
    lr, beta = 0.01, 0.9
    line = stability_threshold(lr, beta, dampening=True)
    opt_func = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=beta, dampening=beta)
    # torch's dampening multiplies the gradient by (1 - beta): the step is lr times the average, as in Adam's numerator
    assert run_on_quadratic(opt_func, lr, 0.98 * line) < 1e-2 and run_on_quadratic(opt_func, lr, 1.02 * line) > 1e2


def regression_learner(model, cbs=(), lr=0.05, opt_func=SGD, n_batches=6, seed=0):
    torch.manual_seed(seed)
    batches = [(torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)) for _ in range(n_batches)]
    return quiet(Learner(DataLoaders(batches, None), model, F.mse_loss, opt_func=opt_func, lr=lr, cbs=list(cbs)))


def test_estimates_leave_the_fit_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 2)).double()
    watched, alone = regression_learner(copy.deepcopy(model), [Sharpness(every=2)]), regression_learner(model)
    torch.manual_seed(1); watched.fit(2)
    torch.manual_seed(1); alone.fit(2)
    assert len(watched.sharpness.sharpness) == 6
    assert all(torch.equal(a, b) for a, b in zip(watched.model.state_dict().values(), alone.model.state_dict().values()))
    assert watched.recorder.losses == alone.recorder.losses


def test_estimates_at_ticks_on_the_fixed_batch_match_the_exact_hessian():
    model, x, y = small_problem(4)
    sharp = Sharpness(every=4, power_iters=300, batch=(x, y))
    learn = regression_learner(model, [sharp], n_batches=4)
    learn.fit(3)
    assert sharp.steps == [4, 8, 12]
    assert sharp.sharpness[-1] == pytest.approx(top_by_size(exact_hessian(learn.model, F.mse_loss, x, y)), rel=RTOL)


class HyperLog(Callback):
    "The lr and momentum of the first group after each step."
    order = 70
    def before_fit(self): self.hypers = []
    def after_step(self): self.hypers.append((self.opt.param_groups[0]['lr'], self.opt.param_groups[0]['mom']))


def test_the_line_follows_the_schedule_and_adams_dampened_momentum():
    model, x, y = small_problem(5)
    sharp, log = Sharpness(every=3, power_iters=5, preconditioned=True), HyperLog()
    regression_learner(model, [sharp, log], lr=1e-2, opt_func=Adam).fit_one_cycle(2)
    assert sharp.steps == [3, 6, 9, 12]
    expected = [stability_threshold(*log.hypers[step - 1], dampening=True) for step in sharp.steps]
    assert sharp.thresholds == expected and len(set(expected)) == 4  # one-cycle moves lr and mom, and the line


def test_estimates_kept_are_bounded():
    model, x, y = small_problem(8)
    sharp = Sharpness(every=1, power_iters=2, max_points=4)
    regression_learner(model, [sharp], n_batches=10).fit(1)
    assert 3 <= len(sharp.steps) <= 4 and sharp.steps[-1] <= 10 and sharp.steps == sorted(sharp.steps)
    assert len(sharp.sharpness) == len(sharp.thresholds) == len(sharp.steps)


def test_adaptive_optimizers_are_preconditioned_unless_told():
    model, x, y = small_problem(7)
    picks = {}
    for name, opt_func, preconditioned in [('sgd', SGD, None), ('adam', Adam, None), ('adam raw', Adam, False)]:
        sharp = Sharpness(every=2, power_iters=3, preconditioned=preconditioned)
        regression_learner(copy.deepcopy(model), [sharp], lr=1e-2, opt_func=opt_func, n_batches=2).fit(1)
        picks[name] = sharp._preconditioned
    assert picks == {'sgd': False, 'adam': True, 'adam raw': False}


@pytest.mark.parametrize('preconditioned', [False, True])
def test_an_unused_parameter_does_not_stop_an_estimate(preconditioned):
    model, x, y = small_problem(10)
    unused = nn.Linear(2, 2).double()  # trainable, but no gradient ever reaches it
    holder = nn.ModuleDict({'net': model, 'unused': unused})
    class Net(nn.Module):
        def __init__(self): super().__init__(); self.parts = holder
        def forward(self, xb): return self.parts['net'](xb)
    sharp = Sharpness(every=2, power_iters=300, preconditioned=preconditioned)
    learn = regression_learner(Net(), [sharp], lr=1e-2, opt_func=Adam, n_batches=4)
    learn.fit(1)
    if not preconditioned:  # zero rows and columns for the unused layer: the used part's top eigenvalue
        assert sharp.sharpness[-1] == pytest.approx(top_by_size(exact_hessian(model, F.mse_loss, *learn.dls.train[0])), rel=1e-6)
    assert len(sharp.sharpness) == 2 and all(v > 0 for v in sharp.sharpness)


def test_bad_arguments_are_refused_before_the_fit():
    for bad in ({'every': 0}, {'power_iters': 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))): Sharpness(**bad)
    model, x, y = small_problem(6)
    start = copy.deepcopy(model.state_dict())
    splitter = lambda m: [list(m[0].parameters()), list(m[2].parameters())]
    learn = quiet(Learner(DataLoaders([(x, y)], None), model, F.mse_loss, opt_func=SGD, lr=slice(1e-3, 1e-2),
                          splitter=splitter, cbs=[Sharpness()]))
    with pytest.raises(ValueError, match='one learning rate'): learn.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(learn.model.state_dict().values(), start.values()))
    adagrad = lambda params, lr: OptimWrapper(params, torch.optim.Adagrad, lr=lr)
    learn = quiet(Learner(DataLoaders([(x, y)], None), model, F.mse_loss, opt_func=adagrad, lr=1e-2,
                          cbs=[Sharpness(preconditioned=True)]))
    with pytest.raises(ValueError, match='effective learning rate rule for Adagrad'): learn.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(learn.model.state_dict().values(), start.values()))


def test_no_host_reads_between_ticks(host_reads):
    reads, per_batch = host_reads(module), []

    class Probe(Callback):
        order = 100
        def after_batch(self): per_batch.append(len(reads))
    regression_learner(small_problem(9)[0], [Sharpness(every=4, power_iters=3), Probe()], n_batches=8).fit(1)
    new_reads = [b - a for a, b in zip([0] + per_batch, per_batch)]
    assert [i for i, n in enumerate(new_reads) if n] == [3, 7], new_reads  # the host waits at ticks only
