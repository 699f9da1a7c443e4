"""The contracts every optimizer the library exports keeps, checked for all of them at once.

After torch's own optimizer tests (`OptimizerInfo`): each optimizer is described once, where it is taught, with
`declare_optimizer` (`teachloop.optim.core.OPTIMIZERS`): how to make it, with which settings, on parameters of how many
dimensions, what independent implementation it equals and how it differs from it by convention. One battery of tests
runs over every description:

1. a saved state continues bit for bit: through `load_state_dict`, `Learner.save`/`load`, a checkpoint written at an
   epoch's end and one written when a fit was interrupted (`fit(resume=)`);
2. the fast step against the callbacks, to the tolerance the description derives;
3. parameters without a gradient on some steps (one frozen for a while, then trained again) follow the description's
   step count: each parameter on its own, or the group's clock;
4. every schedule (`fit_one_cycle`, `fit_flat_cos`, `fit_sgdr`, `lr_find`, `ParamScheduler`, torch's `OneCycleLR`
   cycling momentum) trains as the reference does when given the same values, or is refused before the fit;
5. after `step()`, `p.grad` still holds the gradient;
6. two processes (gloo) train as one process with the doubled batch;
7. the reference, on every setting that has one.

Everything runs in float64, the default dtype included (torch keeps some optimizers' counters in it), on parameters of
0 to 4 dimensions (a 1 x n and an n x 1 matrix among them) in two groups, the first with half the learning rate.
Gradients are drawn, not computed, where only the optimizer is checked: both sides then see the same gradients.
"""
import copy
import importlib
import inspect
import io
import math
import pkgutil
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import teachloop
import teachloop.all  # noqa: F401  (every notebook's optimizers declared)
from teachloop.callback.checkpoint import Checkpoint
from teachloop.data import DataLoaders
from teachloop.callback.distributed import run_ranks
from teachloop.optim.interop import torch_location, write_hyper
from teachloop.learner import Callback, Learner
from teachloop.optim.core import OPTIMIZERS
from teachloop.random_state import set_seed
from teachloop.optim.recent import ScheduleFreeOptimizer
from teachloop.callback.schedule import ParamScheduler, annealing_cos
from teachloop.testing import quiet

pytestmark = pytest.mark.numeric

SHAPES = [(), (5,), (3, 4), (1, 6), (6, 1), (2, 3, 4), (2, 3, 2, 2)]
N_STEPS = 12
CASES = [pytest.param(name, i, id=f'{name}-{i}') for name, info in sorted(OPTIMIZERS.items())
         for i in range(len(info.settings))]
FIRST_SETTINGS = [pytest.param(name, 0, id=name) for name in sorted(OPTIMIZERS)]


@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# ---- describing, making and stepping

def shapes_of(info): return [shape for shape in SHAPES if len(shape) in info.param_dims]


def make_params(info, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64)) for shape in shapes_of(info)]


def halves(params): return [params[:(len(params) + 1) // 2], params[(len(params) + 1) // 2:]]


def groups(param_lists, setting):
    "Group dicts: the first group with half the setting's learning rate (when it has one), the second with it."
    first = {'params': list(param_lists[0])}
    if 'lr' in setting: first['lr'] = setting['lr'] / 2
    return [group for group in (first, {'params': list(param_lists[1])}) if group['params']]


def has_fast_switch(info): return 'fast' in inspect.signature(info.make).parameters


def build(info, setting, param_lists, fast=None):
    "The described optimizer on the two groups of `param_lists`."
    extra = {'fast': fast} if has_fast_switch(info) else {}
    return info.make(groups(param_lists, setting), **setting, **extra)


def as_list(opt): return opt if isinstance(opt, list) else [opt]


def reference(info, setting, param_lists):
    "The reference optimizers (a list) on the same groups, or None where the setting has none."
    if info.reference is None: return None
    opt = info.reference(groups(param_lists, setting), **setting)
    return None if opt is None else as_list(opt)


def drawn_grads(shapes, n_steps=N_STEPS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(n_steps)]


def take_steps(opts, params, grads, skip=None):
    "Give each parameter its drawn gradient (none where `skip[t][j]`) and step every optimizer of `opts`."
    for t, step_grads in enumerate(grads):
        for j, (p, grad) in enumerate(zip(params, step_grads)):
            p.grad = None if skip is not None and skip[t][j] else grad.clone()
        for opt in as_list(opts): opt.step()


def tolerance(value, setting, shapes, n_steps=N_STEPS):
    return value(n_steps, setting, shapes) if callable(value) else value


def max_diff(a, b): return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def same_bits(a, b): return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b))


