import pytest

from teachloop.designs.callbacks_v1 import CallbackHandler, V1Callback
from teachloop.designs.event_filters import EventFilter, FuncCallback, every, filtered, once, reset_event_counts, when
from teachloop.designs.gluon_handlers import BatchEnd, Estimator
from teachloop.learner import Callback
from teachloop.testing import tiny_dls, tiny_learner

N_TRAIN = 5


# the counts below are of this file's data: N_TRAIN training and 2 validation batches
def make_learner(): return tiny_learner(dls=tiny_dls(N_TRAIN, valid_batches=2))


def passing(event_filter, n=20, owner=None): return [c for c in range(1, n + 1) if event_filter(owner, c)]


def test_event_filter_counts():
    assert passing(EventFilter(every=4)) == [4, 8, 12, 16, 20]
    assert passing(EventFilter(once=7)) == [7]
    assert passing(EventFilter(when=lambda owner, c: c in (2, 3))) == [2, 3]
    assert passing(EventFilter(every=3, when=lambda owner, c: c > 10)) == [12, 15, 18]
    assert passing(EventFilter(every=2, once=5)) == []
    assert passing(EventFilter(when=lambda owner, c: owner == 'x'), owner='x') == list(range(1, 21))


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(every=0), ValueError, 'every'), (dict(once=-1), ValueError, 'once'), (dict(every=2.5), ValueError, 'every'),
    (dict(every=True), ValueError, 'every'), (dict(when=3), TypeError, 'when'), (dict(), ValueError, 'at least one')])
def test_event_filter_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match): EventFilter(**kwargs)


def test_func_callback_every_once_when_over_a_fit():
    seen = {'every': [], 'once': [], 'when': []}
    def record(key): return lambda learn: seen[key].append((learn.epoch, learn.iter))
    learn = make_learner()
    learn.fit(3, cbs=[FuncCallback(after_batch=record('every'), run_valid=False, name='a').every(2),
                      FuncCallback(after_batch=record('once'), name='b').once(7),
                      FuncCallback(after_batch=record('when'), run_valid=False, name='c').when(lambda cb, n: cb.epoch == 1)])
    train_batches = [(e, i) for e in range(3) for i in range(N_TRAIN)]
    all_batches = [(e, i) for e in range(3) for i in list(range(N_TRAIN)) + [0, 1]]  # 2 validation batches per epoch
    assert seen['every'] == train_batches[1::2]
    assert seen['once'] == [all_batches[6]]
    assert seen['when'] == [(1, i) for i in range(N_TRAIN)]


def test_func_callback_chained_filters_and_several_events():
    calls = []
    cb = FuncCallback(before_epoch=lambda learn: calls.append(('epoch', learn.epoch)),
                      after_fit=lambda learn: calls.append(('fit', learn.epoch)), name='both')
    cb.every(2).when(lambda cb, n: n < 5)
    make_learner().fit(6, cbs=[cb])
    # counts are per event: before_epoch fires 6 times (counts 2, 4 pass), after_fit once (count 1 fails every=2)
    assert calls == [('epoch', 1), ('epoch', 3)]


def test_func_callback_checks_events_and_functions():
    with pytest.raises(ValueError, match='after_batch'): FuncCallback(after_bacth=print)
    with pytest.raises(TypeError, match='function'): FuncCallback(after_batch=3)
    with pytest.raises(ValueError, match='at least one'): FuncCallback()


def test_func_callbacks_get_distinct_names():
    def log_loss(learn): pass
    named, lambda_a, lambda_b = FuncCallback(after_batch=log_loss), FuncCallback(after_batch=lambda l: 0), FuncCallback(after_batch=lambda l: 0)
    assert named.name == 'log_loss' and lambda_a.name != lambda_b.name
    learn = make_learner()
    learn.add_cbs([named, lambda_a, lambda_b])
    assert learn.log_loss is named


def test_errors_in_func_handlers_propagate_and_name_the_callback():
    def broken(learn): raise RuntimeError('broken handler')
    with pytest.raises(RuntimeError, match='broken handler') as info:
        make_learner().fit(1, cbs=[FuncCallback(after_loss=broken)])
    assert any('FuncCallback.after_loss' in note for note in getattr(info.value, '__notes__', []))


def test_decorators_count_per_instance_and_reset():
    class Every2(Callback):
        def __init__(self): self.iters = []
        @every(2)
        def after_batch(self): self.iters.append(self.iter)
    first, second = Every2(), Every2()
    second.name = 'second'
    learn = make_learner()
    learn.fit(1, cbs=[first, second])
    assert first.iters == second.iters == [1, 3, 0]  # counts 2, 4, 6 over 5 training and 2 validation batches
    reset_event_counts(first)
    learn.fit(1, cbs=[first, second])
    assert first.iters == [1, 3, 0, 1, 3, 0] and second.iters == [1, 3, 0, 0, 2, 4, 1]


def test_decorators_in_v1_and_gluon_designs():
    class V1Once(V1Callback):
        def __init__(self): self.iterations = []
        @once(3)
        def on_step_end(self, iteration, **kwargs): self.iterations.append(iteration)
    class V1Stop(V1Callback):
        @when(lambda cb, n: n == 2)
        def on_epoch_end(self, **kwargs): return True
    class GluonEvery(BatchEnd):
        def __init__(self): self.count = 0
        @every(N_TRAIN)
        def batch_end(self, estimator, *args, **kwargs): self.count += 1
    v1_once, gluon = V1Once(), GluonEvery()
    learn = make_learner()
    learn.fit(4, cbs=[CallbackHandler([v1_once, V1Stop()]), Estimator([gluon])])
    assert v1_once.iterations == [2] and learn.epoch == 1 and gluon.count == 2


def test_filtered_returns_none_when_skipped():
    class Owner:
        @filtered(every=2)
        def value(self): return 'ran'
    owner = Owner()
    assert [owner.value() for _ in range(4)] == [None, 'ran', None, 'ran']
