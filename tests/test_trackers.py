"""The trackers' direction: read from the monitored name's words when `mode='auto'`, refused when the name does not say
it, overridden by a `mode` given; fastai's names for EarlyStopping and SaveModel."""
import pytest
import torch

import teachloop.callback.tracker as tracker
from teachloop.callback.tracker import (EarlyStopping, EarlyStoppingCallback, ReduceLROnPlateau, SaveModel,
                                        SaveModelCallback, TrackerCallback, monitor_mode)
from teachloop.testing import tiny_learner

# names as libraries record them, and the direction a person would give them
LOWER = ['valid_loss', 'train_loss', 'error_rate', 'mean_squared_error', 'rmse', 'mae', 'perplexity', 'valLoss',
         'top1_err', 'brier_score', 'BrierScore', 'score_error']
HIGHER = ['accuracy', 'top5_accuracy', 'valid_acc', 'RocAuc', 'roc_auc_score', 'f1_score', 'fbeta', 'precision',
          'recall', 'r2_score', 'dice', 'score', 'BalancedAccuracy']
UNCLEAR = ['my_metric', 'accumulated_grad', 'validloss', 'accuracy_loss', 'accuracy_error', 'grad_norm', '']


@pytest.mark.parametrize('name, mode', [(n, 'min') for n in LOWER] + [(n, 'max') for n in HIGHER])
def test_the_direction_is_read_from_the_names_words(name, mode):
    assert monitor_mode(name) == mode


@pytest.mark.parametrize('name', UNCLEAR)
def test_a_name_that_does_not_say_it_asks_for_mode(name):
    with pytest.raises(ValueError, match="give mode='min' or mode='max'"): monitor_mode(name)
    with pytest.raises(ValueError, match="give mode='min' or mode='max'"): EarlyStopping(name)


def fastai_rule(name): return 'min' if 'loss' in name or 'error' in name else 'max'


def test_it_agrees_with_fastais_rule_where_that_one_is_right():
    "fastai: 'loss' or 'error' in the name is minimised, anything else maximised (so `rmse` and `mae` too)."
    differs = [n for n in LOWER + HIGHER if monitor_mode(n) != fastai_rule(n)]
    assert differs == ['rmse', 'mae', 'perplexity', 'valLoss', 'top1_err', 'brier_score', 'BrierScore']


@pytest.mark.parametrize('cls', [TrackerCallback, EarlyStopping, ReduceLROnPlateau, SaveModel])
def test_each_tracker_reads_it_by_default_and_takes_a_mode_given(cls, tmp_path):
    extra = {'path': tmp_path / 'best.pt'} if cls is SaveModel else {}
    assert cls(**extra).monitor == 'valid_loss' and cls(**extra).mode == 'min'
    assert cls('accuracy', **extra).mode == 'max' and cls('accuracy', 'min', **extra).mode == 'min'
    assert cls('my_metric', 'max', **extra).mode == 'max'  # a name that says nothing, with its mode given
    with pytest.raises(ValueError, match="mode must be 'min'"): cls('accuracy', 'maximum', **extra)
    with pytest.raises(TypeError, match="monitor must be"): cls(3, **extra)


def test_save_model_needs_a_path():
    with pytest.raises(TypeError, match=r"SaveModel\(path='best.pt'\)"): SaveModel()


def test_fastais_factor_is_refused_with_ours():
    with pytest.raises(ValueError, match="its factor=10 is 0.1 here"): ReduceLROnPlateau(factor=10)


def scripted(name, values):
    "A metric called `name` whose value at epoch `e` is `values[e]`, and the learner it follows."
    def metric(pred, target): return torch.tensor(values[learn.epoch])
    metric.__name__ = name
    learn = tiny_learner(default_cbs=True, metrics=[metric])
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def stop_epoch(values, better, patience):
    "By hand: the epoch after which `patience` epochs in a row did not beat the best value, or None."
    best, wait = values[0], 0
    for epoch, value in enumerate(values[1:], 1):
        if better(value, best): best, wait = value, 0
        else: wait += 1
        if wait >= patience: return epoch
    return None


@pytest.mark.parametrize('name, better', [('error_rate', lambda a, b: a < b), ('accuracy', lambda a, b: a > b)])
def test_early_stopping_with_the_mode_read_from_the_name_stops_where_the_hand_count_does(name, better):
    values = [0.5, 0.3, 0.4, 0.35, 0.2, 0.6]  # lower is better: stops after epoch 3; higher: after epoch 2
    stopper = EarlyStopping(name, patience=2)
    scripted(name, values).fit(len(values), cbs=[stopper])
    assert stopper.stopped_epoch == stop_epoch(values, better, 2) is not None


def test_fastais_names_are_the_same_classes():
    assert EarlyStoppingCallback is EarlyStopping and SaveModelCallback is SaveModel
    assert {'EarlyStoppingCallback', 'SaveModelCallback', 'EarlyStopping', 'SaveModel'} <= set(tracker.__all__)
    assert EarlyStoppingCallback(patience=3).name == 'early_stopping'  # a checkpoint finds it under either name

