"""The trackers' direction: read from the monitored name's words when `mode='auto'`, refused when the name does not say
it, overridden by a `mode` given; fastai's names for EarlyStopping and SaveModel, with fastai's arguments taken where
teachloop has the feature under another name and refused, before anything changes, where it has not."""
import operator
from pathlib import Path

import numpy as np
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


def test_fastais_names_make_our_classes():
    assert {'EarlyStoppingCallback', 'SaveModelCallback', 'EarlyStopping', 'SaveModel'} <= set(tracker.__all__)
    stopper, saver = EarlyStoppingCallback(patience=3), SaveModelCallback(path='best.pt')
    assert type(stopper) is EarlyStopping and type(saver) is SaveModel
    assert stopper.name == 'early_stopping' and saver.name == 'save_model'  # a checkpoint finds them under either name
    assert EarlyStoppingCallback('accuracy', patience=3).mode == 'max' and SaveModelCallback(path='b.pt').mode == 'min'


def fit_outcome(cb, name, values):
    "Fit the scripted metric `name` with the tracker `cb`: what it decided, and the weights the fit ended with."
    learn = scripted(name, values)
    learn.fit(len(values), cbs=[cb])
    weights = {k: v.clone() for k, v in learn.model.state_dict().items()}
    return (cb.mode, cb.best, cb.wait, getattr(cb, 'stopped_epoch', None), len(learn.recorder.values)), weights


def same_outcome(a, b):
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


VALUES = [0.5, 0.3, 0.4, 0.35, 0.29, 0.6]  # lower is better: epoch 4 beats epoch 1 by 0.01; higher: epoch 0 until 5


@pytest.mark.parametrize('fastai, ours', [
    (dict(monitor='my_metric', comp=np.less, patience=2), dict(monitor='my_metric', mode='min', patience=2)),
    (dict(monitor='my_metric', comp=np.greater, patience=2), dict(monitor='my_metric', mode='max', patience=2)),
    (dict(monitor='my_metric', comp=operator.lt, patience=2), dict(monitor='my_metric', mode='min', patience=2)),
    (dict(monitor='my_metric', comp=torch.gt, patience=2), dict(monitor='my_metric', mode='max', patience=2)),
    (dict(monitor='my_metric', comp=np.less, min_delta=0.02, patience=3),
     dict(monitor='my_metric', mode='min', min_delta=0.02, patience=3)),
    (dict(monitor='error_rate', comp=None, reset_on_fit=True, patience=3), dict(monitor='error_rate', patience=3)),
    (dict(monitor='my_metric', mode='max', patience=2), dict(monitor='my_metric', mode='max', patience=2)),
    (dict(monitor='my_metric', comp=np.less, patience=2, restore_best=False),
     dict(monitor='my_metric', mode='min', patience=2, restore_best=False)),
], ids=['np.less', 'np.greater', 'operator.lt', 'torch.gt', 'min_delta', 'comp=None,reset_on_fit', 'mode', 'restore_best'])
def test_early_stopping_callback_with_fastais_arguments_decides_as_its_mapped_one(fastai, ours):
    name = fastai['monitor']
    mapped, made = fit_outcome(EarlyStopping(**ours), name, VALUES), fit_outcome(EarlyStoppingCallback(**fastai), name, VALUES)
    assert same_outcome(made, mapped)
    # and the mapping matters: the other direction, or no min_delta, decides otherwise
    others = [{**ours, 'mode': 'max' if mapped[0][0] == 'min' else 'min'}]
    if 'min_delta' in ours: others.append({**ours, 'min_delta': 0.})
    assert not any(same_outcome(made, fit_outcome(EarlyStopping(**other), name, VALUES)) for other in others)


def test_early_stopping_callback_takes_fastais_positional_order():
    "fastai's order: monitor, comp, min_delta, patience, reset_on_fit."
    made = EarlyStoppingCallback('my_metric', np.greater, 0.01, 3, True)
    assert (made.monitor, made.mode, made.min_delta, made.patience) == ('my_metric', 'max', 0.01, 3)
    saver = SaveModelCallback('my_metric', np.less, 0.01, 'best', False, False, False, True)
    assert (saver.monitor, saver.mode, saver.min_delta, saver.path) == ('my_metric', 'min', 0.01, Path('models/best.pth'))


