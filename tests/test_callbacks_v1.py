import math

import pytest
import torch
from torch import nn

from teachloop.callback.core import accuracy, smooth_values
from teachloop.designs.callbacks_v1 import (V1_EVENTS, AverageMetric, CallbackHandler, V1GradientClipping, SmoothenValue,
                                    V1Stepper, V1Callback)
from teachloop.data import tensor_dls
from teachloop.learner import Learner
from teachloop.callback.schedule import annealing_cos
from teachloop.testing import tiny_dls, tiny_learner

LR = 0.1  # tiny_learner's, which the hand-written loop must take too


def hand_written_fit(n_epoch, transform_batch=lambda x, y: (x, y), transform_pred=lambda p: p, clip=None):
    "Plain PyTorch loop over the same training batches with the same initial weights."
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(n_epoch):
        for x, y in tiny_dls().train:
            x, y = transform_batch(x, y)
            loss = nn.functional.mse_loss(transform_pred(model(x)), y)
            loss.backward()
            if clip: nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model


def assert_same_weights(model_a, model_b):
    for a, b in zip(model_a.parameters(), model_b.parameters()): assert torch.allclose(a, b, atol=1e-6)


class Log(V1Callback):
    def __init__(self): self.calls = []
    def _record(self, event, **state): self.calls.append((event, dict(state)))

for _event in V1_EVENTS:
    setattr(Log, _event, lambda self, _e=_event, **state: self._record(_e, **state))


def test_event_sequence_and_state():
    log = Log()
    tiny_learner().fit(2, cbs=[CallbackHandler([log])])
    train_batch = ['on_batch_begin', 'on_loss_begin', 'on_backward_begin', 'on_backward_end', 'on_step_end', 'on_batch_end']
    epoch = (['on_epoch_begin'] + train_batch * 2 + ['on_batch_begin', 'on_loss_begin', 'on_batch_end', 'on_epoch_end'])
    assert [e for e, _ in log.calls] == ['on_train_begin'] + epoch * 2 + ['on_train_end']
    ends = [s for e, s in log.calls if e == 'on_batch_end']
    assert [(s['epoch'], s['iteration'], s['num_batch'], s['train']) for s in ends] == [
        (0, 0, 0, True), (0, 1, 1, True), (0, 2, 0, False), (1, 2, 0, True), (1, 3, 1, True), (1, 4, 0, False)]
    assert all(s['n_epochs'] == 2 for _, s in log.calls)
    epoch_ends = [s for e, s in log.calls if e == 'on_epoch_end']
    assert all(len(s['last_metrics']) == 1 and s['last_metrics'][0] > 0 for s in epoch_ends)
    assert [s['exception'] for e, s in log.calls if e == 'on_train_end'] == [False]


def test_callbacks_run_sorted_by_order_stably():
    order = []
    def make(name, rank):
        cls = type(name, (V1Callback,), {'_order': rank, 'on_train_begin': lambda self, **k: order.append(name)})
        return cls()
    tiny_learner().fit(1, cbs=[CallbackHandler([make('b', 1), make('a', 0), make('c', 1)])])
    assert order == ['a', 'b', 'c']


def test_on_batch_begin_pair_replaces_training_batch():
    class Flip(V1Callback):
        def on_batch_begin(self, last_input, last_target, train, **kwargs):
            if train: return last_input.flip(-1), last_target
    learn = tiny_learner()
    learn.fit(2, cbs=[CallbackHandler([Flip()])])
    assert_same_weights(learn.model, hand_written_fit(2, transform_batch=lambda x, y: (x.flip(-1), y)))
    assert not torch.allclose(learn.model.weight, hand_written_fit(2).weight, atol=1e-4)


def test_on_batch_begin_dict_updates_target():
    class Double(V1Callback):
        def on_batch_begin(self, last_target, train, **kwargs):
            if train: return {'last_target': last_target * 2}
    learn = tiny_learner()
    learn.fit(1, cbs=[CallbackHandler([Double()])])
    assert_same_weights(learn.model, hand_written_fit(1, transform_batch=lambda x, y: (x, y * 2)))


def test_on_loss_begin_replaces_output():
    class Scale(V1Callback):
        def on_loss_begin(self, last_output, **kwargs): return last_output * 2
    learn = tiny_learner()
    learn.fit(1, cbs=[CallbackHandler([Scale()])])
    assert_same_weights(learn.model, hand_written_fit(1, transform_pred=lambda p: p * 2))


