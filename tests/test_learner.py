"Event order, cancellations, callback semantics, errors and host-device syncs of the Learner."
import copy
from functools import partial
import textwrap
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from teachloop.callback.core import ProgressCallback, Recorder, accuracy
from teachloop.data import DataLoaders, digits_cnn, digits_dls, regression_2d
from teachloop.learner import (EVENTS, CancelBackwardException, CancelBatchException, CancelEpochException,
                               CancelFitException, CancelStepException, CancelTrainException, CancelValidException,
                               Callback, EventLog, Learner)
from teachloop.optim.core import SGD, Adam
from teachloop.testing import digits_learner, quiet, tiny_dls, tiny_learner

TRAIN_BATCH = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step',
               'after_step', 'after_batch']
VALID_BATCH = ['before_batch', 'after_pred', 'after_loss', 'after_batch']


def epoch_events(train_batches, valid_batches):
    return (['before_epoch', 'before_train'] + train_batches + ['after_train', 'before_validate'] + valid_batches
            + ['after_validate', 'after_epoch'])


def fit_events(epochs):
    return ['before_fit'] + sum(epochs, []) + ['after_fit', 'cleanup_fit']


class Raise(Callback):
    "Raise `exc` at `event` when the learner is in the given phase and batch."
    def __init__(self, event, exc, training=True, iter=0, epoch=0):
        self.exc, self.when = exc, (training, iter, epoch)
        setattr(self, event, self._maybe_raise)

    def _maybe_raise(self):
        if (self.learn.training, self.learn.iter, self.learn.epoch) == self.when: raise self.exc()


def run_logged(n_epoch=1, cbs=()):
    log = EventLog()
    learn = tiny_learner(log, *cbs)
    learn.fit(n_epoch)
    return log.events[1:]  # drop after_create


def test_full_event_sequence():
    events = run_logged(2)
    epoch = epoch_events(TRAIN_BATCH * 2, VALID_BATCH)
    assert events == fit_events([epoch, epoch])


def test_after_create_fires_once_at_construction():
    log = EventLog()
    tiny_learner(log)
    assert log.events == ['after_create']


def test_cancel_batch():
    events = run_logged(cbs=[Raise('after_pred', CancelBatchException)])
    cancelled = ['before_batch', 'after_pred', 'after_cancel_batch', 'after_batch']
    assert events == fit_events([epoch_events(cancelled + TRAIN_BATCH, VALID_BATCH)])


def test_cancel_backward_skips_backward_but_not_step():
    learn_events = run_logged(cbs=[Raise('before_backward', CancelBackwardException)])
    cancelled = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_cancel_backward',
                 'after_backward', 'before_step', 'after_step', 'after_batch']
    assert learn_events == fit_events([epoch_events(cancelled + TRAIN_BATCH, VALID_BATCH)])


def test_cancel_step():
    events = run_logged(cbs=[Raise('before_step', CancelStepException)])
    cancelled = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step',
                 'after_cancel_step', 'after_step', 'after_batch']
    assert events == fit_events([epoch_events(cancelled + TRAIN_BATCH, VALID_BATCH)])


@pytest.mark.parametrize('event, exc', [('before_backward', CancelBackwardException), ('before_step', CancelStepException)])
def test_cancelled_backward_or_step_leaves_weights_unchanged_and_zeroes_gradients(event, exc):
    stop_after_first = Raise('before_batch', CancelTrainException, iter=1)
    stop_after_first.name = 'stop_train'
    learn = tiny_learner(Raise(event, exc, iter=0), stop_after_first)
    before = copy.deepcopy(learn.model.state_dict())
    learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())
    assert all(p.grad is None for p in learn.model.parameters())


def test_cancel_train():
    events = run_logged(cbs=[Raise('after_batch', CancelTrainException, iter=0)])
    epoch = (['before_epoch', 'before_train'] + TRAIN_BATCH + ['after_cancel_train', 'after_train', 'before_validate']
             + VALID_BATCH + ['after_validate', 'after_epoch'])
    assert events == fit_events([epoch])


def test_cancel_validate():
    events = run_logged(cbs=[Raise('before_batch', CancelValidException, training=False)])
    epoch = (['before_epoch', 'before_train'] + TRAIN_BATCH * 2 + ['after_train', 'before_validate', 'before_batch',
             'after_cancel_validate', 'after_validate', 'after_epoch'])
    assert events == fit_events([epoch])


def test_cancel_epoch_goes_on_with_next_epoch():
    events = run_logged(2, cbs=[Raise('after_train', CancelEpochException, training=True, iter=1, epoch=0)])
    first = ['before_epoch', 'before_train'] + TRAIN_BATCH * 2 + ['after_train', 'after_cancel_epoch', 'after_epoch']
    assert events == fit_events([first, epoch_events(TRAIN_BATCH * 2, VALID_BATCH)])


def test_cancel_fit():
    events = run_logged(3, cbs=[Raise('after_epoch', CancelFitException, training=False, iter=0, epoch=0)])
    epoch = epoch_events(TRAIN_BATCH * 2, VALID_BATCH)
    assert events == ['before_fit'] + epoch + ['after_cancel_fit', 'after_fit', 'cleanup_fit']


def test_validation_runs_without_grad_and_in_eval_mode():
    seen = []
    class Probe(Callback):
        def after_pred(self): seen.append((self.training, self.model.training, torch.is_grad_enabled()))
    tiny_learner(Probe()).fit(1)
    assert seen == [(True, True, True), (True, True, True), (False, False, False)]


def test_order_is_a_stable_sort():
    calls = []
    def make(tag, order):
        cls = type(f'Cb{tag}', (Callback,), {'order': order, 'before_fit': lambda self: calls.append(tag)})
        return cls()
    learn = tiny_learner(make('a', 5), make('b', -1), make('c', 5), make('d', 0))
    learn.fit(1)
    assert calls == ['b', 'd', 'a', 'c']


class BatchTransform(Callback):
    "Changes the inputs of every batch with `transform`; both transforms below have the same (default) order."
    def before_batch(self): self.learn.xb = tuple(self.transform(x) for x in self.learn.xb)


class AddOne(BatchTransform):
    @staticmethod
    def transform(x): return x + 1


class Double(BatchTransform):
    @staticmethod
    def transform(x): return x * 2


class InputsSeen(nn.Module):
    "A linear model that keeps a copy of every input it is given."
    def __init__(self):
        super().__init__()
        self.linear, self.inputs = nn.Linear(2, 1), []
    def forward(self, x):
        self.inputs.append(x.clone())
        return self.linear(x)


@pytest.mark.parametrize('how', ['together', 'one after the other', 'the second to fit'])
@pytest.mark.parametrize('first, second', [(AddOne, Double), (Double, AddOne)], ids=['add, double', 'double, add'])
def test_callbacks_of_equal_order_change_the_batch_in_the_order_they_were_added(first, second, how):
    "Neither the callbacks' names nor their classes decide: the model sees the second transform of the first."
    dls, model, cbs = tiny_dls(1, valid=False), InputsSeen(), [first(), second()]
    learn = Learner(dls, model, F.mse_loss, default_cbs=False, cbs=cbs[:1] if how != 'together' else cbs)
    if how == 'one after the other': learn.add_cbs(cbs[1:])
    learn.fit(1, cbs=cbs[1:] if how == 'the second to fit' else None)
    (x, _), = dls.train
    assert len(model.inputs) == 1 and torch.equal(model.inputs[0], second.transform(first.transform(x)))


def test_run_train_and_run_valid_gate_batch_events_only():
    class TrainOnly(Callback):
        run_valid = False
        def __init__(self): self.batches, self.validates = 0, 0
        def after_batch(self): self.batches += 1
        def after_validate(self): self.validates += 1
    class ValidOnly(TrainOnly):
        run_train, run_valid = False, True
    t, v = TrainOnly(), ValidOnly()
    tiny_learner(t, v).fit(2)
    assert (t.batches, t.validates) == (4, 2) and (v.batches, v.validates) == (2, 2)


def test_event_tables_hold_only_implementers():
    class OnlyAfterBatch(Callback):
        def after_batch(self): pass
    cb = OnlyAfterBatch()
    learn = tiny_learner(cb)
    tables = learn._event_tables
    for table in tables:
        assert [h.__self__ for h in table['after_batch']][-1] is cb
        assert all(h.__self__ is not cb for e in EVENTS if e != 'after_batch' for h in table[e])