def state_tensors(opt):
    "A copy of the optimizer's state as a flat list of (key, value), in its saving order."
    saved = copy.deepcopy(opt.state_dict())
    flat = []
    for index, state in sorted(saved['state'].items()):
        flat += [((index, k), v) for k, v in sorted(state.items())]
    for i, group in enumerate(saved['param_groups']):
        flat += [((i, k), v) for k, v in sorted(group.items()) if k not in ('params', 'opt')]
    return flat


def assert_same_state(a, b):
    left, right = state_tensors(a), state_tensors(b)
    assert [k for k, _ in left] == [k for k, _ in right]
    for (key, x), (_, y) in zip(left, right):
        assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), key


# ---- every exported optimizer is described

def is_optimizer(obj):
    "Whether `obj` makes an optimizer: a torch optimizer class, a function of `params` and `lr`, or a wrapper of one."
    if not callable(obj): return False
    try: names = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError): return False
    if 'cbs' in names: return False  # a building block (Optimizer, GroupedOptimizer, ...): checked through what it builds
    if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer): return True
    if names[:1] == ['params'] and 'lr' in names: return True
    return names[:1] == ['opt'] and obj.__name__[:1].isupper() and not isinstance(obj, type)  # Lookahead(opt, ...)


def exported_optimizers():
    found = {}
    for module in pkgutil.walk_packages(teachloop.__path__, 'teachloop.'):
        loaded = importlib.import_module(module.name)
        for name in getattr(loaded, '__all__', ()):
            if is_optimizer(getattr(loaded, name)): found.setdefault(name, module.name)
    return found


def test_every_exported_optimizer_is_described():
    exported = exported_optimizers()
    missing = {name: module for name, module in exported.items() if name not in OPTIMIZERS}
    assert not missing, f"describe these optimizers with declare_optimizer where they are taught: {missing}"
    assert set(OPTIMIZERS) <= set(exported), "described but not exported"
    assert len(OPTIMIZERS) >= 20 and all(info.settings for info in OPTIMIZERS.values())


# ---- 7. the reference

@pytest.mark.float32
@pytest.mark.parametrize('name, i', CASES)
def test_equal_to_the_reference(name, i):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    ours_params, their_params = make_params(info), make_params(info)
    theirs = reference(info, setting, halves(their_params))
    if theirs is None: pytest.skip(f"no reference for this setting: {info.differences or 'none exists'}")
    grads = drawn_grads(shapes_of(info))
    take_steps(build(info, setting, halves(ours_params)), ours_params, grads)
    take_steps(theirs, their_params, grads)
    assert max_diff(ours_params, their_params) <= tolerance(info.reference_tolerance, setting, shapes_of(info))
    assert max_diff(ours_params, make_params(info)) > 1e-4  # they moved


# ---- 2. the fast step

@pytest.mark.float32
@pytest.mark.parametrize('name, i', CASES)
def test_fast_step_matches_the_callbacks(name, i):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    if not has_fast_switch(info): pytest.skip("a torch optimizer inside: no callbacks to compare with")
    slow_params, fast_params = make_params(info), make_params(info)
    grads = drawn_grads(shapes_of(info))
    slow, fast = build(info, setting, halves(slow_params), fast=False), build(info, setting, halves(fast_params), fast=True)
    take_steps(slow, slow_params, grads)
    take_steps(fast, fast_params, grads)  # fast=True raises if some group had no fast step
    assert max_diff(slow_params, fast_params) <= tolerance(info.fast_tolerance, setting, shapes_of(info))


# ---- 5. gradients left as they were

@pytest.mark.parametrize('fast', [False, None], ids=['callbacks', 'fast'])
@pytest.mark.parametrize('name, i', CASES)
def test_step_leaves_the_gradients_as_they_were(name, i, fast):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    params = make_params(info)
    opt = build(info, setting, halves(params), fast=fast)
    for step_grads in drawn_grads(shapes_of(info), 3):
        for p, grad in zip(params, step_grads): p.grad = grad.clone()
        opt.step()
        assert same_bits([p.grad for p in params], step_grads)


# ---- 1. saved states continue bit for bit

