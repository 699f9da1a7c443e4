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
from teachloop.testing import digits_batches, digits_learner

pytestmark = pytest.mark.numeric


def hand_loop(model, opt, dl, scheduler=None):
    for xb, yb in dl:
        F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb).backward()
        opt.step(); opt.zero_grad()
        if scheduler is not None: scheduler.step()


def max_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.float32
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


def test_a_hyper_parameter_that_is_a_pair_in_torch_is_neither_read_nor_written_as_one_number():
    "Adafactor's `eps` is (None, 1e-3): a schedule writing one number there would break the optimizer's next step."
    wrapper = OptimWrapper(digits_cnn().parameters(), opt=torch.optim.Adafactor, lr=0.01)
    assert 'eps' not in wrapper.hypers[0] and {'lr', 'wd'} <= set(wrapper.hypers[0])
    with pytest.raises((ValueError, KeyError)): wrapper.set_hyper('eps', 1e-8)
    assert wrapper.opt.param_groups[0]['eps'] == (None, 1e-3)


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


@pytest.mark.float32
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


@pytest.mark.float32
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


# A class of torch.optim passed to the Learner as it is: `opt_func=torch.optim.AdamW`

TORCH_OPTIMIZERS = sorted((cls for cls in vars(torch.optim).values() if isinstance(cls, type)
                           and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer),
                          key=lambda cls: cls.__name__)
REFUSED = {torch.optim.LBFGS: 'closure', torch.optim.SparseAdam: 'sparse gradients'}


def test_the_list_of_torch_optimizers_is_torchs_whole_list():
    "The classes below are found in torch.optim, not written down: a class torch adds is tested too."
    names = {cls.__name__ for cls in TORCH_OPTIMIZERS}
    assert {'SGD', 'Adam', 'AdamW', 'RMSprop', 'Adagrad', 'Adadelta', 'Adamax', 'NAdam', 'RAdam', 'ASGD', 'Rprop',
            'LBFGS', 'SparseAdam'} <= names


def float64_batches(n_batches=3, bs=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * bs, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.], [-2.], [0.5], [0.]], dtype=torch.float64) + 0.1
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]


def small_model(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8, bias=bias), torch.nn.Tanh(), torch.nn.Linear(8, 1, bias=bias)).double()


def fit_by_hand(model, opt, batches, n_epoch):
    for _ in range(n_epoch):
        for xb, yb in batches:
            F.mse_loss(model(xb), yb).backward(); opt.step(); opt.zero_grad()


@pytest.mark.float32
@pytest.mark.parametrize('cls', [c for c in TORCH_OPTIMIZERS if c not in REFUSED], ids=lambda c: c.__name__)
def test_every_torch_optimizer_trains_in_the_learner_as_in_a_hand_written_loop(cls):
    "float64, same batches, same steps: the weights agree bit for bit with the torch optimizer driven by hand."
    from teachloop.data import DataLoaders
    batches = float64_batches()
    model = small_model(bias=cls is not torch.optim.Muon)  # Muon takes matrices only
    reference = copy.deepcopy(model)
    learn = Learner(DataLoaders(batches, batches[:1]), model, F.mse_loss, opt_func=cls, lr=1e-2, default_cbs=False)
    learn.fit(2)
    assert isinstance(learn.opt, OptimWrapper) and type(learn.opt.opt) is cls
    fit_by_hand(reference, cls(reference.parameters(), lr=1e-2), batches, 2)
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), reference.parameters()))
    assert not torch.equal(next(learn.model.parameters()), next(small_model(bias=cls is not torch.optim.Muon).parameters()))


@pytest.mark.parametrize('cls', REFUSED, ids=lambda c: c.__name__)
def test_torch_optimizers_that_cannot_work_in_a_learner_are_refused_when_it_is_made(cls):
    for opt_func in (cls, partial(cls, lr=0.1), partial(OptimWrapper, opt=cls)):
        with pytest.raises(ValueError, match=f'{cls.__name__} cannot train in a Learner.*{REFUSED[cls]}'):
            Learner(digits_dls(), digits_cnn(), F.cross_entropy, opt_func=opt_func, default_cbs=False)


def test_a_partial_of_a_torch_optimizer_keeps_its_arguments_and_the_learners_lr_and_wd():
    from teachloop.data import DataLoaders
    batches = float64_batches()
    model = small_model()
    reference = copy.deepcopy(model)
    learn = Learner(DataLoaders(batches, None), model, F.mse_loss, opt_func=partial(torch.optim.SGD, momentum=0.9, nesterov=True),
                    lr=0.05, wd=0.01, default_cbs=False)
    learn.fit(1)
    learn.fit(1, lr=0.02)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    fit_by_hand(reference, opt, batches, 1)
    opt.param_groups[0]['lr'] = 0.02
    fit_by_hand(reference, opt, batches, 1)
    assert learn.opt.hypers == [dict(lr=0.02, mom=0.9, wd=0.01)]
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), reference.parameters()))
    with pytest.raises(TypeError, match='by name'):
        Learner(DataLoaders(batches, None), model, F.mse_loss, opt_func=partial(torch.optim.SGD, [], 0.1))