def test_reads_fall_through_and_callbacks_reachable_by_name():
    class Peek(Callback):
        def after_loss(self): self.seen = (self.loss, self.n_epoch, self.epoch, self.learn.loss_grad is self.loss_grad)
    learn = tiny_learner(Peek())
    learn.fit(1)
    assert learn.peek.seen[1:] == (1, 0, True)
    assert learn.train_eval.name == 'train_eval'
    with pytest.raises(AttributeError, match='no attribute or callback'): learn.not_there


def test_writing_a_learner_attribute_on_the_callback_warns():
    class Shadow(Callback):
        def before_fit(self): self.loss_grad = 1.
    with pytest.warns(UserWarning, match=r'self\.learn\.loss_grad'):
        tiny_learner(Shadow()).fit(1)


def test_misspelt_event_is_an_error_when_added():
    class Typo(Callback):
        def before_bach(self): pass
    with pytest.raises(ValueError, match='before_batch'):
        tiny_learner(Typo())
    class NearMiss(Callback):
        def afterbatch(self): pass
    with pytest.raises(ValueError, match='after_batch'):
        tiny_learner().add_cbs([NearMiss()])


def test_bad_callbacks_are_refused_before_anything_changes():
    learn = tiny_learner()
    n_cbs = len(learn.cbs)
    with pytest.raises(TypeError, match=r'pass `Recorder\(\)`'): learn.add_cbs([Recorder])
    rec = Recorder()
    with pytest.raises(ValueError, match='already'): learn.add_cbs([rec, rec])
    with pytest.raises(ValueError, match="named 'recorder'"): learn.add_cbs([Recorder(), Recorder()])
    learn.add_cbs([rec])
    with pytest.raises(ValueError, match="named 'recorder'"): learn.add_cbs([Recorder()])
    assert len(learn.cbs) == n_cbs + 1


def test_fit_cbs_are_removed_afterwards_even_on_error():
    class Boom(Callback):
        def after_loss(self): raise RuntimeError('boom')
    learn = tiny_learner()
    before = list(learn.cbs)
    with pytest.raises(RuntimeError): learn.fit(1, cbs=[Boom()])
    assert learn.cbs == before


def test_error_in_callback_names_callback_and_event_and_learner_stays_usable():
    class Boom(Callback):
        def before_step(self):
            if self.iter == 1: raise RuntimeError('boom')
    learn = Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=0.1)
    with pytest.raises(RuntimeError) as info: learn.fit(1, cbs=[Boom()])
    assert any('Boom.before_step' in n for n in info.value.__notes__)
    assert learn.progress.bar is None  # closed by cleanup_fit
    assert len(learn.recorder.losses) == 1  # the finished first batch is in the history
    assert not learn.model.training
    learn.fit(1)
    assert len(learn.recorder.losses) == 2


def test_keyboard_interrupt_propagates_after_cleanup_and_keeps_history():
    class Interrupt(Callback):
        def after_batch(self):
            if self.training and self.iter == 1: raise KeyboardInterrupt()
    learn = Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=0.1)
    log = EventLog(); learn.add_cbs([log])
    with pytest.raises(KeyboardInterrupt): learn.fit(2, cbs=[Interrupt()])
    assert log.events[-1] == 'cleanup_fit' and 'after_fit' not in log.events
    assert learn.progress.bar is None
    weights = copy.deepcopy(learn.model.state_dict())
    learn.fit(1)
    assert not torch.equal(weights['weight'], learn.model.weight)


def test_bad_inputs_give_clear_errors():
    x, y = regression_2d(n=16)
    with pytest.raises(TypeError, match=r'DataLoaders\(train_dl, valid_dl\)'):
        Learner([(x, y)], nn.Linear(2, 1), F.mse_loss)
    with pytest.raises(TypeError, match='loss_func must be callable'):
        Learner(tiny_dls(), nn.Linear(2, 1), 'mse')
    with pytest.raises(TypeError, match='torch.nn.Module'):
        Learner(tiny_dls(), lambda x: x, F.mse_loss)
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:0], y[:0]), batch_size=4)
    learn = Learner(DataLoaders(empty, empty), nn.Linear(2, 1), F.mse_loss, default_cbs=False)
    with pytest.raises(ValueError, match='no batches'): learn.fit(1)
    with pytest.raises(ValueError, match='n_epoch'): tiny_learner().fit(0)
    with pytest.raises(TypeError, match=r"each metric must be a function f\(pred, target\), got 'mse'"):
        Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, metrics=[F.l1_loss, 'mse'])


def test_an_optimizer_torch_made_put_into_learn_opt_is_refused_before_the_fit_naming_its_class():
    "Before: an AttributeError from inside the fit (`'SGD' object has no attribute 'set_hyper'`)."
    learn = tiny_learner()
    learn.opt = torch.optim.SGD(learn.model.parameters(), lr=0.1)
    before = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(TypeError, match=r"learn.opt is a torch.optim.SGD as torch made it.*"
                                        r"`learn.opt_func = torch.optim.SGD`"):
        learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())
    learn.opt_func, learn.opt = torch.optim.SGD, None
    learn.fit(1)  # as the message says: the learner makes it and wraps it
    assert not all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())


def test_a_callback_ordered_before_the_others_already_sees_the_model_in_the_phases_mode():
    "TrainEvalCallback (order -10) switches the mode first: a callback of order -5 finds it done, every epoch."
    class Modes(Callback):
        order = -5
        def __init__(self): self.seen = []
        def before_train(self): self.seen.append(('train', self.model.training))
        def before_validate(self): self.seen.append(('valid', self.model.training))
    modes = Modes()
    tiny_learner(modes, default_cbs=True).fit(2)
    assert modes.seen == [('train', True), ('valid', False)] * 2


class Doubled(nn.Module):
    "A model whose output has twice the rows of its input: a bug of the kind that broadcasting could hide."
    def __init__(self): super().__init__(); self.lin = nn.Linear(2, 1)
    def forward(self, x): return self.lin(torch.cat([x, x]))


def test_an_output_with_more_rows_than_the_target_is_refused_naming_both_shapes():
    learn = Learner(tiny_dls(), Doubled(), F.mse_loss, opt_func=SGD, lr=0.1, default_cbs=False)
    with pytest.raises(ValueError, match=r"output has shape \(16, 1\) but the target has shape \(8, 1\)"): learn.fit(1)


def test_a_callback_not_attached_yet_has_no_learner_attributes_and_says_why():
    "`hasattr` is False (no other error), and reading one says that the callback is not attached to a Learner yet."
    class Reads(Callback): pass
    cb = Reads()
    assert not hasattr(cb, 'epoch')
    with pytest.raises(AttributeError, match=r"Reads has no attribute 'epoch' \(it is not attached to a Learner yet\)"):
        cb.epoch


def test_shape_mismatch_names_shapes_and_changes_nothing():
    learn = Learner(tiny_dls(), nn.Linear(2, 3), F.mse_loss, opt_func=SGD, lr=0.1, default_cbs=False)
    before = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(ValueError, match=r'\(8, 3\).*\(8, 1\)'):
        learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())
    x, y = regression_2d(n=16)
    batch_mismatch = DataLoaders([(x[:8], y[:4])], None)
    with pytest.raises(ValueError, match=r'\(8, 1\).*\(4, 1\)'):
        Learner(batch_mismatch, nn.Linear(2, 1), F.mse_loss, default_cbs=False).fit(1)


def test_learner_matches_hand_written_loop():
    torch.manual_seed(1)
    dls = digits_dls(bs=64, seed=3)
    model = digits_cnn()
    reference = copy.deepcopy(model)
    learn = Learner(dls, model, F.cross_entropy, opt_func=SGD, lr=0.05, metrics=[accuracy],
                    cbs=[], default_cbs=True)
    learn.progress.show_bar = learn.progress.print_rows = False
    learn.fit(2)
    opt = SGD(reference.parameters(), lr=0.05)
    dls2 = digits_dls(bs=64, seed=3)
    losses = []
    for _ in range(2):
        reference.train()
        for xb, yb in dls2.train:
            loss = F.cross_entropy(reference(xb), yb)
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
    assert learn.recorder.losses == pytest.approx(losses, abs=0)
    for a, b in zip(learn.model.parameters(), reference.parameters()): assert torch.equal(a, b)
    reference.eval()
    with torch.no_grad():
        xs, ys = map(torch.cat, zip(*dls2.valid))
        out = reference(xs)
    valid_loss, acc = learn.recorder.values[-1][2:4]
    assert valid_loss == pytest.approx(F.cross_entropy(out, ys).item(), rel=1e-5)
    assert acc == pytest.approx(accuracy(out, ys).item(), rel=1e-6)


