"Tests of the momentum notebook: EWMA, debiasing, trajectories against torch.optim, the quadratic's rate, widgets."
from functools import partial

import numpy as np
import pytest
import torch

from teachloop.lessons.momentum import (DECAY_CURVATURES, SURFACES, DirectionDecayWidget, EWMAWidget, GradientStreamWidget, TrajectoryWidget, convergence_rate,
                                critical_beta, debiased_ewma, direction_errors, effective_window, ewma, ewma_weights, heavy_ball_rate,
                                heavy_ball_roots, optimal_momentum, optimizer_set, rate_map,
                                stable_lr, trajectory)
from teachloop.optim.core import SGD, Adam, RMSProp
from teachloop.optim.more import Nesterov

pytestmark = pytest.mark.numeric  # trajectories against torch.optim and the math

rng = np.random.default_rng(0)


def direct_ewma(values, beta):
    "a_t = (1-beta) * sum_k beta**(t-k) v_k, summed directly for every t."
    return np.array([(1 - beta) * sum(beta ** (t - k) * values[k] for k in range(t + 1)) for t in range(len(values))])


@pytest.mark.parametrize('beta', [0., 0.5, 0.9, 0.99])
def test_ewma_matches_direct_sum(beta):
    values = rng.standard_normal(50)
    assert np.allclose(ewma(values, beta), direct_ewma(values, beta), atol=1e-12)


@pytest.mark.parametrize('beta', [0., 0.3, 0.9, 0.999])
def test_debiased_is_the_weighted_mean(beta):
    values = rng.standard_normal(40) + 3
    for t in [1, 2, 17, 40]:
        weights = beta ** np.arange(t - 1, -1, -1)
        assert np.isclose(debiased_ewma(values, beta)[t - 1], (weights * values[:t]).sum() / weights.sum())


def test_debiasing_is_not_fed_back():
    values = rng.standard_normal(30)
    beta = 0.9
    # the plain average is unchanged by debiasing, and the correction is exactly 1 / (1 - beta**t)
    assert np.allclose(debiased_ewma(values, beta) * (1 - beta ** np.arange(1, 31)), ewma(values, beta))
    assert np.allclose(debiased_ewma(np.full(10, -2.5), beta), -2.5)


def test_effective_window_and_weights():
    assert np.isclose(effective_window(0.99), 100) and effective_window(0.) == 1
    weights = ewma_weights(0.95, 2000)
    assert np.isclose(weights.sum(), 1) and np.isclose((np.arange(2000) * weights).sum(), 0.95 / 0.05)


@pytest.mark.parametrize('bad', [1., -0.1, 1.5, True, 'x'])
def test_bad_beta_is_refused(bad):
    with pytest.raises(ValueError, match='beta'): ewma([1., 2.], bad)


def test_ewma_refuses_2d_input():
    with pytest.raises(ValueError, match='1-D'): ewma(np.ones((2, 3)), 0.9)


def test_ewma_widget_follows_its_sliders():
    widget = EWMAWidget(beta=0.9, noise=0.1, seed=3)
    first_png = widget.image.value
    widget.controls['beta'].value = 0.7
    x, y = widget.lines['data'].get_data()
    assert np.allclose(widget.lines['ewma'].get_ydata(), ewma(y, 0.7))
    assert np.allclose(widget.lines['debiased'].get_ydata(), debiased_ewma(y, 0.7))
    assert np.allclose(widget.lines['weights'].get_ydata(), 0.7 ** np.arange(100))
    assert np.allclose(widget.lines['window'].get_xdata(), effective_window(0.7))
    assert widget.image.value != first_png and widget.image.value[:8] == b'\x89PNG\r\n\x1a\n'


def test_ewma_widget_draws_a_slow_average_when_asked():
    assert 'slow_beta' not in EWMAWidget().controls and 'slow' not in EWMAWidget().lines
    widget = EWMAWidget(beta=0.9, slow_beta=0.98, seed=3)
    widget.controls['slow_beta'].value = 0.95
    x, y = widget.lines['data'].get_data()
    assert np.allclose(widget.lines['slow'].get_ydata(), ewma(y, 0.95))
    assert np.allclose(widget.lines['slow_weights'].get_ydata(), 0.95 ** np.arange(100))
    assert np.allclose(widget.lines['ewma'].get_ydata(), ewma(y, 0.9))