def saved_and_read(state):
    "`state` written with torch.save and read back as a checkpoint is (weights_only)."
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize('name, i', CASES)
def test_a_loaded_state_continues_bit_for_bit(name, i):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    grads, half = drawn_grads(shapes_of(info)), N_STEPS // 2
    whole_params, first_params = make_params(info), make_params(info)
    whole = build(info, setting, halves(whole_params))
    take_steps(whole, whole_params, grads)
    first = build(info, setting, halves(first_params))
    take_steps(first, first_params, grads[:half])
    saved = saved_and_read(first.state_dict())
    second_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    second = build(info, setting, halves(second_params))
    second.load_state_dict(saved)
    take_steps(second, second_params, grads[half:])
    assert same_bits(whole_params, second_params)
    assert_same_state(whole, second)


class ShapesModel(nn.Module):
    "Parameters of the given shapes; its output for inputs x (batch x 4) is the sum of tanh(p) projected onto x."
    def __init__(self, shapes, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(s, generator=generator, dtype=torch.float64))
                                         for s in shapes])
        for j, shape in enumerate(shapes):
            self.register_buffer(f'projection{j}', torch.randn(math.prod(shape), 4, generator=generator,
                                                                dtype=torch.float64))

    def forward(self, x):
        return sum(torch.tanh(p).reshape(1, -1) @ getattr(self, f'projection{j}') @ x.T
                   for j, p in enumerate(self.weights)).squeeze(0)


def shapes_data(n=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return x, x @ torch.randn(4, generator=generator, dtype=torch.float64) + 0.1


def shapes_dls(bs=8, shuffle=True, seed=0):
    "32 training items (4 batches of 8) and 8 validation items; a shuffling loader with its own generator."
    x, y = shapes_data(seed=seed)
    train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=bs, shuffle=shuffle,
                       generator=torch.Generator().manual_seed(seed) if shuffle else None)
    return DataLoaders(train, DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8))


def shapes_learner(info, setting, cbs=(), dls=None, seed=0, scalars=True):
    set_seed(seed)
    shapes = [s for s in shapes_of(info) if scalars or len(s)]  # FSDP2 shards along the first dimension: none for scalars
    learn = Learner(dls or shapes_dls(seed=seed), ShapesModel(shapes, seed), F.mse_loss,
                    opt_func=lambda param_lists, lr=None: build(info, setting, param_lists), splitter=lambda m: halves(list(m.parameters())),
                    cbs=list(cbs))
    return quiet(learn)


class InterruptAt(Callback):
    "A Ctrl-C during training step `at` (counted from 1 over the fit)."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.learn.train_iter + 1 == self.at: raise KeyboardInterrupt


ROUTES = ['Learner.save and load', 'checkpoint at an epoch end', 'interrupted mid-epoch']


@pytest.mark.parametrize('route', ROUTES)
@pytest.mark.parametrize('name, i', CASES)
def test_a_fit_continued_from_a_save_equals_the_uninterrupted_one(name, i, route, tmp_path):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    shuffle = route != 'Learner.save and load'  # a new learner's loader starts its order again: keep one order
    whole = shapes_learner(info, setting, dls=shapes_dls(shuffle=shuffle))
    whole.fit(3)
    first = shapes_learner(info, setting, dls=shapes_dls(shuffle=shuffle), cbs=[Checkpoint(tmp_path)])
    second = shapes_learner(info, setting, dls=shapes_dls(shuffle=shuffle), cbs=[Checkpoint(tmp_path / 'again')])
    if route == 'Learner.save and load':
        first.fit(1)
        first.save(tmp_path / 'saved.pt')
        second.load(tmp_path / 'saved.pt')
        second.fit(2)
    elif route == 'checkpoint at an epoch end':
        with pytest.raises(KeyboardInterrupt): first.fit(3, cbs=[InterruptAt(5)])
        second.fit(3, resume=tmp_path / 'epoch-001.pt')
    else:
        with pytest.raises(KeyboardInterrupt): first.fit(3, cbs=[InterruptAt(6)])
        second.fit(3, resume=tmp_path / 'interrupted.pt')
    assert same_bits(whole.model.parameters(), second.model.parameters())
    assert_same_state(whole.opt, second.opt)


# ---- 3. parameters without a gradient on some steps

def skipped(n_params, n_steps=N_STEPS):
    "Which parameter has no gradient at which step: the first is frozen for steps 3-7, each other misses one in five."
    return [[(j == 0 and 3 <= t <= 7) or (j > 0 and (t + j) % 5 == 0) for j in range(n_params)] for t in range(n_steps)]


