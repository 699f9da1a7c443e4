"teachloop optimizers in PyTorch code, PyTorch optimizers in the Learner, parameter groups and freezing."
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from teachloop.data import digits_cnn, digits_dls
from teachloop.optim.interop import OptimWrapper, freeze, freeze_to, split_at, unfreeze
from teachloop.learner import Learner
from teachloop.optim.core import SGD, Adam
from teachloop.optim.more import Lamb
from teachloop.testing import digits_batches

pytestmark = pytest.mark.numeric


def hand_loop(model, opt, dl, scheduler=None):
    for xb, yb in dl:
        F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb).backward()
        opt.step(); opt.zero_grad()
        if scheduler is not None: scheduler.step()


def max_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def test_one_cycle_lr_scheduler_drives_our_optimizer_like_torch():
    torch.manual_seed(0)
    model = digits_cnn().double()  # float64, so that 1e-10 holds on any CPU
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    n = len(digits_dls().train)
    opt_a = SGD(ours.parameters(), lr=0.01, mom=0.9, fast=False)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.01, momentum=0.9)
    sched_a = torch.optim.lr_scheduler.OneCycleLR(opt_a, max_lr=0.05, total_steps=n, cycle_momentum=False)
    sched_b = torch.optim.lr_scheduler.OneCycleLR(opt_b, max_lr=0.05, total_steps=n, cycle_momentum=False)
    hand_loop(ours, opt_a, digits_dls().train, sched_a)
    hand_loop(theirs, opt_b, digits_dls().train, sched_b)
    assert sched_a.get_last_lr() == sched_b.get_last_lr() and max_diff(ours, theirs) <= 1e-10
    assert max_diff(ours, model) > 1e-3


@pytest.mark.parametrize('set_to_none', [True, False])
def test_zero_grad(set_to_none):
    model = digits_cnn()
    opt = Adam(model.parameters(), lr=1e-3)
    F.cross_entropy(model(torch.rand(2, 1, 8, 8)), torch.tensor([1, 2])).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        assert (p.grad is None) if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize('factory', [partial(Adam, lr=1e-3), partial(Lamb, lr=1e-3), partial(SGD, lr=0.1, mom=0.9)])
def test_state_dict_round_trip_continues_identically(factory):
    torch.manual_seed(0)
    model = digits_cnn()
    batches = digits_batches(6)
    opt = factory(model.parameters())
    hand_loop(model, opt, batches[:3])
    twin_model = copy.deepcopy(model)
    twin = factory(twin_model.parameters())
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    hand_loop(model, opt, batches[3:]); hand_loop(twin_model, twin, batches[3:])
    assert max_diff(model, twin_model) == 0


def trained_state(factory, model):
    opt = factory(model.parameters())
    F.cross_entropy(model(torch.rand(2, 1, 8, 8)), torch.tensor([1, 2])).backward(); opt.step()
    return opt


@pytest.mark.parametrize('source,target,model_b,match', [
    (partial(SGD, lr=0.1, mom=0.9), partial(Adam, lr=1e-3), None, 'saved by an optimizer running'),
    (partial(Adam, lr=1e-3), partial(Adam, lr=1e-3), partial(digits_cnn, width=8), 'shape'),
    (partial(torch.optim.SGD, lr=0.1), partial(Adam, lr=1e-3), None, 'lacks hyper-parameters'),
    (partial(Adam, lr=1e-3), partial(Adam, lr=1e-3), lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)),
     'parameters'),
])
def test_incompatible_state_dict_raises_and_changes_nothing(source, target, model_b, match):
    saved = trained_state(source, digits_cnn()).state_dict()
    opt = trained_state(target, (model_b or digits_cnn)())
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after['param_groups'] == before['param_groups']
    for i, state in before['state'].items():
        for k, v in state.items(): assert torch.equal(torch.as_tensor(after['state'][i][k]), torch.as_tensor(v))


@pytest.mark.parametrize('cls,kwargs,expected', [
    (torch.optim.SGD, dict(momentum=0.9, weight_decay=0.1), dict(lr=0.01, mom=0.9, wd=0.1)),
    (torch.optim.Adam, dict(betas=(0.8, 0.99), eps=1e-6), dict(lr=0.01, mom=0.8, sqr_mom=0.99, wd=0., eps=1e-6)),
    (torch.optim.AdamW, dict(), dict(lr=0.01, mom=0.9, sqr_mom=0.999, wd=0.01, eps=1e-8)),
    (torch.optim.RMSprop, dict(alpha=0.95, momentum=0.5), dict(lr=0.01, mom=0.5, sqr_mom=0.95, wd=0., eps=1e-8)),
])
def test_optim_wrapper_names(cls, kwargs, expected):
    wrapper = OptimWrapper(digits_cnn().parameters(), opt=cls, lr=0.01, **kwargs)
    assert wrapper.hypers == [expected]


def test_optim_wrapper_set_hyper_writes_torch_names():
    model = digits_cnn()
    wrapper = OptimWrapper(split_at(model, 2), opt=torch.optim.Adam, betas=(0.9, 0.99))
    wrapper.set_hyper('mom', [0.8, 0.85]); wrapper.set_hyper('sqr_mom', 0.95); wrapper.set_hyper('lr', slice(1e-3, 1e-1))
    wrapper.set_hyper('wd', 0.1)
    groups = wrapper.opt.param_groups
    assert [g['betas'] for g in groups] == [(0.8, 0.95), (0.85, 0.95)]
    assert [g['lr'] for g in groups] == pytest.approx([1e-3, 1e-1]) and groups[1]['weight_decay'] == 0.1
    for bad in [('mom', 1.0), ('lr', [0.1, -0.1]), ('nesterov', True), ('alpha', 0.5)]:
        with pytest.raises((ValueError, KeyError)):
            wrapper.set_hyper(*bad)
    assert [g['betas'] for g in groups] == [(0.8, 0.95), (0.85, 0.95)]