def test_ewma_widget_noise_and_resample():
    widget = EWMAWidget(noise=0.1, seed=3)
    y_before = widget.lines['data'].get_ydata().copy()
    widget.controls['noise'].value = 0.
    x, y = widget.lines['data'].get_data()
    assert np.allclose(y, 1 - (x / 3) ** 2)  # without noise the points lie on the parabola
    widget.controls['noise'].value = 0.1
    assert np.allclose(widget.lines['data'].get_ydata(), y_before)  # same seed, same sample
    widget.box.children[0].children[-1].click()  # the re-sample button
    assert widget.seed == 4 and not np.allclose(widget.lines['data'].get_ydata(), y_before)


def test_set_values_redraws_once_and_checks_names():
    widget = EWMAWidget()
    calls = []
    widget.update, update = (lambda **values: (calls.append(values), update(**values))), widget.update
    widget.set_values(beta=0.5, noise=0.2)
    assert calls == [{'beta': 0.5, 'noise': 0.2}]
    with pytest.raises(KeyError, match='lr'): widget.set_values(lr=0.1)


def test_widget_offers_a_static_picture():
    bundle = EWMAWidget()._repr_mimebundle_()
    assert 'application/vnd.jupyter.widget-view+json' in bundle and 'image/png' in bundle


# --- trajectories against torch.optim, stepped by autograd in an ordinary loop

def torch_path(surface, make_opt, steps):
    point = surface.start.clone().requires_grad_()
    opt = make_opt([point])
    path = [point.detach().clone()]
    for _ in range(steps):
        opt.zero_grad()
        surface.loss(point).backward()
        opt.step()
        path.append(point.detach().clone())
    return torch.stack(path)

def pairs(surface, beta=0.9, beta2=0.99, eps=1e-8):
    lr, lr_adaptive = surface.lr, surface.lr_adaptive
    return {
        'SGD': (partial(SGD, lr=lr), partial(torch.optim.SGD, lr=lr)),
        'momentum': (partial(SGD, lr=lr, mom=beta), partial(torch.optim.SGD, lr=lr, momentum=beta)),
        'Nesterov': (partial(Nesterov, lr=lr, mom=beta), partial(torch.optim.SGD, lr=lr, momentum=beta, nesterov=True)),
        'RMSProp': (partial(RMSProp, lr=lr_adaptive, sqr_mom=beta2, eps=eps),
                    partial(torch.optim.RMSprop, lr=lr_adaptive, alpha=beta2, eps=eps)),
        'Adam': (partial(Adam, lr=lr_adaptive, mom=beta, sqr_mom=beta2, eps=eps, wd=0.),
                 partial(torch.optim.Adam, lr=lr_adaptive, betas=(beta, beta2), eps=eps)),
    }

@pytest.mark.parametrize('surface_name', list(SURFACES))
@pytest.mark.parametrize('opt_name', ['SGD', 'momentum', 'Nesterov', 'RMSProp', 'Adam'])
def test_trajectory_matches_torch_optim(surface_name, opt_name):
    surface = SURFACES[surface_name]
    ours, theirs = pairs(surface)[opt_name]
    path, reference = trajectory(surface, ours, 150), torch_path(surface, theirs, 150)
    assert path.shape == (151, 2) and torch.isfinite(path).all()
    assert (path - reference).abs().max() <= 1e-6

def test_optimizer_set_is_what_the_pairs_use():
    surface = SURFACES['saddle']
    hypers = dict(lr=surface.lr, lr_adaptive=surface.lr_adaptive, beta=0.8, beta2=0.95, eps=1e-3)
    for name, opt_func in optimizer_set(**hypers).items():
        reference = torch_path(surface, pairs(surface, 0.8, 0.95, 1e-3)[name][1], 80)
        assert (trajectory(surface, opt_func, 80) - reference).abs().max() <= 1e-6, name

def test_trajectory_start_and_bad_steps():
    surface = SURFACES['canyon']
    path = trajectory(surface, partial(SGD, lr=0.1), 3, start=(1., 1.))
    # SGD on the quadratic: each coordinate shrinks by 1 - lr * curvature per step
    assert torch.allclose(path[:, 0], 0.9 ** torch.arange(4.,  dtype=torch.float64))
    assert torch.allclose(path[:, 1], (1 - 0.1 * 25) ** torch.arange(4., dtype=torch.float64))
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match='steps'): trajectory(surface, partial(SGD, lr=0.1), bad)

def test_surface_gradients_match_autograd():
    for surface in SURFACES.values():
        for point in torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)):
            point = point.clone().requires_grad_()
            surface.loss(point).backward()
            assert torch.allclose(point.grad, surface.grad(point.detach())), surface.name
    assert np.allclose(SURFACES['canyon'].curvatures, [1, 25]) and np.allclose(SURFACES['saddle'].curvatures, [1, 2])


# --- the quadratic's theory against the 2x2 iteration matrix