def test_no_host_device_sync_inside_the_batch_loop(monkeypatch):
    "Reading a tensor's value in a batch event would stall a GPU: count such reads between before_batch and after_batch."
    state = {'in_batch': False, 'reads': []}
    class Window(Callback):
        order = -100
        def before_batch(self): state['in_batch'] = True
    class WindowEnd(Callback):
        order = 100
        def after_batch(self): state['in_batch'] = False
    def spy(name):
        original = getattr(torch.Tensor, name)
        def wrapper(self, *args, **kwargs):
            if state['in_batch']: state['reads'].append(name)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, wrapper)
    learn = Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, lr=1e-3, metrics=[accuracy],
                    cbs=[Window(), WindowEnd()])
    for name in ('item', 'tolist', 'cpu', 'numpy', '__bool__', '__float__', '__int__'): spy(name)
    learn.fit(1)
    assert state['reads'] == []
    assert len(learn.recorder.values) == 1


def test_save_and_load_round_trip_and_refuse_other_model(tmp_path):
    learn = tiny_learner()
    learn.fit(1)
    path = learn.save(tmp_path / 'model.pt')
    other = tiny_learner()
    other.load(path)
    assert torch.equal(other.model.weight, learn.model.weight)
    wrong = Learner(tiny_dls(), nn.Linear(2, 2), F.mse_loss, default_cbs=False)
    before = copy.deepcopy(wrong.model.state_dict())
    with pytest.raises(ValueError, match='do not fit this model'): wrong.load(path)
    assert torch.equal(before['weight'], wrong.model.weight)
    (tmp_path / 'broken.pt').write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match='could not read'): wrong.load(tmp_path / 'broken.pt')
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith('.tmp')] == []


def test_get_preds_and_validate_agree():
    torch.manual_seed(0)
    learn = Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, lr=3e-3, metrics=[accuracy],
                    cbs=[ProgressCallback(show_bar=False, print_rows=False)], default_cbs=False)
    from teachloop.callback.core import DeviceCallback
    learn.add_cbs([Recorder(), DeviceCallback()])
    learn.fit(1)
    preds, targets = learn.get_preds(act=lambda out: out)  # the model's outputs, as the loss saw them
    loss, acc = learn.validate()
    assert preds.shape == (len(learn.dls.valid.dataset), 10) and acc == pytest.approx(accuracy(preds, targets).item(), rel=1e-6)
    assert loss == pytest.approx(F.cross_entropy(preds, targets).item(), rel=1e-5)
    probs, _ = learn.get_preds()  # the default: cross_entropy's softmax
    assert torch.equal(probs, preds.softmax(1))
    decoded, item_probs = learn.predict(learn.dls.valid.dataset[0][0])
    # one item alone and in a batch of 64 round differently in float32 (eps 1.2e-7): a few ulps of a probability <= 1
    assert item_probs.shape == (10,) and torch.allclose(item_probs, probs[0], atol=1e-6) and decoded == probs[0].argmax()


def test_error_in_a_plain_function_handler_keeps_its_type():
    def explode(): raise RuntimeError('from a plain function')
    cb = EventLog(events=())
    cb.after_loss = explode
    with pytest.raises(RuntimeError, match='from a plain function') as info: tiny_learner(cb).fit(1)
    assert any('explode.after_loss' in n for n in info.value.__notes__)


def test_cbs_may_be_a_single_callback():
    log = EventLog()
    learn = tiny_learner()
    learn.fit(1, cbs=log)
    assert log.events[0] == 'before_fit' and log not in learn.cbs


@pytest.mark.parametrize('event, exc', [('before_epoch', CancelEpochException), ('before_train', CancelTrainException),
                                        ('before_validate', CancelValidException)])
def test_recorder_rows_of_a_phase_cancelled_before_the_recorder_heard_it(event, exc):
    "A callback ordered before the Recorder cancels a phase in epoch 1: the row says nan, never the previous epoch's value."
    class CancelInSecondEpoch(Callback):
        def __init__(self): setattr(self, event, self.cancel)
        def cancel(self):
            if self.epoch == 1: raise exc()
    learn = quiet(Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=0.1,
                          cbs=[CancelInSecondEpoch()]))
    learn.fit(3)
    rows = learn.recorder.values
    assert [r[0] for r in rows] == [0, 1, 2] and all(r[1] == r[1] and r[2] == r[2] for r in (rows[0], rows[2]))
    skipped_train, skipped_valid = event != 'before_validate', event != 'before_train'
    assert (rows[1][1] != rows[1][1]) == skipped_train and (rows[1][2] != rows[1][2]) == skipped_valid
    assert len(learn.recorder.losses) == 2 * (2 if skipped_train else 3)


def test_mixed_precision_float16_skips_a_step_with_inf_gradients_and_lowers_the_scale():
    "The GradScaler path, on the CPU: forward in float16, an inf gradient at step 2 skips exactly that step."
    from teachloop.callback.core import MixedPrecision
    class InfGradientAt(Callback):
        order = 5  # before MixedPrecision (10) unscales and checks
        def after_backward(self):
            if self.train_iter == 2: next(self.model.parameters()).grad.view(-1)[0] = float('inf')
    class Watch(Callback):
        order = 90
        def before_fit(self): self.weights, self.dtypes = [], set()
        def after_pred(self): self.dtypes.add(self.pred.dtype)
        def after_batch(self):
            if self.training: self.weights.append(next(self.model.parameters()).detach().clone())
    learn = digits_learner(MixedPrecision(torch.float16), InfGradientAt(), Watch(), opt_func=SGD, lr=0.05)
    learn.fit(1)
    w = learn.watch.weights
    assert learn.watch.dtypes == {torch.float16} and all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert [torch.equal(w[i], w[i + 1]) for i in range(4)] == [False, True, False, False]
    assert learn.mixed_precision.scaler.get_scale() == 2. ** 15  # halved once from its initial 2 ** 16
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())
    default = Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, cbs=[MixedPrecision()], default_cbs=False)
    default.fit(1)
    assert default.mixed_precision.dtype == torch.bfloat16 and default.mixed_precision.scaler is None


@pytest.mark.parametrize('event, exc', [('before_backward', CancelBackwardException), ('after_backward', CancelBatchException)])
def test_mixed_precision_float16_survives_a_cancelled_backward_or_batch(event, exc):
    "A batch cancelled around its backward leaves the scaler consistent: the fit goes on and the next steps train."
    from teachloop.callback.core import MixedPrecision
    cancel = Raise(event, exc, iter=1)
    cancel.order = 20  # after MixedPrecision (10) has unscaled, for the after_backward case
    learn = digits_learner(MixedPrecision(torch.float16), cancel, opt_func=SGD, lr=0.05, default_cbs=False)
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.fit(1)
    after = list(learn.model.parameters())
    assert not any(torch.equal(a, b) for a, b in zip(before, after)) and all(torch.isfinite(p).all() for p in after)
    assert learn.mixed_precision.scaler.get_scale() == 2. ** 16  # no inf seen: the scale never dropped


@pytest.mark.parametrize('event', ['before_batch', 'after_pred'])
def test_batch_cancelled_before_its_loss_is_not_recorded(event):
    "The Recorder records exactly the batches that produced a loss, never a stale one."
    class TrainLosses(Callback):
        order = 40
        def before_fit(self): self.seen = []
        def after_loss(self):
            if self.training: self.seen.append(self.loss.item())
    learn = Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, opt_func=SGD, lr=0.1, default_cbs=False,
                    cbs=[Recorder(), TrainLosses(), Raise(event, CancelBatchException, iter=1, epoch=0)])
    learn.fit(2)
    assert learn.recorder.losses == learn.train_losses.seen and len(learn.recorder.losses) == 3
    assert learn.recorder.values[0][1] == pytest.approx(learn.train_losses.seen[0])  # epoch 0: only its first batch


