"""Answers that used to be wrong without a word: accuracy on one output per item, the weights a fit under `SaveModel`
ends with, the direction of scikit-learn's negated scores, and the rate of a plain fit after a one-cycle; and the
learner's callbacks missing from `dir(learn)`."""
import math

import pytest
import torch
from torch import nn

from teachloop.callback.core import accuracy
from teachloop.callback.tracker import EarlyStopping, SaveModel, SaveModelCallback, monitor_mode
from teachloop.data import tensor_dls
from teachloop.learner import Callback, Learner
from teachloop.optim.core import SGD
from teachloop.random_state import set_seed
from teachloop.testing import quiet, tiny_learner


@pytest.mark.parametrize('shape', [(6,), (6, 1)])
def test_accuracy_refuses_one_output_per_item_and_names_the_metric_to_use(shape):
    "argmax over one column is always 0: the old answer was the share of 0-labels, whatever the model said."
    pred = torch.tensor([3., 2., 1., -1., -2., -3.]).reshape(shape)  # a confident, always-right binary classifier
    target = torch.tensor([1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match=r"accuracy_multi.*thresh"): accuracy(pred, target)


def test_accuracy_refuses_one_hot_or_multi_label_targets():
    with pytest.raises(ValueError, match="accuracy_multi"): accuracy(torch.randn(4, 3), torch.eye(3)[[0, 1, 2, 0]])


def test_accuracy_still_takes_class_scores_and_sequences_of_them():
    pred, target = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1])
    assert math.isclose(accuracy(pred, target).item(), 2 / 3, rel_tol=1e-6)
    scores = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))  # (batch, positions, classes)
    labels = scores.argmax(-1)
    labels[0, 0] = (labels[0, 0] + 1) % 4
    assert math.isclose(accuracy(scores, labels).item(), 9 / 10, rel_tol=1e-6)


class KeepWeights(Callback):
    "The model's weights after each epoch, and its validation loss as the Recorder wrote it."
    order = 52
    def before_fit(self): self.weights = []
    def after_epoch(self): self.weights.append({k: v.clone() for k, v in self.model.state_dict().items()})


class BlowUpLastEpoch(Callback):
    "A learning rate far too large in the last epoch: a real fit whose last epoch is worse than its best."
    def before_epoch(self):
        if self.epoch == self.n_epoch - 1: self.opt.set_hyper('lr', 3.)


def worse_at_the_end(tmp_path, cb):
    learn = tiny_learner(default_cbs=True, n_batches=4)
    keeper = KeepWeights()
    learn.fit(4, cbs=[cb, keeper, BlowUpLastEpoch()])
    losses = [row[2] for row in learn.recorder.values]
    return learn, keeper, losses


@pytest.mark.parametrize('make', [lambda p: SaveModel(path=p), lambda p: SaveModelCallback(path=p)],
                         ids=['SaveModel', 'SaveModelCallback'])
def test_a_fit_under_save_model_ends_with_the_best_epochs_weights(tmp_path, make):
    learn, keeper, losses = worse_at_the_end(tmp_path, make(tmp_path / 'best.pt'))
    best = min(range(len(losses)), key=losses.__getitem__)
    assert losses[-1] > losses[best] and best < len(losses) - 1  # the fit did get worse at its end
    model = learn.model.state_dict()
    assert all(torch.equal(v, keeper.weights[best][k]) for k, v in model.items())
    assert not all(torch.equal(v, keeper.weights[-1][k]) for k, v in model.items())
    # and validating it gives the best epoch's loss again
    assert math.isclose(learn.validate()[0], losses[best], rel_tol=1e-6)


def test_save_model_loads_nothing_when_no_epoch_was_recorded(tmp_path):
    "A fit cancelled before its first epoch's end wrote no file: the model stays as it is."
    class StopAtOnce(Callback):
        def before_train(self): raise __import__('teachloop.learner', fromlist=['x']).CancelFitException()
    learn = tiny_learner(default_cbs=True)
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    learn.fit(2, cbs=[SaveModel(path=tmp_path / 'best.pt'), StopAtOnce()])
    assert not (tmp_path / 'best.pt').exists()
    assert all(torch.equal(v, before[k]) for k, v in learn.model.state_dict().items())


