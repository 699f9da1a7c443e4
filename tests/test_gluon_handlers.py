import math
import os

import pytest
import torch
from torch import nn

from teachloop.callback.core import accuracy
from teachloop.data import DataLoaders, tensor_dls
from teachloop.designs.gluon_handlers import (GLUON_EVENTS, BatchEnd, CheckpointHandler, EarlyStoppingHandler, EpochBegin,
                                      EpochEnd, Estimator, GradientClippingHandler, LoggingHandler, Loss, Metric,
                                      MetricHandler, StoppingHandler, TrainBegin, ValidationHandler, handlers_by_event)
from teachloop.learner import Learner


# this file's own data: a classification problem, its validation set held apart for the validation handlers
def classification_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(160, 4, generator=g), torch.randint(0, 3, (160,), generator=g)
    return tensor_dls(x, y, bs=16, valid_pct=0.25)  # 8 training batches, 1 validation batch of 40


def make_learner():
    dls = classification_data()
    torch.manual_seed(0)
    learn = Learner(DataLoaders(dls.train, None), nn.Linear(4, 3), nn.functional.cross_entropy, lr=1e-2,
                    default_cbs=False)
    return learn, dls


class EventLog(TrainBegin, EpochBegin, BatchEnd, EpochEnd):
    "Record (event, handler name) into a shared list."
    def __init__(self, name, log, priority=0): self.name, self.log, self.priority = name, log, priority
    def train_begin(self, estimator, **kwargs): self.log.append(('train_begin', self.name))
    def epoch_begin(self, estimator, **kwargs): self.log.append(('epoch_begin', self.name))
    def batch_end(self, estimator, **kwargs): self.log.append(('batch_end', self.name))
    def epoch_end(self, estimator, **kwargs): self.log.append(('epoch_end', self.name))


def test_priority_lower_first_and_stable():
    log = []
    handlers = [EventLog('a', log, 1), EventLog('b', log, -1), EventLog('c', log, 1), EventLog('d', log, -1)]
    learn, _ = make_learner()
    learn.fit(1, cbs=[Estimator(handlers)])
    assert [name for event, name in log if event == 'train_begin'] == ['b', 'd', 'a', 'c']
    assert [name for event, name in log[8:12] if event == 'batch_end'] == ['b', 'd', 'a', 'c']


def test_a_handler_without_the_mixin_is_still_called():
    class NoMixin:
        def __init__(self): self.calls = 0
        def batch_end(self, estimator, **kwargs): self.calls += 1
    handler = NoMixin()
    learn, dls = make_learner()
    learn.fit(2, cbs=[Estimator([handler])])
    assert handler.calls == 2 * len(dls.train)


def test_inherited_empty_mixin_methods_are_not_dispatched():
    class OnlyEpochBegin(BatchEnd, EpochEnd, EpochBegin):
        def epoch_begin(self, estimator, **kwargs): pass
    handler = OnlyEpochBegin()
    table = handlers_by_event([handler])
    assert {event for event in GLUON_EVENTS if table[event]} == {'epoch_begin'}


def test_bad_handlers_are_refused():
    class Typo(BatchEnd):
        def batch_ends(self, estimator, **kwargs): pass
    class Nothing(BatchEnd): pass
    with pytest.raises(ValueError, match='batch_end'): handlers_by_event([Typo()])
    with pytest.raises(ValueError, match='none of the events'): handlers_by_event([Nothing()])
    with pytest.raises(TypeError, match='instance'): handlers_by_event([StoppingHandler])


def test_stopping_handler_max_batch_and_max_epoch():
    class CountBatches(BatchEnd):
        def __init__(self): self.n = 0
        def batch_end(self, estimator, **kwargs): self.n += 1
    counter = CountBatches()
    learn, dls = make_learner()
    learn.fit(5, cbs=[Estimator([StoppingHandler(max_batch=11), counter])])
    assert counter.n == 11 and learn.epoch == 11 // len(dls.train)
    counter = CountBatches()
    learn.fit(5, cbs=[Estimator([StoppingHandler(max_epoch=2), counter])])
    assert counter.n == 2 * len(dls.train) and learn.epoch == 1
    with pytest.raises(ValueError, match='max_batch'): StoppingHandler(max_batch=0)