def test_a_callback_named_like_a_learner_attribute_is_refused():
    class Model(Callback): pass
    learn = tiny_learner()
    with pytest.raises(ValueError, match="learn.model"): learn.add_cbs([Model()])
    renamed = Model()
    renamed.name = 'model_watcher'
    learn.add_cbs([renamed])
    assert learn.model_watcher is renamed and isinstance(learn.model, nn.Module)


@pytest.mark.parametrize('event', ['after_backward', 'before_step'])
def test_a_batch_cancelled_after_backward_leaves_no_gradient(event):
    "The next step uses its own batch's gradient only, as a hand-written loop that skips the first batch's step does."
    class CancelFirst(Callback):
        def __init__(self): self.done = False
        def cancel(self):
            if not self.done and self.training: self.done = True; raise CancelBatchException()
    cancel = CancelFirst()
    setattr(cancel, event, cancel.cancel)
    learn = tiny_learner(cancel)
    start = copy.deepcopy(learn.model)
    learn.fit(1)
    reference = copy.deepcopy(start)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (xb, yb), = learn.dls.train[1:]
    F.mse_loss(reference(xb), yb).backward(); opt.step()
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), reference.parameters()))
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())


def test_calls_from_another_thread_during_a_background_fit_are_refused():
    import threading
    started, release = threading.Event(), threading.Event()
    class Hold(Callback):
        def before_batch(self):
            started.set()
            release.wait(10)
    learn = tiny_learner()
    steps = []
    class Count(Callback):
        def after_step(self): steps.append(self.train_iter)
    worker = threading.Thread(target=lambda: learn.fit(2, cbs=[Hold(), Count()]))
    learn.reserve_for(worker)
    worker.start()
    try:
        assert started.wait(10)
        from teachloop.callback.schedule import lr_find, fit_one_cycle  # noqa: F401  (add the Learner methods)
        opt, cbs = learn.opt, list(learn.cbs)
        for call in (lambda: learn.validate(), lambda: learn.get_preds(), lambda: learn.fit(1),
                     lambda: learn.predict(torch.zeros(1, 2)), lambda: learn.load('nowhere.pt'),
                     lambda: learn.lr_find(num_it=2, show_plot=False), lambda: learn.fit_one_cycle(1),
                     lambda: learn.create_opt(), lambda: learn.add_cbs([EventLog()]),
                     lambda: learn.remove_cbs(learn.cbs[-1:])):
            with pytest.raises(RuntimeError, match='another thread.*handle.wait'): call()
        assert learn.training and learn.model.training  # the running fit's state was not touched
        assert learn.opt is opt and learn.cbs == cbs
    finally:
        release.set()
        worker.join(10)
        learn.release(worker)
    assert len(steps) == 4  # every step of the background fit was taken
    learn.get_preds()  # and once it is over the learner is free again


def test_hypers_no_callback_reads_cannot_be_scheduled():
    from teachloop.callback.schedule import ParamScheduler, fit_one_cycle  # noqa: F401  (adds Learner.fit_one_cycle)
    learn = tiny_learner()  # SGD without momentum: `mom` is a hyper-parameter no callback reads
    with pytest.raises(ValueError, match="no callback of the optimizer reads 'mom'"):
        learn.fit(1, cbs=[ParamScheduler({'mom': lambda pct: 0.9})])
    learn = tiny_learner(Recorder())
    learn.fit_one_cycle(1, 0.1)
    assert 'mom' not in learn.recorder.hps and len(learn.recorder.hps['lr']) == 2  # neither scheduled nor recorded


def test_optimizer_state_left_on_another_device_is_reloaded_where_torch_puts_it(monkeypatch):
    "On the CPU only the decision can be checked (the move itself is the cuda test below): reload exactly when behind."
    from teachloop.callback.core import state_to_params_devices
    model = nn.Linear(2, 1)
    for opt in (SGD(model.parameters(), lr=0.1, mom=0.9), torch.optim.Adam(model.parameters())):
        model(torch.ones(1, 2)).sum().backward(); opt.step()
        reloads = []
        monkeypatch.setattr(opt, 'load_state_dict', lambda state: reloads.append(state))
        state_to_params_devices(opt)
        assert reloads == []  # state and parameters together: nothing to do
        p = next(iter(opt.state))
        for key, value in opt.state[p].items():
            if torch.is_tensor(value) and value.dim(): opt.state[p][key] = value.to('meta')
        state_to_params_devices(opt)
        assert len(reloads) == 1 and reloads[0]['state']


@pytest.mark.cuda
def test_a_learner_loaded_before_its_first_fit_trains_on_the_gpu(tmp_path):
    from teachloop.callback.core import DeviceCallback
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, default_cbs=False, cbs=[DeviceCallback('cuda')])
    learn.fit(1)
    learn.save(tmp_path / 'l.pt')
    again = Learner(digits_dls(), digits_cnn(), F.cross_entropy, default_cbs=False, cbs=[DeviceCallback('cuda')])
    again.load(tmp_path / 'l.pt')
    again.fit(1)
    assert all(v.is_cuda for s in again.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())


@pytest.mark.parametrize('sync_free', [False, True])
def test_mixed_precision_float16_resumes_with_its_loss_scale(tmp_path, sync_free):
    "A resumed float16 fit goes on with the saved scale and count of skipped steps: the same steps as an uninterrupted fit."
    import teachloop.callback.checkpoint  # noqa: F401  (adds Learner.save_checkpoint)
    from teachloop.callback.core import MixedPrecision
    class OverflowAboveScale(Callback):  # as a loss scale too large for the gradients does
        order = 5  # before MixedPrecision unscales the gradients
        def after_backward(self):
            if self.mixed_precision.scaler.get_scale() > 2. ** 15: next(self.model.parameters()).grad.view(-1)[0] = float('inf')
    def learner():
        return digits_learner(MixedPrecision(torch.float16, sync_free=sync_free), OverflowAboveScale(), lr=1e-3,
                              default_cbs=False)
    whole = learner()
    whole.fit(2)
    assert whole.mixed_precision.skipped == 1 and whole.mixed_precision.scaler.get_scale() == 2. ** 15
    class SaveAndStop(Callback):
        order = 100
        def after_epoch(self):
            self.learn.save_checkpoint(tmp_path / 'ck.pt')
            raise CancelFitException()
    learner().fit(2, cbs=[SaveAndStop()])
    resumed = learner()
    resumed.fit(2, resume=tmp_path / 'ck.pt')
    assert resumed.mixed_precision.skipped == 1 and resumed.mixed_precision.scaler.get_scale() == 2. ** 15
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).double()


@pytest.mark.float32
@pytest.mark.numeric
def test_wd_bn_bias_false_decays_only_the_other_weights():
    learn = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss, opt_func=partial(SGD, decouple_wd=False), lr=0.1,
                    wd=0.2, default_cbs=False, wd_bn_bias=False)
    learn.fit(2)
    model = bn_model()
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[3].bias]
    decay = [model[0].weight, model[3].weight]
    opt = torch.optim.SGD([{'params': decay, 'weight_decay': 0.2}, {'params': no_decay, 'weight_decay': 0.}], lr=0.1)
    for _ in range(2):
        model.train()
        for xb, yb in tiny_dls(dtype=torch.float64).train:
            F.mse_loss(model(xb), yb).backward(); opt.step(); opt.zero_grad()
    assert all((a - b).abs().max() <= 1e-12 for a, b in zip(learn.model.parameters(), model.parameters()))
    decayed_everywhere = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss,
                                 opt_func=partial(SGD, decouple_wd=False), lr=0.1, wd=0.2, default_cbs=False)
    decayed_everywhere.fit(2)
    assert (decayed_everywhere.model[1].weight - learn.model[1].weight).abs().max() > 1e-4