@pytest.mark.parametrize('comp, mode', [(np.less, 'min'), (np.greater, 'max')])
def test_save_model_callback_with_fastais_arguments_saves_as_its_mapped_one(tmp_path, monkeypatch, comp, mode):
    "`fname` is written to models/{fname}.pth in the working directory, as fastai does with `learn.path` '.'."
    monkeypatch.chdir(tmp_path)
    made = SaveModelCallback(monitor='my_metric', comp=comp, min_delta=0.02, fname='best', every_epoch=False,
                             at_end=False, with_opt=False, reset_on_fit=True)
    mapped = SaveModel('my_metric', mode, tmp_path / 'ours.pt', min_delta=0.02)
    assert made.path == Path('models/best.pth')
    assert same_outcome(fit_outcome(made, 'my_metric', VALUES), fit_outcome(mapped, 'my_metric', VALUES))
    written, ours = (torch.load(p, weights_only=True)['model'] for p in (tmp_path / 'models/best.pth', tmp_path / 'ours.pt'))
    assert written.keys() == ours.keys() and all(torch.equal(written[k], ours[k]) for k in ours)
    assert SaveModelCallback().path == Path('models/model.pth')  # fastai's default fname, 'model'


REFUSED = [
    (EarlyStoppingCallback, dict(comp=np.less_equal), "'less_equal' has no equivalent: give mode='min' or mode='max'"),
    (EarlyStoppingCallback, dict(comp=lambda a, b: a < b), "has no equivalent: give mode='min' or mode='max'"),
    (EarlyStoppingCallback, dict(comp='min'), "for teachloop's direction write mode='min'"),
    (EarlyStoppingCallback, dict(comp=np.less, mode='min'), "comp or teachloop's mode, not both"),
    (EarlyStoppingCallback, dict(reset_on_fit=False), r"start every fit afresh .* fit\(n_epoch, resume=path\) keeps"),
    (SaveModelCallback, dict(comp=np.greater_equal), "'greater_equal' has no equivalent"),
    (SaveModelCallback, dict(every_epoch=True), r"Checkpoint\(folder, every_n_epochs=n\)"),
    (SaveModelCallback, dict(every_epoch=2), r"every_epoch=2.*Checkpoint\(folder, every_n_epochs=n\)"),
    (SaveModelCallback, dict(at_end=True), r"restore_best=False.*learn.save\(path, with_opt=False\) after the fit"),
    (SaveModelCallback, dict(with_opt=True), r"use Checkpoint\(folder\) and fit\(n_epoch, resume=path\)"),
    (SaveModelCallback, dict(reset_on_fit=False), "start every fit afresh"),
    (SaveModelCallback, dict(fname='best', path='best.pt'), "fname .* or path, not both"),
    (SaveModelCallback, dict(comp=np.greater, mode='max'), "comp or teachloop's mode, not both"),
]


def call_text(make, kwargs):
    "`SaveModelCallback(at_end=True)`: a test's name."
    shown = (f"{k}={getattr(v, '__name__', v)}" for k, v in kwargs.items())
    return f"{make.__name__}({', '.join(shown)})"


@pytest.mark.parametrize('make, kwargs, says', REFUSED, ids=[call_text(m, k) for m, k, _ in REFUSED])
def test_fastais_arguments_teachloop_has_no_feature_for_are_refused_when_made(tmp_path, monkeypatch, make, kwargs, says):
    "Refused in the constructor, saying what to do instead: no callback made, no file nor folder written."
    monkeypatch.chdir(tmp_path)
    learn = scripted('my_metric', VALUES)
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=says): learn.fit(2, cbs=[make(monitor='my_metric', **kwargs)])
    assert list(tmp_path.iterdir()) == [] and learn.recorder.values == []
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in before.items())