def test_batch_end_stop_still_runs_epoch_end_then_stops():
    log = []
    class StopAtThird(BatchEnd):
        def __init__(self): self.n = 0
        def batch_end(self, estimator, **kwargs):
            self.n += 1
            return self.n == 3
    learn, _ = make_learner()
    learn.fit(3, cbs=[Estimator([StopAtThird(), EventLog('log', log)])])
    assert [e for e, _ in log] == ['train_begin', 'epoch_begin'] + ['batch_end'] * 3 + ['epoch_end']


def test_metric_handler_matches_hand_computed_epoch_metrics():
    train_loss, train_acc = Loss('train loss'), Metric(accuracy, 'train accuracy')
    learn, dls = make_learner()
    class Collect(BatchEnd):
        def __init__(self): self.rows = []
        def batch_end(self, estimator, *args, pred, label, loss, **kwargs):
            self.rows.append((len(label), loss.item(), accuracy(pred, label).item()))
    collect = Collect()
    learn.fit(1, cbs=[Estimator([MetricHandler([train_loss, train_acc]), collect])])
    sizes = [r[0] for r in collect.rows]
    assert math.isclose(train_loss.get()[1], sum(s * l for s, l, _ in collect.rows) / sum(sizes), rel_tol=1e-6)
    assert math.isclose(train_acc.get()[1], sum(s * a for s, _, a in collect.rows) / sum(sizes), rel_tol=1e-6)


def test_validation_handler_periods_and_evaluate_matches_the_model():
    learn, dls = make_learner()
    val_loss, val_acc = Loss('validation loss'), Metric(accuracy, 'validation accuracy')
    by_batch = ValidationHandler(dls.valid, eval_fn=lambda data: None, epoch_period=None, batch_period=3)
    by_epoch = ValidationHandler(dls.valid, epoch_period=2)
    estimator = Estimator([by_batch, by_epoch], val_metrics=[val_loss, val_acc])
    learn.add_cbs([estimator])
    learn.fit(4)
    assert by_batch.n_evaluations == (4 * len(dls.train)) // 3 and by_epoch.n_evaluations == 2
    xv, yv = dls.valid.dataset.tensors
    with torch.no_grad(): pred = learn.model(xv)
    assert math.isclose(val_acc.get()[1], accuracy(pred, yv).item(), rel_tol=1e-6)
    assert math.isclose(val_loss.get()[1], nn.functional.cross_entropy(pred, yv).item(), rel_tol=1e-5)


def test_evaluate_restores_training_mode():
    learn, dls = make_learner()
    estimator = Estimator(val_metrics=[Loss()])
    learn.add_cbs([estimator])
    learn.model.train()
    estimator.evaluate(dls.valid)
    assert learn.model.training


def test_logging_handler_lines():
    lines = []
    learn, dls = make_learner()
    train_loss = Loss('train loss')
    learn.fit(2, cbs=[Estimator([MetricHandler([train_loss]), LoggingHandler(3, [train_loss], log=lines.append)])])
    per_epoch = len(dls.train) // 3
    assert lines[0].startswith('Training begins: 2 epochs') and lines[-1].startswith('Training ended after 2 epochs')
    batch_lines = [l for l in lines if '][Batch ' in l]
    assert len(batch_lines) == 2 * per_epoch and batch_lines[0].startswith('[Epoch 0][Batch 3] train loss: ')
    assert sum(l.startswith('[Epoch ') and 'finished' in l for l in lines) == 2
    with pytest.raises(ValueError, match='log_interval'): LoggingHandler(0)