@pytest.mark.float32
@pytest.mark.numeric
@pytest.mark.parametrize('fast', [False, True])
def test_wd_bn_bias_false_with_adam_matches_torch_adamw_with_a_group_without_decay(fast):
    "Decoupled decay, on both of the optimizer's paths: the per-parameter callbacks and the multi-tensor fast path."
    learn = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss, opt_func=partial(Adam, fast=fast), lr=1e-2,
                    wd=0.1, default_cbs=False, wd_bn_bias=False)
    learn.fit(2)
    model = bn_model()
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[3].bias]
    opt = torch.optim.AdamW([{'params': [model[0].weight, model[3].weight], 'weight_decay': 0.1},
                             {'params': no_decay, 'weight_decay': 0.}], lr=1e-2, betas=(0.9, 0.99), eps=1e-5)
    for _ in range(2):
        model.train()
        for xb, yb in tiny_dls(dtype=torch.float64).train:
            F.mse_loss(model(xb), yb).backward(); opt.step(); opt.zero_grad()
    assert all((a - b).abs().max() <= 1e-10 for a, b in zip(learn.model.parameters(), model.parameters()))


@pytest.mark.float32
@pytest.mark.numeric
def test_wd_bn_bias_false_holds_for_an_optimizer_state_loaded_from_a_learner_that_decayed_everything(tmp_path):
    sgd = partial(SGD, decouple_wd=False)
    everything = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss, opt_func=sgd, lr=0.1, wd=0.2,
                         default_cbs=False)
    everything.fit(1)
    everything.save(tmp_path / 'all.pt')
    learn = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss, opt_func=sgd, lr=0.1, wd=0.2,
                    default_cbs=False, wd_bn_bias=False)
    learn.load(tmp_path / 'all.pt')
    learn.fit(1)
    model = copy.deepcopy(everything.model)
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[3].bias]
    opt = torch.optim.SGD([{'params': [model[0].weight, model[3].weight], 'weight_decay': 0.2},
                           {'params': no_decay, 'weight_decay': 0.}], lr=0.1)
    model.train()
    for xb, yb in tiny_dls(dtype=torch.float64).train:
        F.mse_loss(model(xb), yb).backward(); opt.step(); opt.zero_grad()
    assert all((a - b).abs().max() <= 1e-12 for a, b in zip(learn.model.parameters(), model.parameters()))


def test_wd_bn_bias_false_with_a_torch_optimizer_is_refused_before_training():
    from teachloop.optim.interop import OptimWrapper
    learn = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss,
                    opt_func=partial(OptimWrapper, opt=torch.optim.AdamW), default_cbs=False, wd_bn_bias=False)
    before = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(ValueError, match='wd_bn_bias=False.*group of their own'): learn.fit(1)
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize('train_bn', [True, False])
def test_train_bn_keeps_normalisation_layers_training_when_frozen(train_bn):
    from teachloop.optim.interop import freeze, unfreeze
    learn = Learner(tiny_dls(dtype=torch.float64), bn_model(), F.mse_loss, default_cbs=False, train_bn=train_bn,
                    splitter=lambda m: [list(m[:3].parameters()), list(m[3].parameters())])
    freeze(learn)
    model = learn.model
    assert not model[0].weight.requires_grad and model[3].weight.requires_grad
    assert model[1].weight.requires_grad == model[1].bias.requires_grad == train_bn
    unfreeze(learn)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize('opt_func', [Adam, partial(SGD, mom=0.9)])
def test_mixed_precision_takes_a_bad_step_back_without_waiting_exactly_as_skipping_it(opt_func):
    "sync_free (CUDA's default) steps, then takes the step back on the device and fixes step counts a step later."
    from teachloop.callback.core import MixedPrecision
    class InfGradientAt(Callback):
        order = 5
        def after_backward(self):
            if self.train_iter in (0, 2, 3): next(self.model.parameters()).grad.view(-1)[0] = float('inf')
    def fit(sync_free):
        learn = digits_learner(MixedPrecision(torch.float16, sync_free=sync_free), InfGradientAt(), opt_func=opt_func,
                               lr=3e-3, default_cbs=False)
        learn.fit(1)
        return learn
    waiting, deferred = fit(False), fit(True)
    assert waiting.mixed_precision.skipped == deferred.mixed_precision.skipped == 3
    assert all(torch.equal(a, b) for a, b in zip(waiting.model.parameters(), deferred.model.parameters()))
    sa, sb = waiting.opt.state_dict()['state'], deferred.opt.state_dict()['state']
    assert sa.keys() == sb.keys() and all(
        torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])) for k in sa for n in sa[k])
    assert waiting.mixed_precision.scaler.get_scale() == deferred.mixed_precision.scaler.get_scale() == 2. ** 13
    with pytest.raises(ValueError, match='sync_free'): MixedPrecision(sync_free='yes')


@pytest.mark.parametrize('event, exc', [('after_backward', CancelBackwardException), ('after_step', CancelStepException),
                                        ('after_cancel_step', CancelStepException), ('after_batch', CancelBatchException),
                                        ('after_train', CancelTrainException), ('after_epoch', CancelEpochException)])
def test_a_cancel_raised_after_its_part_is_an_error_naming_the_event(event, exc):
    "The part is over, so there is nothing to cancel: not a bare exception that silently ends the fit."
    cbs = [Raise(event, exc, training=event != 'after_epoch', iter=0 if event == 'after_epoch' else 1)]
    if event == 'after_cancel_step':
        cbs.append(Raise('before_step', CancelStepException, iter=1))
        cbs[-1].name = 'cancel_the_step'
    learn = tiny_learner(*cbs)
    with pytest.raises(RuntimeError, match=f"{exc.__name__} raised in `{event}`.*already over"): learn.fit(1)
    assert not learn.model.training and all(p.grad is None or not p.grad.any() for p in learn.model.parameters())


def test_a_background_fit_takes_every_step_whatever_the_main_thread_calls():
    "Reported: validate/get_preds/fit during a background fit flipped its state and 19-24 of 40 steps were taken."
    import threading
    from teachloop.dashboard.live import fit_background
    from teachloop.callback.schedule import fit_one_cycle, lr_find  # noqa: F401  (add the Learner methods)
    def learner(): return tiny_learner(Recorder(), dls=tiny_dls(20, bs=4, valid_bs=20), lr=0.01)
    reference = learner()
    reference.fit(2)
    started, release = threading.Event(), threading.Event()
    class HoldAtBatch(Callback):
        def before_batch(self):
            if self.training and self.train_iter == 7:
                started.set()
                release.wait(10)
    learn = learner()
    handle = fit_background(learn, 2, cbs=[HoldAtBatch()])
    try:
        assert started.wait(10)
        for call in (learn.validate, learn.get_preds, lambda: learn.fit(1), lambda: learn.fit_one_cycle(1),
                     lambda: learn.lr_find(num_it=5, show_plot=False)):
            with pytest.raises(RuntimeError, match=r'another thread.*handle\.wait\(\)'): call()
    finally: release.set()
    handle.wait(timeout=60)
    assert learn.train_iter == 40 and len(learn.recorder.losses) == 40
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), reference.model.parameters()))
    learn.validate()  # the learner is free again once the fit is over


class GradsAtBatchEnd(Callback):
    "The gradients each training batch ends with (None where there are none)."
    order, run_valid = 100, False
    def before_fit(self): self.grads = []
    def after_batch(self):
        self.grads.append([None if p.grad is None else p.grad.clone() for p in self.learn.model.parameters()])


def sgd_by_hand(model, batches, lr=0.1, n_acc=16):
    "One SGD step of `model` on the mean gradient of `batches` (their losses weighted by size over `n_acc`), in place."
    seen = sum(len(yb) for _, yb in batches)
    for xb, yb in batches: (F.mse_loss(model(xb), yb) * (len(yb) / n_acc)).backward()
    with torch.no_grad():
        for p in model.parameters(): p.add_(p.grad * (n_acc / seen), alpha=-lr)


@pytest.mark.parametrize('cancelled', [None, 0, 1], ids=['whole', 'first batch cancelled', 'last batch cancelled'])
def test_a_step_of_two_batches_is_one_transaction(cancelled):
    "Two batches of 8 make one step of 16: a batch cancelled after its backward takes its own gradients with it, the"
    " step's last batch cancelled takes the whole step; every batch ends with no gradient in `.grad`."
    from teachloop.callback.core import GradientAccumulation
    ends = GradsAtBatchEnd()
    cancel = [] if cancelled is None else [Raise('after_backward', CancelBatchException, iter=cancelled)]
    learn = tiny_learner(GradientAccumulation(16), ends, *cancel, dls=tiny_dls(2, dtype=torch.float64))
    learn.model.double()  # float64: the step's sum and the hand-written one round alike only where they agree exactly
    by_hand = copy.deepcopy(learn.model)
    learn.fit(1)
    batches = list(learn.dls.train)
    if cancelled is None: sgd_by_hand(by_hand, batches)
    elif cancelled == 0: sgd_by_hand(by_hand, batches[1:])  # the step of the second batch alone, as its own mean
    # a cancelled last batch drops the step: the weights stay where they were
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), by_hand.parameters()))
    assert all(g is None for grads in ends.grads for g in grads) and learn.step.kept is None