@pytest.mark.parametrize('name, i', CASES)
def test_parameters_without_gradients_follow_the_step_count(name, i):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    shapes, params = shapes_of(info), make_params(info)
    grads, skip = drawn_grads(shapes), skipped(len(shapes))
    take_steps(build(info, setting, halves(params)), params, grads, skip)
    if info.step_count == 'group':  # the group's clock runs for every parameter: the reference, skipping alike
        expected = make_params(info)
        theirs = reference(info, setting, halves(expected))
        assert theirs is not None, "a group count is checked against its reference"
        take_steps(theirs, expected, grads, skip)
        assert max_diff(params, expected) <= tolerance(info.reference_tolerance, setting, shapes)
        return
    # each parameter on its own: what it would do alone, in its own group, over the steps it had a gradient
    for j, p in enumerate(params):
        alone = make_params(info)[j]
        lists = [[alone], []] if j < len(halves(params)[0]) else [[], [alone]]
        theirs = reference(info, setting, lists)
        opts = theirs or as_list(build(info, setting, lists, fast=False))
        take_steps(opts, [alone], [[g[j]] for g, s in zip(grads, skip) if not s[j]])
        limit = tolerance(info.reference_tolerance if theirs else info.fast_tolerance, setting, shapes)
        assert max_diff([p], [alone]) <= limit, j


# ---- 4. schedules

class Probe(Callback):
    "Records each training step's batch and the hyper-parameters each group steps with."
    order = 1000
    def before_fit(self): self.steps = []
    def before_step(self):
        self.steps.append(([x.clone() for x in self.learn.xb], [y.clone() for y in self.learn.yb],
                           [dict(hypers) for hypers in self.learn.opt.hypers]))


class TorchScheduler(Callback):
    "Steps a torch learning-rate scheduler after every optimizer step."
    def __init__(self, scheduler): self.scheduler = scheduler
    def after_step(self): self.scheduler.step()


def replayed(info, setting, steps, make_opts, ours_group):
    "A fresh model trained on the recorded batches by `make_opts(param_lists)`, given each step's recorded values."
    set_seed(0)
    model = ShapesModel(shapes_of(info), 0)
    opts = make_opts(halves(list(model.parameters())))
    place = {id(p): j for j, p in enumerate(model.parameters())}
    for xb, yb, hypers in steps:
        for opt in opts:
            for group in opt.param_groups:
                values = hypers[ours_group[place[id(group['params'][0])]]]  # its parameters' group in the fit
                for name in ('lr', 'mom'):
                    if name in values: set_value(group, name, values[name])
        if isinstance(opts[0], ExplicitScheduleFree): opts[0].place_y()
        F.mse_loss(model(*xb), *yb).backward()
        for opt in opts: opt.step()
        for opt in opts: opt.zero_grad()
    return model, opts


def set_value(group, name, value):
    "Write one of our hyper-parameters into a group of ours, or of torch's under its own name."
    if name in group or torch_location(group, name) is None: group[name] = value
    else: write_hyper(group, torch_location(group, name), value)


class ExplicitScheduleFree(torch.optim.Optimizer):
    """Schedule-Free as written in the paper, keeping x and z: y = (1-beta) z + beta x with the beta of each step.

    The reference for schedules that change beta (the package's in-place update assumes it constant). `place_y` puts y
    for the current beta in the parameters, before the gradient is taken; `eval_weights` gives x."""
    def __init__(self, params, lr, mom=0.9, wd=0., warmup_steps=0, r=0., weight_lr_power=2., sqr_mom=None, eps=1e-8):
        super().__init__(params, dict(lr=lr, mom=mom, wd=wd, warmup_steps=warmup_steps, r=r,
                                      weight_lr_power=weight_lr_power, sqr_mom=sqr_mom, eps=eps))
        for group in self.param_groups: group.update(k=0, lr_max=-1., weight_sum=0.)

    def eval_weights(self):
        for group in self.param_groups:
            for p in group['params']:
                if 'x' in self.state[p]: p.data.copy_(self.state[p]['x'])

    def place_y(self):
        for group in self.param_groups:
            for p in group['params']:
                state = self.state[p]
                if 'z' in state: p.data.copy_((1 - group['mom']) * state['z'] + group['mom'] * state['x'])

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group['k'] += 1
            k, lr = group['k'], group['lr'] * (min(1., group['k'] / group['warmup_steps']) if group['warmup_steps'] else 1.)
            group['lr_max'] = max(lr, group['lr_max'])
            weight = k ** group['r'] * group['lr_max'] ** group['weight_lr_power']
            group['weight_sum'] += weight
            c = weight / group['weight_sum']
            for p in group['params']:
                if p.grad is None: continue
                state = self.state[p]
                if 'z' not in state: state.update(z=p.detach().clone(), x=p.detach().clone(), v=torch.zeros_like(p))
                grad = p.grad.clone()
                if group['sqr_mom'] is not None:
                    state['v'].mul_(group['sqr_mom']).addcmul_(grad, grad, value=1 - group['sqr_mom'])
                    grad /= (state['v'] / (1 - group['sqr_mom'] ** k)).sqrt() + group['eps']
                grad += group['wd'] * p
                state['z'] -= lr * grad
                state['x'] = (1 - c) * state['x'] + c * state['z']
        self.place_y()