def test_checkpoint_handler_files_and_best(tmp_path):
    learn, dls = make_learner()
    val_acc = Metric(accuracy, 'validation accuracy')
    values = iter([0.5, 0.7, 0.6, 0.8])  # the monitor as seen at each save
    val_acc.get = lambda: ('validation accuracy', next(values))
    saver = CheckpointHandler(tmp_path, monitor=val_acc, mode='max', save_best=True, max_checkpoints=2)
    class WeightsAtEpochEnd(EpochEnd):
        def __init__(self): self.weights = []
        def epoch_end(self, estimator, **kwargs): self.weights.append(estimator.net.weight.detach().clone())
    spy = WeightsAtEpochEnd()
    learn.fit(4, cbs=[Estimator([spy, saver])])
    n = len(dls.train)
    assert sorted(os.listdir(tmp_path)) == sorted([f'model-epoch3batch{3 * n}.pt', f'model-epoch4batch{4 * n}.pt', 'model-best.pt'])
    assert saver.best == 0.8
    learn.load(tmp_path / 'model-best.pt')
    assert torch.equal(learn.model.weight, spy.weights[3])
    best_state = torch.load(tmp_path / f'model-epoch3batch{3 * n}.pt', weights_only=True)
    assert torch.equal(best_state['model']['weight'], spy.weights[2])


def test_checkpoint_handler_refuses_auto_and_best_without_monitor(tmp_path):
    with pytest.raises(ValueError, match="got 'auto'"): CheckpointHandler(tmp_path, monitor=Loss(), mode='auto')
    with pytest.raises(ValueError, match='monitor'): CheckpointHandler(tmp_path, save_best=True)


class FakeMonitor:
    def __init__(self, values): self.values = iter(values)
    def get(self): return 'x', next(self.values)


@pytest.mark.parametrize('values, mode, patience, min_delta, stops_at', [
    ([1.0, 0.9, 0.95, 0.8], 'min', 1, 0., 3),
    ([1.0, 0.9, 0.95, 0.94, 0.93], 'min', 3, 0., 5),
    ([1.0, 0.9, 0.95, 0.8], 'min', 2, 0., None),
    ([1.0, 0.95, 0.5], 'min', 1, 0.1, 2),
    ([0.1, 0.2, 0.3, 0.25], 'max', 1, 0., 4),
])
def test_early_stopping_handler_logic(values, mode, patience, min_delta, stops_at):
    handler = EarlyStoppingHandler(FakeMonitor(values), mode, patience, min_delta)
    handler.train_begin(None)
    results = [handler.epoch_end(None) for _ in values]
    first_stop = results.index(True) + 1 if True in results else None
    assert first_stop == stops_at and handler.stopped_epoch == (stops_at if stops_at else None)


def test_early_stopping_handler_stops_a_fit():
    learn, dls = make_learner()
    monitor = Loss('validation loss')
    stopper = EarlyStoppingHandler(monitor, 'min', patience=1, min_delta=100.)
    learn.fit(4, cbs=[Estimator([ValidationHandler(dls.valid), stopper], val_metrics=[monitor])])
    assert learn.epoch == 1 and stopper.stopped_epoch == 2
    with pytest.raises(ValueError, match='patience'): EarlyStoppingHandler(monitor, patience=0)


def test_gradient_clipping_handler_clips_before_the_step():
    norms = []
    class Spy:
        priority = 1
        def backward_end(self, estimator, **kwargs):
            norms.append(torch.stack([p.grad.norm() for p in estimator.net.parameters()]).norm().item())
    learn, _ = make_learner()
    learn.fit(1, cbs=[Estimator([GradientClippingHandler(0.01), Spy()])])
    assert norms and max(norms) <= 0.01 + 1e-6
    learn, _ = make_learner()
    norms.clear()
    learn.fit(1, cbs=[Estimator([Spy()])])
    assert max(norms) > 0.01