# Predictions: `get_preds` and `predict` as fastai's, for outputs, inputs and targets of any shape

def float64_data(n=24, n_in=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=generator, dtype=torch.float64)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def loaders(*tensors, bs=8):
    "DataLoaders of `tensors` in order (no shuffling), the same data for training and validation."
    from torch.utils.data import DataLoader, TensorDataset
    make = lambda: DataLoader(TensorDataset(*tensors), batch_size=bs)
    return DataLoaders(make(), make())


def outputs_by_hand(model, *inputs):
    model.eval()
    with torch.no_grad(): return model(*inputs)


LIBRARY_LOSSES = [  # (loss, targets from class labels, activation by hand, decoding by hand)
    (F.cross_entropy, lambda y: y, lambda out: out.softmax(1), lambda p: p.argmax(1)),
    (nn.CrossEntropyLoss(), lambda y: y, lambda out: out.softmax(1), lambda p: p.argmax(1)),
    (partial(F.cross_entropy, label_smoothing=0.1), lambda y: y, lambda out: out.softmax(1), lambda p: p.argmax(1)),
    (F.binary_cross_entropy_with_logits, lambda y: F.one_hot(y, 2).double(), torch.sigmoid, lambda p: p > 0.5),
    (nn.BCEWithLogitsLoss(), lambda y: F.one_hot(y, 2).double(), torch.sigmoid, lambda p: p > 0.5),
    (lambda out, y: F.mse_loss(out, F.one_hot(y, 2).double()), lambda y: y, lambda out: out, lambda p: p)]


@pytest.mark.parametrize('loss_func, targets_of, activation, decoding', LIBRARY_LOSSES,
                         ids=['cross_entropy', 'CrossEntropyLoss', 'partial', 'bce_with_logits', 'BCEWithLogitsLoss', 'other'])
def test_get_preds_gives_the_losses_probabilities_and_decodes_them(loss_func, targets_of, activation, decoding):
    x, labels = float64_data()
    y = targets_of(labels)
    learn = Learner(loaders(x, y), nn.Linear(3, 2).double(), loss_func, opt_func=SGD, lr=0.1, default_cbs=False)
    learn.fit(2)
    out = outputs_by_hand(learn.model, x)
    inputs, preds, targets, decoded = learn.get_preds(with_input=True, with_decoded=True)
    assert torch.equal(inputs, x) and torch.equal(targets, y)
    assert torch.allclose(preds, activation(out), rtol=0, atol=1e-15) and torch.equal(decoded, decoding(preds))
    raw, _ = learn.get_preds(act=lambda out: out)
    assert torch.equal(raw, out)


def test_a_loss_whose_activation_is_unknown_gives_raw_outputs_with_a_warning_and_a_regressions_without():
    x, labels = float64_data()
    for loss_func, y, warns in ((lambda out, y: F.cross_entropy(out, y), labels, True), (F.mse_loss, x[:, :2], False),
                                (nn.L1Loss(), x[:, :2], False), (partial(F.huber_loss, delta=0.5), x[:, :2], False)):
        learn = Learner(loaders(x, y), nn.Linear(3, 2).double(), loss_func, opt_func=SGD, lr=0.1, default_cbs=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            preds, _ = learn.get_preds()
        said = [str(w.message) for w in caught if 'activation' in str(w.message)]
        assert torch.equal(preds, outputs_by_hand(learn.model, x))  # the outputs as they are, in every case
        assert len(said) == warns and (not warns or ('act=' in said[0] and '<lambda>' in said[0]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            learn.get_preds(act=lambda out: out)  # chosen: nothing to say
        assert not [w for w in caught if 'activation' in str(w.message)]


def test_cross_entropys_classes_are_in_dimension_1_as_torch_takes_them():
    "A sequence model's output (batch, classes, length): the probabilities are those whose log the loss averages."
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (8, 5))
    model = nn.Conv1d(3, 4, 1).double()
    learn = Learner(loaders(x, y, bs=4), model, F.cross_entropy, opt_func=SGD, lr=0.1, default_cbs=False)
    probs, targets, classes = learn.get_preds(with_decoded=True)
    assert probs.shape == (8, 4, 5) and torch.allclose(probs.sum(1), torch.ones(8, 5, dtype=torch.float64))
    assert F.nll_loss(probs.log(), targets).item() == pytest.approx(F.cross_entropy(outputs_by_hand(model, x), y).item(), rel=1e-12)
    assert torch.equal(classes, probs.argmax(1))


def test_a_loss_with_fastais_activation_and_decodes_is_read_as_fastai_reads_it():
    class HalfLoss:
        def __call__(self, out, y): return F.mse_loss(out, y)
        def activation(self, out): return out / 2
        def decodes(self, probs): return probs.round()
    x = torch.randn(8, 2, dtype=torch.float64)
    learn = Learner(loaders(x, x.sum(1, keepdim=True)), nn.Linear(2, 1).double(), HalfLoss(), opt_func=SGD, default_cbs=False)
    preds, _, decoded = learn.get_preds(with_decoded=True)
    assert torch.equal(preds, outputs_by_hand(learn.model, x) / 2) and torch.equal(decoded, preds.round())


class TupleAndDict(nn.Module):
    "Outputs nested as a user's model may give them: a tuple holding a tensor and a dict."
    def __init__(self):
        super().__init__()
        self.scores, self.value = nn.Linear(3, 2), nn.Linear(3, 1)
    def forward(self, x): return self.scores(x), {'value': self.value(x)[:, 0], 'both': (x[:, :1], x[:, 1:])}


def nested_loss(out, label, value): return F.cross_entropy(out[0], label) + F.mse_loss(out[1]['value'], value)


def test_nested_outputs_and_several_targets_are_joined_in_their_shape():
    x, labels = float64_data()
    values = x[:, 2]
    learn = Learner(loaders(x, labels, values), TupleAndDict().double(), nested_loss, opt_func=SGD, lr=0.1,
                    default_cbs=False, n_inp=1)
    learn.fit(1)
    (scores, rest), (label, value) = learn.get_preds()
    by_hand = outputs_by_hand(learn.model, x)
    assert torch.equal(scores, by_hand[0]) and torch.equal(rest['value'], by_hand[1]['value'])
    assert torch.equal(rest['both'][0], x[:, :1]) and torch.equal(rest['both'][1], x[:, 1:])
    assert torch.equal(label, labels) and torch.equal(value, values)
    decoded, item = learn.predict(x[5])
    assert torch.equal(item[0], by_hand[0][5]) and torch.equal(item[1]['value'], by_hand[1]['value'][5])


def test_unlabelled_loaders_give_the_same_predictions_and_no_targets():
    from torch.utils.data import DataLoader, TensorDataset
    x, labels = float64_data()
    learn = quiet(Learner(loaders(x, labels), nn.Linear(3, 2).double(), F.cross_entropy, opt_func=SGD, lr=0.1,
                          metrics=[accuracy]))  # the default callbacks too: the Recorder sees batches with no loss
    learn.fit(1)
    probs, targets = learn.get_preds()
    for unlabelled in (DataLoader(TensorDataset(x), batch_size=5), DataLoader(x, batch_size=5)):  # [x] and bare x
        events = EventLog()
        with learn.added_cbs([events]):
            inputs, found, none, decoded = learn.get_preds(dl=unlabelled, with_input=True, with_decoded=True)
        assert torch.equal(found, probs) and none is None and torch.equal(inputs, x) and torch.equal(decoded, probs.argmax(1))
        assert 'after_loss' not in events.events and events.events.count('after_pred') == 5


def test_a_training_batch_without_targets_is_refused_before_any_step():
    x, _ = float64_data()
    learn = Learner(DataLoaders([(x,)], None), nn.Linear(3, 2).double(), F.cross_entropy, opt_func=SGD, default_cbs=False)
    before = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(TypeError, match='a training batch needs targets.*can be predicted'): learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())
    with pytest.raises(TypeError, match='cannot hold the model.s 2 inputs'):
        Learner(DataLoaders([(x,)], None), nn.Linear(3, 2), F.cross_entropy, n_inp=2, default_cbs=False).fit(1)


def test_predictions_are_float32_under_mixed_precision():
    from teachloop.callback.core import MixedPrecision
    torch.manual_seed(0)
    x, labels = float64_data()
    x = x.float()
    learn = Learner(loaders(x, labels), nn.Linear(3, 2), F.cross_entropy, opt_func=SGD, default_cbs=False,
                    cbs=[MixedPrecision(torch.bfloat16)])
    learn.fit(1)
    inputs, probs, targets, classes = learn.get_preds(with_input=True, with_decoded=True)
    assert probs.dtype == torch.float32 and inputs.dtype == torch.float32 and targets.dtype == torch.int64
    with torch.autocast('cpu', dtype=torch.bfloat16): out = outputs_by_hand(learn.model, x)
    assert out.dtype == torch.bfloat16  # what the model gave: get_preds made it float32 before the softmax
    assert torch.equal(probs, out.float().softmax(1)) and torch.equal(classes, probs.argmax(1))
    decoded, item_probs = learn.predict(x[0])
    assert item_probs.dtype == torch.float32


def test_predict_takes_one_item_of_any_number_of_inputs():
    class Sum(nn.Module):
        def __init__(self): super().__init__(); self.a, self.b = nn.Linear(2, 3), nn.Linear(1, 3)
        def forward(self, x1, x2): return self.a(x1) + self.b(x2)
    x, labels = float64_data()
    x1, x2 = x[:, :2], x[:, 2:]
    for n_inp in (None, 2):
        learn = Learner(loaders(x1, x2, labels), Sum().double(), F.cross_entropy, opt_func=SGD, default_cbs=False, n_inp=n_inp)
        probs, _, classes = learn.get_preds(with_decoded=True)
        decoded, item_probs = learn.predict((x1[3], x2[3]))
        assert torch.allclose(item_probs, probs[3], rtol=0, atol=1e-15) and decoded == classes[3]
    decoded, item_probs = learn.predict((x1[3], x2[3], labels[3]))  # with n_inp, a data set's item: the target is left out
    assert torch.allclose(item_probs, probs[3], rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match='1 part.*takes 2 inputs'): learn.predict((x1[3],))


def test_n_inp_splits_the_batch_between_the_model_and_the_loss():
    "A batch (x1, x2, y) calls model(x1, x2); (x, y1, y2) with n_inp=1 calls loss(pred, y1, y2): against a hand loop."
    x, labels = float64_data()
    values = x[:, 2]
    torch.manual_seed(0)
    model = TupleAndDict().double()
    reference = copy.deepcopy(model)
    seen = []
    def loss(out, label, value):
        seen.append((label, value))
        return nested_loss(out, label, value)
    learn = Learner(DataLoaders([(x[:12], labels[:12], values[:12]), (x[12:], labels[12:], values[12:])], None), model,
                    loss, opt_func=SGD, lr=0.1, default_cbs=False, n_inp=1)
    learn.fit(2)
    opt = SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for a, b in ((0, 12), (12, 24)):
            nested_loss(reference(x[a:b]), labels[a:b], values[a:b]).backward(); opt.step(); opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(learn.model.parameters(), reference.parameters()))
    assert torch.equal(seen[1][0], labels[12:]) and torch.equal(seen[1][1], values[12:])
    for bad in (0, True, 1.5, '1'):
        with pytest.raises(ValueError, match='n_inp must be a whole number'):
            Learner(tiny_dls(), nn.Linear(2, 1), F.mse_loss, n_inp=bad)


