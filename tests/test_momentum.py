"Tests of the momentum notebook: EWMA, debiasing, trajectories against torch.optim, the quadratic's rate, widgets."
import numpy as np
import pytest

from teachloop.momentum import EWMAWidget, debiased_ewma, effective_window, ewma, ewma_weights

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