def explicit_schedule_free(info, setting, param_lists):
    sqr_mom = setting.get('sqr_mom', 0.999) if info.make.__name__ == 'ScheduleFreeAdamW' else None
    return [ExplicitScheduleFree(groups(param_lists, setting), sqr_mom=sqr_mom, **setting)]


def changed(steps):
    "The hyper-parameters that took more than one value during the recorded steps."
    names = {name for _, _, hypers in steps for h in hypers for name in h}
    return {name for name in names if len({h.get(name) for _, _, hypers in steps for h in hypers}) > 1}


def fit_one_cycle(learn): learn.fit_one_cycle(2, 1e-2)
def fit_flat_cos(learn): learn.fit_flat_cos(2, 1e-2)
def fit_sgdr(learn): learn.fit_sgdr(1, 2)
def param_scheduler(learn):
    scheds = {'lr': partial(annealing_cos, 1e-2, 1e-3)}
    if 'mom' in learn.opt.hypers[0]: scheds['mom'] = partial(annealing_cos, 0.8, 0.9)
    learn.fit(2, cbs=[ParamScheduler(scheds)])
def torch_one_cycle(learn):
    scheduler = torch.optim.lr_scheduler.OneCycleLR(learn.opt, max_lr=1e-2, total_steps=9, cycle_momentum=True)
    learn.fit(2, cbs=[TorchScheduler(scheduler)])

SCHEDULES = [fit_one_cycle, fit_flat_cos, fit_sgdr, param_scheduler, torch_one_cycle]


@pytest.mark.float32
@pytest.mark.parametrize('schedule', SCHEDULES, ids=lambda s: s.__name__)
@pytest.mark.parametrize('name, i', FIRST_SETTINGS)
def test_every_schedule_trains_as_the_reference_or_is_refused(name, i, schedule):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    probe = Probe()
    learn = shapes_learner(info, setting, cbs=[probe])
    learn.create_opt()
    before = [p.detach().clone() for p in learn.model.parameters()]
    try: schedule(learn)
    except (ValueError, TypeError) as refusal:  # refused: before the fit changed anything
        assert str(refusal) and same_bits(before, learn.model.parameters()) and len(learn.opt.state) == 0
        return
    assert len(probe.steps) == 8
    group_of = {id(p): g for g, group in enumerate(learn.opt.param_groups) for p in group['params']}
    ours_group = [group_of[id(p)] for p in learn.model.parameters()]
    moms = {h['mom'] for _, _, hypers in probe.steps for h in hypers if 'mom' in h}
    schedule_free = isinstance(learn.opt, ScheduleFreeOptimizer)
    if schedule_free and len(moms) > 1:  # beta changed: the reference is Schedule-Free written out with x and z
        make_opts, limit = partial(explicit_schedule_free, info, setting), 1e-10
    elif reference(info, setting, halves(make_params(info))) is not None and changed(probe.steps) <= set(info.reference_schedules):
        make_opts = partial(reference, info, setting)
        limit = tolerance(info.reference_tolerance, setting, shapes_of(info))
    else:  # no reference: the callbacks, given the values the fit used
        make_opts = lambda lists: as_list(build(info, setting, lists, fast=False))
        limit = tolerance(info.fast_tolerance, setting, shapes_of(info))
    model, opts = replayed(info, setting, probe.steps, make_opts, ours_group)
    if schedule_free:  # compare the averages x: the weights a fit leaves, and evaluates
        for opt in opts: opt.eval_weights() if isinstance(opt, ExplicitScheduleFree) else opt.eval()
    assert max_diff(learn.model.parameters(), model.parameters()) <= limit