def test_a_dict_batch_is_refused_with_the_collate_fn_that_makes_it_a_tuple():
    "The error shows a collate_fn with the batch's own keys; that function, run as shown, makes batches that train."
    from torch.utils.data import DataLoader
    x, labels = float64_data()
    items = [{'labels': labels[i], 'pixels': x[i], 'mask': x[i] > 0} for i in range(len(x))]
    class Masked(nn.Linear):
        def forward(self, x, mask): return super().forward(x * mask)
    learn = Learner(DataLoaders(DataLoader(items, batch_size=8), None), Masked(3, 2).double(), F.cross_entropy,
                    opt_func=SGD, default_cbs=False)
    before = copy.deepcopy(learn.model.state_dict())
    with pytest.raises(TypeError, match="got a dict with the keys \\['labels', 'pixels', 'mask'\\]") as info: learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())
    code = str(info.value).split('\n\n')[1]
    assert code.splitlines()[0].strip() == 'def as_tuple(items):' and len(code.splitlines()) == 3
    assert "return batch['pixels'], batch['mask'], batch['labels']" in code
    namespace = {'torch': torch}
    exec(textwrap.dedent(code), namespace)  # the function as the message shows it
    learn.dls = DataLoaders(DataLoader(items, batch_size=8, collate_fn=namespace['as_tuple']), None)
    learn.fit(1)
    assert not all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())


def test_get_preds_of_an_empty_loader_or_without_a_validation_set_is_a_clear_error():
    learn = tiny_learner(dls=tiny_dls(valid=False))
    with pytest.raises(ValueError, match='no validation set'): learn.get_preds()
    with pytest.raises(ValueError, match='no batches to predict on'): learn.get_preds(dl=[])


# Under torchrun (WORLD_SIZE > 1), a fit outside `learn.distributed()` trains each process on all the data

def fit_and_catch(learn, n_fits=2):
    "The warnings of `n_fits` fits, and how many had been given when each fit's first batch started."
    at_first_batch = []
    class Note(Callback):
        def before_batch(self):
            if self.iter == 0 and self.training: at_first_batch.append(len(caught))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(n_fits): learn.fit(1, cbs=[Note()])
    return [str(w.message) for w in caught if 'WORLD_SIZE' in str(w.message)], at_first_batch


def test_a_fit_under_torchrun_outside_distributed_warns_once_in_rank_0_before_it_trains(monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('RANK', '0')
    found, at_first_batch = fit_and_catch(tiny_learner())
    assert len(found) == 1 and at_first_batch == [1, 1]
    assert 'WORLD_SIZE is 2' in found[0] and 'with learn.distributed(): learn.fit(' in found[0]
    monkeypatch.setenv('RANK', '1')
    assert fit_and_catch(tiny_learner())[0] == []  # the other ranks stay quiet


@pytest.mark.parametrize('world', [None, '1', 'x'])
def test_alone_there_is_no_warning(monkeypatch, world):
    if world is None: monkeypatch.delenv('WORLD_SIZE', raising=False)
    else: monkeypatch.setenv('WORLD_SIZE', world)
    monkeypatch.delenv('RANK', raising=False)
    assert fit_and_catch(tiny_learner())[0] == []


def test_a_sharded_training_loader_is_not_warned_about(monkeypatch):
    "The loaders `learn.distributed()` gives each process (and a user's own DistributedSampler) share the data out."
    from torch.utils.data import DataLoader, TensorDataset
    from teachloop.callback.distributed import shard_dls
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('RANK', '0')
    x, y = regression_2d(n=16)
    plain = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=4), None)
    assert fit_and_catch(tiny_learner(dls=shard_dls(plain, rank=0, world_size=2)))[0] == []
    assert len(fit_and_catch(tiny_learner(dls=plain))[0]) == 1


def test_a_compiled_models_weights_load_into_the_plain_model_and_back(tmp_path):
    compiled = digits_learner()
    compiled.fit(1)
    compiled.model = torch.compile(compiled.model)  # never called: no compiler needed, only the names change
    assert all(k.startswith('_orig_mod.') for k in compiled.model.state_dict())
    compiled.save(tmp_path / 'compiled.pt')
    plain = digits_learner(seed=1).load(tmp_path / 'compiled.pt')
    expected = compiled.model._orig_mod.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in plain.model.state_dict().items())
    again = digits_learner(seed=2)
    again.model = torch.compile(again.model)
    again.load(tmp_path / 'compiled.pt')
    plain.save(tmp_path / 'plain.pt')
    again.load(tmp_path / 'plain.pt')  # plain -> compiled
    assert all(torch.equal(v, expected[k.replace('_orig_mod.', '')]) for k, v in again.model.state_dict().items())