def test_on_backward_begin_replaces_loss_and_later_callbacks_see_it():
    class Zero(V1Callback):
        def on_backward_begin(self, last_loss, **kwargs): return last_loss * 0
    class Spy(V1Callback):
        _order = 1
        def on_train_begin(self, **kwargs): self.losses = []
        def on_backward_begin(self, last_loss, **kwargs): self.losses.append(float(last_loss.detach()))
    learn, spy = tiny_learner(), Spy()
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.fit(1, cbs=[CallbackHandler([Zero(), spy])])
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))
    assert spy.losses == [0., 0.]


class CountSteps(V1Callback):
    def on_train_begin(self, **kwargs): self.steps_per_epoch, self.valid_batches = [], 0
    def on_epoch_begin(self, **kwargs): self.steps_per_epoch.append(0)
    def on_step_end(self, **kwargs): self.steps_per_epoch[-1] += 1
    def on_batch_end(self, train, **kwargs): self.valid_batches += not train


def test_on_batch_end_true_ends_the_training_phase_only():
    class StopAfterFirst(V1Callback):
        def on_batch_end(self, num_batch, train, **kwargs): return train and num_batch == 0
    counter = CountSteps()
    tiny_learner().fit(2, cbs=[CallbackHandler([StopAfterFirst(), counter])])
    assert counter.steps_per_epoch == [1, 1] and counter.valid_batches == 2


def test_on_batch_end_true_in_validation_ends_validation():
    class StopValid(V1Callback):
        def on_batch_end(self, train, **kwargs): return not train
    counter = CountSteps()
    tiny_learner(dls=tiny_dls(valid_batches=3)).fit(1, cbs=[CallbackHandler([StopValid(), counter])])
    assert counter.valid_batches == 1 and counter.steps_per_epoch == [2]


def test_on_epoch_end_true_stops_training():
    class StopAtOnce(V1Callback):
        def on_epoch_end(self, **kwargs): return True
    class False_(V1Callback):
        _order = 1
        def on_epoch_end(self, **kwargs): return False  # must not undo the stop asked before
    counter, log = CountSteps(), Log()
    learn = tiny_learner()
    learn.fit(3, cbs=[CallbackHandler([StopAtOnce(), False_(), counter, log])])
    assert counter.steps_per_epoch == [2] and learn.epoch == 0
    assert log.calls[-1][0] == 'on_train_end' and log.calls[-1][1]['exception'] is False


@pytest.mark.parametrize('error', [RuntimeError('boom'), KeyboardInterrupt()])
def test_on_train_end_gets_the_exception(error):
    class Fail(V1Callback):
        def on_backward_end(self, iteration, **kwargs):
            if iteration == 1: raise error
    log = Log()
    learn = tiny_learner()
    with pytest.raises(type(error)):
        learn.fit(2, cbs=[CallbackHandler([Fail(), log])])
    assert log.calls[-1][0] == 'on_train_end' and log.calls[-1][1]['exception'] is error
    assert sum(e == 'on_train_end' for e, _ in log.calls) == 1
    learn.fit(1)  # the learner is still usable


def test_handler_is_silent_outside_a_fit():
    log = Log()
    learn = tiny_learner()
    learn.add_cbs([CallbackHandler([log])])
    learn.get_preds()
    assert log.calls == []
    learn.fit(1)
    assert log.calls[0][0] == 'on_train_begin' and log.calls[-1][0] == 'on_train_end'


def test_bad_return_values_are_explained():
    class UnknownKey(V1Callback):
        def on_epoch_begin(self, **kwargs): return {'learning_rate': 1}
    class StepReturns(V1Callback):
        def on_step_end(self, **kwargs): return 1.
    class SingleTensor(V1Callback):
        def on_batch_begin(self, last_input, **kwargs): return last_input
    with pytest.raises(KeyError, match='learning_rate'): tiny_learner().fit(1, cbs=[CallbackHandler([UnknownKey()])])
    with pytest.raises(TypeError, match='StepReturns.on_step_end'): tiny_learner().fit(1, cbs=[CallbackHandler([StepReturns()])])
    with pytest.raises(TypeError, match='pair'): tiny_learner().fit(1, cbs=[CallbackHandler([SingleTensor()])])


def test_bad_callbacks_are_refused():
    class Typo(V1Callback):
        def on_epoch_ends(self, **kwargs): pass
    class Named(V1Callback):
        def on_something(self, **kwargs): pass
    with pytest.raises(ValueError, match='on_epoch_end'): CallbackHandler([Typo()])
    with pytest.raises(ValueError, match='on_something'): CallbackHandler([Named()])
    with pytest.raises(TypeError, match='instance'): CallbackHandler([V1GradientClipping])
    with pytest.raises(TypeError, match='V1Callback'): CallbackHandler([object()])