@pytest.mark.parametrize('a, beta', [(0.01, 0.), (0.3, 0.2), (0.3, 0.8), (1.9, 0.5), (3.5, 0.9), (5., 0.3)])
def test_rate_is_the_spectral_radius_of_the_iteration_matrix(a, beta):
    matrix = np.array([[1 + beta - a, -beta], [1., 0.]])
    assert np.isclose(heavy_ball_rate(a, beta), np.abs(np.linalg.eigvals(matrix)).max())

def test_rate_map_at_points():
    curvatures = SURFACES['canyon'].curvatures
    rates, lrs, betas = rate_map(curvatures, n_lr=30, n_beta=20)
    for row, col in [(0, 0), (5, 17), (19, 29), (12, 3)]:
        radius = max(np.abs(np.linalg.eigvals([[1 + betas[row] - lrs[col] * c, -betas[row]], [1., 0.]])).max()
                     for c in curvatures)
        assert np.isclose(rates[row, col], radius)

@pytest.mark.parametrize('a', [0.04, 0.25, 0.8, 2.5])
def test_critical_damping_is_a_double_root(a):
    roots = heavy_ball_roots(a, critical_beta(a))
    assert np.isclose(roots[0], roots[1]) and abs(roots[0].imag) < 1e-6
    # just below critical damping the roots are real and distinct, just above they are complex with modulus sqrt(beta)
    below, above = heavy_ball_roots(a, critical_beta(a) * 0.9), heavy_ball_roots(a, critical_beta(a) * 1.1 + 1e-3)
    assert np.all(below.imag == 0) and not np.isclose(below[0], below[1])
    assert np.allclose(np.abs(above), np.sqrt(critical_beta(a) * 1.1 + 1e-3))

@pytest.mark.parametrize('beta', [0., 0.5, 0.9])
def test_divergence_beyond_the_stability_bound(beta):
    curvatures = [1., 25.]
    bound = stable_lr(beta, curvatures)
    assert convergence_rate(bound * 0.99, beta, curvatures) < 1 < convergence_rate(bound * 1.01, beta, curvatures)
    # and the real path: bounded below, blowing up beyond
    surface = SURFACES['canyon']
    inside = trajectory(surface, partial(SGD, lr=bound * 0.99, mom=beta), 400)
    outside = trajectory(surface, partial(SGD, lr=bound * 1.01, mom=beta), 400)
    assert inside[-1].abs().max() < surface.start.abs().max() < outside[-1].abs().max()

def test_measured_rate_matches_theory():
    surface = SURFACES['canyon']
    for lr, beta in [(0.03, 0.9), (0.02, 0.3), (0.05, 0.6)]:
        path = trajectory(surface, partial(SGD, lr=lr, mom=beta), 400)
        measured = (path[-1].norm() / path[200].norm()).item() ** (1 / 200)
        assert abs(measured - convergence_rate(lr, beta, surface.curvatures)) < 0.01

def test_optimal_momentum_is_the_best_on_the_map():
    curvatures = [0.5, 40.]
    lr, beta, rate = optimal_momentum(curvatures)
    kappa = 80
    assert np.isclose(rate, (np.sqrt(kappa) - 1) / (np.sqrt(kappa) + 1)) and np.isclose(convergence_rate(lr, beta, curvatures), rate)
    rates, _, _ = rate_map(curvatures, n_lr=200, n_beta=200)
    assert rates.min() >= rate - 1e-9


# --- the other widgets, driven from code

def test_trajectory_widget_follows_its_sliders():
    widget = TrajectoryWidget(steps=40)
    widget.controls['beta'].value = 0.5
    lr = widget.controls['lr'].value
    expected = trajectory(SURFACES['canyon'], partial(SGD, lr=lr, mom=0.5), 40)
    assert np.allclose(widget.path_lines['momentum'].get_xdata(), expected[:, 0])
    assert np.allclose(widget.loss_lines['momentum'].get_ydata(), SURFACES['canyon'].loss(expected))
    assert np.allclose(widget.marker.get_data(), [[np.log10(lr)], [0.5]])
    widget.set_values(steps=70, lr_adaptive=0.2, beta2=0.9, eps=1e-3)
    adam = trajectory(SURFACES['canyon'], partial(Adam, lr=0.2, mom=0.5, sqr_mom=0.9, eps=1e-3, wd=0.), 70)
    assert np.allclose(widget.path_lines['Adam'].get_ydata(), adam[:, 1], atol=1e-12)
    assert len(widget.path_lines['SGD'].get_xdata()) == 71