def test_predict_on_a_data_sets_item_with_its_target_says_what_to_pass():
    learn = digits_learner()
    item = learn.dls.valid.dataset[0]
    with pytest.raises(TypeError) as caught: learn.predict(item)
    assert 'learn.predict(item[0])' in ''.join(getattr(caught.value, '__notes__', []))
    assert torch.equal(learn.predict(item[0])[1], Learner(learn.dls, learn.model, F.cross_entropy, n_inp=1).predict(item)[1])


class PerStep(nn.Module):
    "A sequence model: (batch, length, 2) to one score per step, (batch, length); its length is the batch's own."
    def __init__(self): super().__init__(); self.lin = nn.Linear(2, 1, dtype=torch.float64); self.calls = 0
    def forward(self, x): self.calls += 1; return self.lin(x).squeeze(-1)


def padded_batches():
    "Two batches padded each to its own longest sequence: lengths 3 and 5."
    generator = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(4, n, 2, generator=generator, dtype=torch.float64) for n in (3, 5))
    return [(x1, x1.sum(-1)), (x2, x2.sum(-1))]


def test_get_preds_joins_batches_of_different_widths_padded_or_as_a_list_and_refuses_to_guess():
    batches = padded_batches()
    model = PerStep()
    learn = Learner(DataLoaders(batches, batches), model, F.mse_loss, opt_func=SGD, default_cbs=False)
    with pytest.raises(ValueError, match=r"differ in size past the batch dimension \(\(3,\), \(5,\)\).*pad=.*pad='list'"):
        learn.get_preds()
    calls = model.calls
    with pytest.raises(ValueError, match='pad must be'): learn.get_preds(pad='zeros')
    assert model.calls == calls  # refused before the model ran
    by_hand = [outputs_by_hand(model, x) for x, _ in batches]
    preds, targets = learn.get_preds(pad=-100)
    assert preds.shape == targets.shape == (8, 5)
    assert torch.equal(preds[:4, :3], by_hand[0]) and torch.equal(preds[4:], by_hand[1])
    assert (preds[:4, 3:] == -100).all() and (targets[:4, 3:] == -100).all() and torch.equal(targets[4:], batches[1][1])
    preds, targets = learn.get_preds(pad='list')
    assert [p.shape for p in preds] == [(4, 3), (4, 5)] and all(torch.equal(p, h) for p, h in zip(preds, by_hand))
    decoded, item = learn.predict(batches[0][0][1], act=lambda out: out * 2)  # predict takes `act` as get_preds does
    assert torch.equal(item, 2 * by_hand[0][1])


class Squeezed(nn.Module):
    "One score an item, squeezed whole: a batch of one item gives a 0-d output."
    def __init__(self): super().__init__(); self.lin = nn.Linear(2, 1, dtype=torch.float64)
    def forward(self, x): return self.lin(x).squeeze()


@pytest.mark.parametrize('sizes', [(1, 4), (4, 1)])
def test_an_output_without_its_batch_dimension_in_some_batches_is_refused_by_name_or_listed(sizes):
    "Unlabelled batches (labelled ones are refused at the loss, naming both shapes). Before: torch's stack error (the"
    " first batch 0-d) or `len() of a 0-d tensor` (a later one), whatever `pad` asked."
    generator = torch.Generator().manual_seed(0)
    batches = [(x,) for x in (torch.randn(n, 2, generator=generator, dtype=torch.float64) for n in sizes)]  # unlabelled
    model = Squeezed()
    learn = Learner(DataLoaders(batches, batches), model, F.mse_loss, opt_func=SGD, default_cbs=False)
    with pytest.raises(ValueError, match=r"no batch dimension in 1 of 2 batches .*squeeze\(\).*pad='list'"):
        learn.get_preds()
    preds = learn.get_preds(pad='list')[0]
    with torch.no_grad(): by_hand = [model(x) for x, in batches]
    assert [p.shape for p in preds] == [h.shape for h in by_hand] and all(torch.equal(p, h) for p, h in zip(preds, by_hand))


@pytest.mark.parametrize('lengths, listed', [((3, 4, 5), '((3,), (4,), (5,)): pass'),
                                             ((6, 3, 5, 4), '((3,), (4,), (5,), ...): pass')])
def test_outputs_of_many_widths_are_named_three_at_most(lengths, listed):
    generator = torch.Generator().manual_seed(0)
    batches = [(x, x.sum(-1)) for x in (torch.randn(2, n, 2, generator=generator, dtype=torch.float64) for n in lengths)]
    learn = Learner(DataLoaders(batches, batches), PerStep(), F.mse_loss, opt_func=SGD, default_cbs=False)
    with pytest.raises(ValueError) as caught: learn.get_preds()
    assert f"past the batch dimension {listed}" in str(caught.value)


def test_an_error_a_callback_raises_again_says_where_once():
    "The same exception object raised in two fits (a cell run again): the note that names its callback is there once."
    class OutOfBudget(Callback):
        error = RuntimeError('out of budget')
        def after_batch(self): raise self.error
    learn = tiny_learner(OutOfBudget())
    for _ in range(2):
        with pytest.raises(RuntimeError, match='out of budget') as caught: learn.fit(1)
    assert caught.value.__notes__ == ['(raised in OutOfBudget.after_batch)']


def test_after_a_fit_the_model_holds_the_weights_its_last_validation_scored():
    "A Schedule-Free optimizer trains at one point and validates at its average: the fit ends with the average in place."
    from teachloop.optim.recent import ScheduleFreeAdamW
    learn = tiny_learner(Recorder(), n_batches=4, opt_func=ScheduleFreeAdamW, lr=0.05)
    learn.fit(2)
    (x, y), = learn.dls.valid
    with torch.no_grad(): after = F.mse_loss(learn.model(x), y).item()
    # the same kernels on the same batch as the validation's, and the Recorder's mean of one batch is exact: equal
    assert after == learn.recorder.values[-1][2]  # epoch, train, valid


def test_get_preds_joins_dataclass_outputs_field_by_field_and_warns_once_of_an_unknown_activation():
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        features: torch.Tensor
        name: str = 'heads'

    class TwoHeads(nn.Module):
        def __init__(self): super().__init__(); self.a, self.b = nn.Linear(3, 2).double(), nn.Linear(3, 4).double()
        def forward(self, x): return Output(self.a(x), self.b(x))

    x, labels = float64_data()
    loss = lambda out, y: F.cross_entropy(out.logits, y)
    learn = Learner(loaders(x, labels), TwoHeads(), loss, opt_func=SGD, default_cbs=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        preds, targets = learn.get_preds()
        learn.get_preds()
    assert len([w for w in caught if 'activation' in str(w.message)]) == 1  # once for this learner and loss
    by_hand = outputs_by_hand(learn.model, x)
    assert isinstance(preds, Output) and preds.name == ['heads'] * 3  # what is not a tensor: one entry per batch, as elsewhere
    assert torch.equal(preds.logits, by_hand.logits) and torch.equal(preds.features, by_hand.features)
    assert torch.equal(targets, labels)


def test_metrics_see_float32_inside_any_container_under_mixed_precision():
    import dataclasses
    from teachloop.callback.core import MixedPrecision

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class Wrapped(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(3, 2)
        def forward(self, x): return Output(self.lin(x))

    seen = []
    def logit_accuracy(out, y):
        seen.append(out.logits.dtype)
        return (out.logits.argmax(1) == y).float().mean()

    x, labels = float64_data()
    learn = Learner(loaders(x.float(), labels), Wrapped(), lambda out, y: F.cross_entropy(out.logits, y), opt_func=SGD,
                    metrics=[logit_accuracy], cbs=[MixedPrecision(torch.bfloat16)])
    learn.progress.show_bar = learn.progress.print_rows = False
    learn.fit(1)
    with torch.autocast('cpu', dtype=torch.bfloat16): assert outputs_by_hand(learn.model, x.float()).logits.dtype == torch.bfloat16
    assert seen and set(seen) == {torch.float32}