NEGATED = ['neg_mean_squared_error', 'neg_log_loss', 'neg_root_mean_squared_error', 'neg_mean_absolute_error',
           'neg_brier_score', 'neg_mean_poisson_deviance', 'neg_median_absolute_error', 'd2_log_loss_score']


@pytest.mark.parametrize('name', NEGATED)
def test_scikit_learns_negated_scores_are_higher_is_better(name):
    assert monitor_mode(name) == 'max'


def neg_mean_squared_error(pred, target): return -nn.functional.mse_loss(pred, target)


def regression_learner():
    set_seed(0)
    x = torch.randn(256, 2, dtype=torch.float64)
    y = (x @ torch.tensor([2., -3.], dtype=torch.float64) + 0.1 * torch.randn(256, dtype=torch.float64))[:, None]
    return quiet(Learner(tensor_dls(x, y, bs=32), nn.Linear(2, 1).double(), nn.functional.mse_loss, opt_func=SGD,
                         lr=0.02, metrics=[neg_mean_squared_error]))


@pytest.mark.numeric
def test_early_stopping_does_not_stop_while_a_negated_score_improves():
    learn = regression_learner()
    stopper = EarlyStopping('neg_mean_squared_error', patience=1)
    learn.fit(5, cbs=[stopper])
    scores = [row[3] for row in learn.recorder.values]
    assert all(b > a for a, b in zip(scores, scores[1:]))  # it improved at every epoch
    assert stopper.mode == 'max' and stopper.stopped_epoch is None and len(scores) == 5


@pytest.mark.numeric
def test_early_stopping_on_a_negated_score_restores_its_best_epoch():
    learn = regression_learner()
    keeper = KeepWeights()
    stopper = EarlyStopping('neg_mean_squared_error', patience=1)
    learn.fit(6, cbs=[stopper, keeper, BlowUpLastEpoch()])
    scores = [row[3] for row in learn.recorder.values]
    best = max(range(len(scores)), key=scores.__getitem__)
    assert scores[-1] < scores[best] and best == len(scores) - 2
    assert all(torch.equal(v, keeper.weights[best][k]) for k, v in learn.model.state_dict().items())


def test_no_scikit_learn_scorer_is_read_as_lower_is_better():
    "scikit-learn's scorers are all higher-is-better by its convention: their names may ask for `mode`, never say 'min'."
    from sklearn.metrics import get_scorer_names
    def judged(name):
        try: return monitor_mode(name)
        except ValueError: return 'asks for mode'
    said = {name: judged(name) for name in get_scorer_names()}
    assert 'min' not in said.values() and sum(mode == 'max' for mode in said.values()) > 40


class Rates(Callback):
    "The first group's learning rate at each training batch."
    def __init__(self): self.seen = []
    def before_batch(self):
        if self.learn.training: self.seen.append(self.learn.opt.param_groups[0]['lr'])


def test_a_plain_fit_after_a_one_cycle_trains_at_the_learners_rate():
    "fastai's fit uses learn.lr: not the one-cycle's last rate (its max / 1e5 / 25, where nothing moves)."
    learn = quiet(tiny_learner(lr=0.05))
    learn.fit_one_cycle(1, 0.1)
    assert learn.opt.param_groups[0]['lr'] <= 1e-6  # where the schedule left the optimizer
    rates = Rates()
    learn.fit(1, cbs=[rates])
    assert rates.seen and set(rates.seen) == {0.05}
    learn.fit(1, 0.2, cbs=[rates])  # a rate given to fit is this fit's
    assert rates.seen[-1] == 0.2


def test_the_learners_callbacks_are_in_dir_for_tab_completion():
    learn = tiny_learner(default_cbs=True)
    assert {'recorder', 'progress', 'train_eval'} <= set(dir(learn)) and 'fit' in dir(learn)