@pytest.mark.float32
def test_a_torch_optimizer_class_takes_discriminative_lrs_schedules_and_freezing():
    import teachloop.callback.schedule  # noqa: F401  (adds fit_one_cycle)
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, opt_func=torch.optim.AdamW, lr=slice(1e-4, 1e-2),
                    wd=0.1, default_cbs=False, splitter=lambda m: split_at(m, 1, -1))
    learn.create_opt()
    assert [g['lr'] for g in learn.opt.opt.param_groups] == pytest.approx([1e-4, 1e-3, 1e-2])
    assert [g['weight_decay'] for g in learn.opt.opt.param_groups] == [0.1] * 3
    seen = []
    learn.add_cbs([type('Spy', (teachloop.callback.schedule.Callback,), {
        'after_step': lambda self: seen.append([(g['lr'], g['betas'][0]) for g in self.opt.opt.param_groups])})()])
    learn.freeze()
    before = copy.deepcopy(learn.model)
    learn.fit_one_cycle(1, lr_max=slice(1e-4, 1e-2))
    assert max(step[2][0] for step in seen) == pytest.approx(1e-2, rel=0.05) and seen[0][2][0] < 1e-3
    assert min(step[2][1] for step in seen) == pytest.approx(0.85, abs=0.01)
    changed = [not torch.equal(a, b) for a, b in zip(learn.model.parameters(), before.parameters())]
    assert changed == [False] * 6 + [True] * 2  # frozen, whatever AdamW's weight decay
    learn.unfreeze()
    assert all(p.requires_grad for p in learn.model.parameters())


def test_a_torch_optimizer_class_resumes_from_a_checkpoint_bit_for_bit(tmp_path):
    from teachloop.callback.checkpoint import Checkpoint
    from teachloop.learner import CancelFitException, Callback
    from teachloop.testing import digits_learner
    class StopAfterFirstEpoch(Callback):
        order = 80
        def after_epoch(self): raise CancelFitException()
    straight = digits_learner(opt_func=torch.optim.Adam, lr=3e-3)
    straight.fit(2)
    digits_learner(opt_func=torch.optim.Adam, lr=3e-3).fit(2, cbs=[Checkpoint(tmp_path), StopAfterFirstEpoch()])
    resumed = digits_learner(opt_func=torch.optim.Adam, lr=3e-3)
    resumed.fit(2, resume=tmp_path / 'latest.pt')
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters()))
    assert type(resumed.opt.opt) is torch.optim.Adam


def test_freeze_methods_of_the_learner_are_the_functions():
    learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, opt_func=torch.optim.SGD, default_cbs=False,
                    splitter=lambda m: split_at(m, 1, -1))
    trainable = lambda: [all(p.requires_grad for p in g) for g in learn.splitter(learn.model)]
    learn.freeze()
    assert trainable() == [False, False, True]
    learn.freeze_to(1)
    assert trainable() == [False, True, True]
    learn.freeze_to(-3)
    assert trainable() == [True, True, True]
    freeze(learn); learn.unfreeze()
    assert trainable() == [True, True, True]
    with pytest.raises(ValueError, match='whole number'): learn.freeze_to(3.5)


def test_a_schedule_free_optimizer_from_its_package_is_switched_between_its_points():
    "schedulefree's AdamW, wrapped: the learner trains at its training point and ends at its evaluation point."
    schedulefree = pytest.importorskip('schedulefree')
    from teachloop.data import DataLoaders
    batches = float64_batches()
    model = small_model()
    reference = copy.deepcopy(model)
    learn = Learner(DataLoaders(batches, batches[:1]), model, F.mse_loss, opt_func=schedulefree.AdamWScheduleFree,
                    lr=1e-2, default_cbs=False)
    learn.fit(2)
    opt = schedulefree.AdamWScheduleFree(reference.parameters(), lr=1e-2)
    for _ in range(2):  # each epoch's validation runs at the evaluation point, as the learner's does
        opt.train()
        fit_by_hand(reference, opt, batches, 1)
        opt.eval()
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), reference.parameters()))
    plain = OptimWrapper(small_model().parameters(), torch.optim.AdamW)
    assert plain.train is None and plain.eval is None  # no modes: the learner leaves it alone


def test_asgds_alpha_is_not_read_as_a_moving_averages_weight():
    wrapper = OptimWrapper(digits_cnn().parameters(), torch.optim.ASGD, lr=0.01)
    assert 'sqr_mom' not in wrapper.names and wrapper.opt.param_groups[0]['alpha'] == 0.75


def test_freeze_with_one_parameter_group_is_refused_saying_how_to_split():
    learn = digits_learner()
    before = [p.requires_grad for p in learn.model.parameters()]
    with pytest.raises(ValueError, match='nothing would be frozen.*splitter'): learn.freeze()
    assert [p.requires_grad for p in learn.model.parameters()] == before


@pytest.mark.float32
def test_fit_one_cycle_leaves_a_torch_optimizers_momentum_off_when_it_is_off():
    "torch's SGD with momentum=0 takes no momentum: the cycle of `moms` is not switched on for it (it is for Adam's β1)."
    sgd = digits_learner(opt_func=torch.optim.SGD, lr=0.05)
    sgd.fit_one_cycle(1)
    assert [g['momentum'] for g in sgd.opt.opt.param_groups] == [0] and set(sgd.recorder.hps['mom']) == {0}
    adam = digits_learner(opt_func=torch.optim.Adam, lr=1e-3)
    adam.fit_one_cycle(1)
    assert min(adam.recorder.hps['mom']) < 0.86 and max(adam.recorder.hps['mom']) == 0.95