def test_smooth_loss_matches_smooth_values_of_batch_losses():
    class Collect(V1Callback):
        def on_train_begin(self, **kwargs): self.losses, self.smooth = [], []
        def on_backward_begin(self, last_loss, smooth_loss, **kwargs):
            self.losses.append(float(last_loss.detach())); self.smooth.append(float(smooth_loss))
    collect = Collect()
    tiny_learner().fit(3, cbs=[CallbackHandler([collect], beta=0.9)])
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(collect.smooth, smooth_values(collect.losses, 0.9)))


def test_smoothen_value_on_numbers_and_tensors():
    numbers, tensors = SmoothenValue(0.98), SmoothenValue(0.98)
    values = [3., 1., 4., 1., 5.]
    for v in values:
        numbers.add_value(v); tensors.add_value(torch.tensor(v))
    assert math.isclose(numbers.smooth, smooth_values(values, 0.98)[-1])
    assert isinstance(tensors.smooth, torch.Tensor) and math.isclose(float(tensors.smooth), numbers.smooth, rel_tol=1e-6)
    with pytest.raises(ValueError, match='beta'): SmoothenValue(1.)


def test_stepper():
    linear = V1Stepper((2., 0.), 4)
    assert [linear.step() for _ in range(4)] == [1.5, 1., 0.5, 0.] and linear.is_done
    cos = V1Stepper((1., 0.), 3, annealing_cos)
    values = [cos.step() for _ in range(3)]
    assert all(math.isclose(v, (1 + math.cos(math.pi * i / 3)) / 2, abs_tol=1e-12) for v, i in zip(values, (1, 2, 3)))
    constant = V1Stepper(0.3, 2)
    assert [constant.step(), constant.is_done, constant.step(), constant.is_done] == [0.3, False, 0.3, True]
    with pytest.raises(ValueError, match='n_iter'): V1Stepper((1, 0), 0)
    with pytest.raises(ValueError, match='pair'): V1Stepper((1, 0, 2), 3)


def test_average_metric_matches_accuracy_over_validation_set():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    dls = tensor_dls(x, y, bs=16, valid_pct=0.3)
    torch.manual_seed(0)
    learn = Learner(dls, nn.Linear(5, 3), nn.functional.cross_entropy, lr=1e-2, default_cbs=False)
    handler = CallbackHandler(metrics=[AverageMetric(accuracy)])
    learn.fit(1, cbs=[handler])
    xv, yv = dls.valid.dataset.tensors
    with torch.no_grad(): expected = (learn.model(xv).argmax(-1) == yv).float().mean().item()
    expected_loss = nn.functional.cross_entropy(learn.model(xv), yv).item()
    valid_loss, acc = handler.state['last_metrics']
    assert math.isclose(acc, expected, rel_tol=1e-6) and math.isclose(valid_loss, expected_loss, rel_tol=1e-5)


def test_gradient_clipping_matches_clip_grad_norm_in_a_hand_written_loop():
    learn = tiny_learner()
    learn.fit(2, cbs=[CallbackHandler([V1GradientClipping(0.05)])])
    assert_same_weights(learn.model, hand_written_fit(2, clip=0.05))
    assert not torch.allclose(learn.model.weight, hand_written_fit(2).weight, atol=1e-4)
    with pytest.raises(ValueError, match='clip'): V1GradientClipping(-1.)


def test_a_batch_cancelled_before_its_loss_has_no_on_batch_end():
    from teachloop.learner import Callback, CancelBatchException
    class SkipFirstBatches(Callback):  # a teachloop callback, running before the handler
        order = 0
        def before_batch(self):
            if self.iter == 0: raise CancelBatchException()
    counter, log = CountSteps(), Log()
    learn = tiny_learner(dls=tiny_dls(valid_batches=2))
    learn.fit(2, cbs=[SkipFirstBatches(), CallbackHandler([counter, log])])
    ends = [s for e, s in log.calls if e == 'on_batch_end']
    assert [(s['train'], s['num_batch'], s['iteration']) for s in ends] == [(True, 1, 0), (False, 1, 1), (True, 1, 1), (False, 1, 2)]
    assert counter.steps_per_epoch == [1, 1] and counter.valid_batches == 2
    x, y = tiny_dls(valid_batches=2).valid[1]
    with torch.no_grad(): expected = nn.functional.mse_loss(learn.model(x), y).item()
    last_metrics = [s['last_metrics'] for e, s in log.calls if e == 'on_epoch_end'][-1]
    assert math.isclose(last_metrics[0], expected, rel_tol=1e-6)  # the valid loss of the batch that ran, only