def test_learner_with_wrapped_adamw_trains_like_torch():
    torch.manual_seed(0)
    model = digits_cnn()
    reference = copy.deepcopy(model)
    learn = Learner(digits_dls(), model, F.cross_entropy, lr=3e-3, wd=0.05, default_cbs=False,
                    opt_func=partial(OptimWrapper, opt=torch.optim.AdamW, betas=(0.9, 0.99)))
    learn.fit(1)
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05)
    reference.train()
    hand_loop(reference, opt, digits_dls().train)
    assert learn.opt.hypers[0]['wd'] == 0.05 and max_diff(learn.model, reference) <= 1e-6
    assert learn.opt.decouple_wd


def test_one_cycle_schedules_wrapped_optimizer():
    import teachloop.callback.schedule  # noqa: F401  (adds fit_one_cycle)
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, lr=1e-2, default_cbs=False,
                    opt_func=partial(OptimWrapper, opt=torch.optim.SGD, momentum=0.9))
    seen = []
    learn.add_cbs([type('Spy', (teachloop.callback.schedule.Callback,), {
        'after_step': lambda self: seen.append((self.opt.opt.param_groups[0]['lr'], self.opt.opt.param_groups[0]['momentum']))
    })()])
    learn.fit_one_cycle(1, moms=(0.95, 0.85, 0.95))
    lrs, moms = zip(*seen)
    assert max(lrs) == pytest.approx(1e-2, rel=0.05) and lrs[0] < 1e-3 and min(moms) == pytest.approx(0.85, abs=0.01)


def test_split_at_and_discriminative_lrs():
    model = digits_cnn()
    groups = split_at(model, 1, -1)
    assert [len(g) for g in groups] == [2, 4, 2]
    learn = Learner(digits_dls(), model, F.cross_entropy, opt_func=SGD, lr=slice(1e-4, 1e-2), default_cbs=False,
                    splitter=lambda m: split_at(m, 1, -1))
    learn.create_opt()
    assert [h['lr'] for h in learn.opt.hypers] == pytest.approx([1e-4, 1e-3, 1e-2])
    with pytest.raises(ValueError, match='increasing'):
        split_at(model, 3, 1)
    with pytest.raises(ValueError, match='without parameters'):
        split_at(model, 3, 4)


@pytest.mark.parametrize('opt_func', [partial(Adam, wd=0.1), partial(OptimWrapper, opt=torch.optim.AdamW)])
def test_freeze_keeps_frozen_weights_unchanged(opt_func):
    torch.manual_seed(0)
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, opt_func=opt_func, lr=1e-2, default_cbs=False,
                    splitter=lambda m: split_at(m, -1))
    freeze(learn)
    before = copy.deepcopy(learn.model)
    learn.fit(1)
    frozen, head = list(zip(learn.model.parameters(), before.parameters()))[:-2], list(learn.model.parameters())[-2:]
    assert all(torch.equal(a, b) for a, b in frozen)
    assert all(not torch.equal(a, b) for a, b in zip(head, list(before.parameters())[-2:]))
    unfreeze(learn)
    learn.fit(1)
    assert not torch.equal(next(learn.model.parameters()), next(before.parameters()))


def test_freeze_to_bad_n():
    opt = SGD(split_at(digits_cnn(), 1, -1), lr=0.1)
    for bad in [4, -4, 1.5, True]:
        with pytest.raises(ValueError, match='whole number'):
            freeze_to(opt, bad)
    freeze_to(opt, 2)
    assert [all(p.requires_grad for p in g['params']) for g in opt.param_groups] == [False, False, True]
    with pytest.raises(TypeError):
        freeze_to(object(), 1)


@pytest.mark.parametrize('factory', [partial(Adam, lr=1e-3), partial(Lamb, lr=1e-3)])
def test_deepcopy_and_pickle_keep_the_algorithm(factory):
    import pickle
    torch.manual_seed(0)
    model = digits_cnn()
    opt = factory(model.parameters())
    batches = digits_batches(4)
    hand_loop(model, opt, batches[:2])
    twin_model, twin = copy.deepcopy((model, opt))  # one copy, so the twin optimizer holds the twin's parameters
    hand_loop(model, opt, batches[2:]); hand_loop(twin_model, twin, batches[2:])
    assert max_diff(model, twin_model) == 0
    unpickled = pickle.loads(pickle.dumps(opt))
    assert unpickled.state_dict()['callbacks'] == opt.state_dict()['callbacks'] and unpickled.fast is None


def test_freeze_is_refused_while_the_learner_trains_in_another_thread():
    import threading
    from teachloop.learner import Callback
    started, release = threading.Event(), threading.Event()
    class Hold(Callback):
        def before_batch(self):
            started.set()
            release.wait(10)
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, default_cbs=False, splitter=lambda m: split_at(m, 1, -1))
    worker = threading.Thread(target=lambda: learn.fit(1, cbs=[Hold()]))
    learn.reserve_for(worker)
    worker.start()
    try:
        assert started.wait(10)
        for call in (freeze, unfreeze, lambda learn: freeze_to(learn, 1)):
            with pytest.raises(RuntimeError, match='freeze or unfreeze while this learner trains in another thread'):
                call(learn)
        assert all(p.requires_grad for p in learn.model.parameters())
    finally:
        release.set()
        worker.join(10)
        learn.release(worker)
    freeze(learn)  # once the fit is over, the learner is free again
    assert not next(learn.model.parameters()).requires_grad
