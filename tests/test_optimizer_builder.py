"""The optimizer builder: recipes checked by their rules, named by the named optimizers' own lists, built optimizers
equal to those, and the widget showing what its controls say."""
import html
from functools import partial

import numpy as np
import pytest
import torch

from teachloop.lessons.momentum import SURFACES, trajectory
from teachloop.optim.core import (SGD, Adam, Optimizer, RMSProp, adam_step, average_grad, average_sqr_grad, l2_reg,
                                 momentum_step, sgd_step, step_stat, weight_decay)
from teachloop.lessons.optimizer_builder import (HYPERS, PALETTE, OptimizerBuilder, check_recipe, digits_steps, name_recipe,
                                         recipe_code)
from teachloop.optim.more import Lion, Nesterov, lion_step, nesterov_step

pytestmark = pytest.mark.numeric

ADAMW = [weight_decay, partial(average_grad, dampening=True), average_sqr_grad, step_stat, adam_step]


@pytest.mark.parametrize('cbs,named,make', [
    (ADAMW, 'AdamW', partial(Adam, lr=0.01, mom=0.9, sqr_mom=0.99, eps=1e-8, wd=0.01)),
    ([l2_reg] + ADAMW[1:], 'Adam with L2', partial(Adam, lr=0.01, mom=0.9, sqr_mom=0.99, eps=1e-8, wd=0.01, decouple_wd=False)),
    ([average_grad, momentum_step], 'SGD with momentum (wd=0)', partial(SGD, lr=0.01, mom=0.9)),
    ([weight_decay, average_grad, nesterov_step], 'Nesterov', partial(Nesterov, lr=0.01, mom=0.9, wd=0.01)),
    ([average_sqr_grad, PALETTE['step: over the gradient RMS (RMSProp)']], 'RMSProp (wd=0)', partial(RMSProp, lr=0.01, sqr_mom=0.99, eps=1e-8)),
    ([weight_decay, lion_step], 'Lion', partial(Lion, lr=0.01, mom=0.9, avg_mom=0.99, wd=0.01)),
])
@pytest.mark.float32
def test_a_named_recipe_trains_exactly_as_its_named_optimizer(cbs, named, make):
    check_recipe(cbs)
    assert name_recipe(cbs) == named
    hypers = {**HYPERS, 'wd': 0. if named.endswith('(wd=0)') else HYPERS['wd']}
    built, built_model = digits_steps(lambda params: Optimizer(params, cbs, **hypers), n_steps=10)
    reference, reference_model = digits_steps(make, n_steps=10)
    assert torch.equal(built, reference)
    assert all(torch.equal(a, b) for a, b in zip(built_model.parameters(), reference_model.parameters()))


@pytest.mark.parametrize('cbs,says', [
    ([], "nothing moves the weights"),
    ([sgd_step, momentum_step], "two steps move the weights"),
    ([sgd_step, weight_decay], "comes after the step"),
    ([weight_decay, l2_reg, sgd_step], "keep one"),
    ([average_grad, partial(average_grad, dampening=True), momentum_step], "two averages of the gradient"),
    ([momentum_step], "reads ['grad_avg'], which no callback before it makes: add 'average the gradient' or "
                      "'average the gradient, dampened' before it"),
    ([partial(average_grad, dampening=True), average_sqr_grad, adam_step], "reads ['step']"),
    ([average_grad, lion_step], "Lion keeps its own average"),
])
def test_a_recipe_that_cannot_work_says_what_to_change(cbs, says):
    with pytest.raises(ValueError) as error: check_recipe(cbs)
    assert says in str(error.value)


def test_a_new_recipe_has_no_name_and_its_code_builds_it():
    cbs = [average_grad, PALETTE['step: over the gradient RMS (RMSProp)']]
    with pytest.raises(ValueError, match="reads \\['sqr_avg'\\]"): check_recipe(cbs)
    cbs = [partial(average_grad, dampening=True), momentum_step]  # momentum with a dampened average: no name
    check_recipe(cbs)
    assert name_recipe(cbs) is None
    code = recipe_code(cbs, {**HYPERS, 'lr': 0.03})
    assert code == "Optimizer(params, [partial(average_grad, dampening=True), momentum_step], lr=0.03, mom=0.9)"
    params = [torch.zeros(2, requires_grad=True)]
    built = eval(code, {'Optimizer': Optimizer, 'partial': partial, 'average_grad': average_grad,
                        'momentum_step': momentum_step, 'params': params})
    assert [getattr(cb, 'keywords', None) for cb in built.cbs] == [{'dampening': True}, None]


def test_the_widget_shows_what_its_controls_say():
    widget = OptimizerBuilder(lr=0.02)
    assert 'this is <b>AdamW</b>' in widget.message.value
    widget.set_values(ticked=('average the gradient', 'step: Nesterov'), surface='rosenbrock', lr=0.001)
    lr = widget.controls['lr'].value
    expected = trajectory(SURFACES['rosenbrock'], partial(Nesterov, lr=lr, mom=0.9, wd=0.), 100)
    assert 'Nesterov (wd=0)' in widget.message.value
    assert np.allclose(widget.path_lines['yours'].get_ydata(), expected[:, 1].numpy())
    assert np.array_equal(widget.fit_lines['yours'].get_ydata(), widget.fit_lines['named'].get_ydata())
    before = widget.image.value
    widget.set_values(ticked=('step: debiased averages (Adam)',))
    assert 'not an optimizer yet' in widget.message.value and widget.image.value != before
    assert len(widget.path_lines['yours'].get_xdata()) == 0
    with pytest.raises(KeyError, match='not in the palette'): OptimizerBuilder(ticked=('momentum',))