def test_trajectory_widget_changes_surface_and_lr():
    widget = TrajectoryWidget(steps=20)
    widget.controls['surface'].value = 'rosenbrock'
    surface = SURFACES['rosenbrock']
    assert np.isclose(widget.controls['lr'].value, surface.lr) and widget.controls['lr_adaptive'].value == surface.lr_adaptive
    expected = trajectory(surface, partial(SGD, lr=widget.controls['lr'].value), 20)
    assert np.allclose(widget.path_lines['SGD'].get_ydata(), expected[:, 1])
    map_image = [a for a in widget.surface_artists if hasattr(a, 'get_array')][-1].get_array()
    assert np.allclose(map_image, rate_map(surface.curvatures)[0])

def test_trajectory_widget_refuses_unknown_surface():
    with pytest.raises(KeyError, match='canyon'): TrajectoryWidget(surface='bowl')

@pytest.mark.float32
def test_gradient_stream_widget_follows_its_sliders():
    grads = torch.randn(120, generator=torch.Generator().manual_seed(1)) * 0.01
    widget = GradientStreamWidget(grads)
    widget.set_values(beta=0.8, beta2=0.95)
    g = grads.double().numpy()
    assert np.allclose(widget.lines['momentum'].get_ydata(), ewma(g, 0.8))
    assert np.allclose(widget.lines['momentum, debiased'].get_ydata(), debiased_ewma(g, 0.8))
    assert np.allclose(widget.lines['squared'].get_ydata(), ewma(g ** 2, 0.95))
    assert np.allclose(widget.lines['squared, debiased'].get_ydata(), debiased_ewma(g ** 2, 0.95))

def test_trajectory_widget_without_momentum():
    widget = TrajectoryWidget(steps=30)
    widget.controls['beta'].value = 0.
    # with beta = 0, heavy ball and Nesterov are plain SGD, and the star sits on the map's bottom edge
    sgd = widget.path_lines['SGD'].get_data()
    assert np.allclose(widget.path_lines['momentum'].get_data(), sgd)
    assert np.allclose(widget.path_lines['Nesterov'].get_data(), sgd)
    assert widget.marker.get_ydata()[0] == 0.


@pytest.mark.parametrize('lr,beta', [(0.5, 0.), (1.0, 0.6), (3.0, 0.9), (4.5, 0.2)])
def test_direction_errors_are_what_torch_sgd_does_to_each_coordinate(lr, beta):
    w = torch.ones(len(DECAY_CURVATURES), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr, momentum=beta)  # heavy ball, as teachloop's SGD(mom=beta)
    steps = [w.detach().clone()]
    for _ in range(30):
        (0.5 * (torch.from_numpy(DECAY_CURVATURES) * w ** 2).sum()).backward(); opt.step(); opt.zero_grad()
        steps.append(w.detach().clone())
    # float64: the recurrence and torch's buffer update round differently, ~1e-16 relative per step
    assert np.allclose(torch.stack(steps).numpy(), direction_errors(lr, beta, DECAY_CURVATURES, 30), rtol=1e-10, atol=1e-12)


def test_each_direction_decays_at_its_own_rate():
    errors = np.abs(direction_errors(1.0, 0.3, DECAY_CURVATURES, 400))
    measured, rates = (errors[400] / errors[200]) ** (1 / 200), heavy_ball_rate(DECAY_CURVATURES, 0.3)
    oscillating = 0.3 > critical_beta(DECAY_CURVATURES)  # complex roots: the error rides a cosine under the envelope
    assert oscillating.any() and not oscillating.all()
    assert np.allclose(measured[~oscillating], rates[~oscillating], rtol=1e-6)
    assert np.allclose(measured[oscillating], rates[oscillating], rtol=0.02)  # the phase's share, 200th root


def test_direction_decay_widget_follows_its_sliders():
    widget = DirectionDecayWidget(steps=25)
    widget.set_values(lr=2.0, beta=0.5, steps=40)
    lr = widget.controls['lr'].value
    expected = np.abs(direction_errors(lr, 0.5, DECAY_CURVATURES, 40))
    assert np.allclose(widget.lines[0].get_ydata(), expected[:, 0]) and len(widget.lines[0].get_xdata()) == 41
    assert np.allclose([b.get_height() + 1e-12 for b in widget.bars], np.clip(expected[-1], 1e-12, 1e3))
    assert np.allclose(widget.marker.get_data(), [[np.log10(lr)], [0.5]])
    before = widget.image.value
    widget.controls['beta'].value = 0.9
    assert widget.image.value != before and widget.rate_labels[0].get_text() == f"rate {heavy_ball_rate(lr * 0.01, 0.9):.3f}"
    with pytest.raises(ValueError, match='positive'): DirectionDecayWidget(curvatures=[1., -1.])