@pytest.mark.parametrize('name, i', FIRST_SETTINGS)
def test_lr_find_leaves_the_learner_as_it_was(name, i):
    info, setting = OPTIMIZERS[name], OPTIMIZERS[name].settings[i]
    learn = shapes_learner(info, setting)
    learn.fit(1)
    weights, state = [p.detach().clone() for p in learn.model.parameters()], state_tensors(learn.opt)
    learn.lr_find(num_it=6, show_plot=False)
    assert same_bits(weights, learn.model.parameters())
    after = state_tensors(learn.opt)
    assert [k for k, _ in after] == [k for k, _ in state] and all(
        torch.equal(a, b) if torch.is_tensor(a) else a == b for (_, a), (_, b) in zip(after, state))


# ---- 6. two processes

def fits_on_shards(world_size):
    "In each rank of `world_size`, every described optimizer's fit (first setting) on this rank's shard."
    results = {}
    for name in sorted(OPTIMIZERS):
        info = OPTIMIZERS[name]
        torch.set_default_dtype(torch.float64)
        learn = shapes_learner(info, info.settings[0], dls=shapes_dls(bs=8 // world_size))
        with learn.distributed(): learn.fit(2)
        results[name] = [p.detach().clone() for p in learn.model.parameters()]
    return results


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_equal_one_with_the_doubled_batch():
    ranks = run_ranks(fits_on_shards, 2, world_size=2, start_method='fork', timeout=240)
    for name in sorted(OPTIMIZERS):
        info = OPTIMIZERS[name]
        alone = shapes_learner(info, info.settings[0], dls=shapes_dls(bs=8))
        with alone.distributed(): alone.fit(2)  # a world of one: the same order of the items as the two ranks share
        assert same_bits(ranks[0][name], ranks[1][name]), name
        if info.rounding_sensitive: continue  # the ranks agree; one process may take another of equally good bases
        # float64: the two shards' gradients are summed in another order than one batch's (1e-16 a step)
        assert max_diff(ranks[0][name], alone.model.parameters()) <= 1e-10, name


# ---- 6b. two processes, each with its shards (FSDP2)

def sharded_fits(world_size):
    "In each rank, every described optimizer's fit (first setting) with the model sharded by FSDP2: the whole weights, gathered."
    from teachloop.callback.distributed import gathered
    results = {}
    for name in sorted(OPTIMIZERS):
        info = OPTIMIZERS[name]
        torch.set_default_dtype(torch.float64)
        learn = shapes_learner(info, info.settings[0], dls=shapes_dls(bs=8 // world_size), scalars=False)
        try:
            with learn.distributed(strategy='fsdp'): learn.fit(2)
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"
            continue
        # the state shaped like its parameter is cut as it is; other shapes (Adafactor's row and column factors,
        # Shampoo's preconditioners) are small and every rank keeps them whole
        state = [v for p, s in learn.opt.state.items() for v in s.values() if torch.is_tensor(v) and v.shape == p.shape]
        local = sum(getattr(v, '_local_tensor', v).numel() for v in state)
        results[name] = {'weights': [gathered(p.detach()) for p in learn.model.parameters()],
                         'state_local': local, 'state_whole': sum(v.numel() for v in state)}
    return results


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_processes_with_sharded_parameters_equal_one_with_the_doubled_batch():
    "FSDP2 on two ranks: every exported optimizer at its default settings steps its shards, equal to one process."
    ranks = run_ranks(sharded_fits, 2, world_size=2, start_method='fork', timeout=360)
    failed = {name: r for name, r in ranks[0].items() if isinstance(r, str)}
    assert not failed, failed
    for name in sorted(OPTIMIZERS):
        info = OPTIMIZERS[name]
        alone = shapes_learner(info, info.settings[0], dls=shapes_dls(bs=8), scalars=False)
        with alone.distributed(): alone.fit(2)
        sharded = ranks[0][name]
        assert same_bits(sharded['weights'], ranks[1][name]['weights']), name
        # each rank holds about half of every state tensor shaped like its parameter (odd sizes: one more row in the first)
        assert sharded['state_local'] < 0.75 * sharded['state_whole'] or not sharded['state_whole'], name
        if info.rounding_sensitive: continue
        # float64: the shards' gradients are reduce-scattered, summed in another order than one batch's
        assert max_diff(sharded['weights'], alone.model.parameters()) <= 1e-12, name
