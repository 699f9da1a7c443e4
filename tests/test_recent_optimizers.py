"Muon, Adafactor, AdEMAMix, Schedule-Free, SOAP, NAdam and Adamax against independent implementations."
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.recent_optimizers import Adafactor, GroupedOptimizer, Muon, MuonAdamW, muon_splitter, newton_schulz
from teachloop.testing import digits_batches

N_STEPS = 40


@pytest.fixture(scope='module')
def batches(): return digits_batches(N_STEPS)


def digits_mlp(width=32, bias=True):
    "Three hidden layers, two of the same shape (for the batched Newton-Schulz), and a head."
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width, bias=bias), nn.ReLU(), nn.Linear(width, width, bias=bias),
                         nn.ReLU(), nn.Linear(width, width, bias=bias), nn.ReLU(), nn.Linear(width, 10, bias=bias))


def train(model, opts, batches):
    for xb, yb in batches:
        F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb).backward()
        for opt in opts: opt.step()
        for opt in opts: opt.zero_grad()


def max_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# ---- Muon

@pytest.mark.numeric
@pytest.mark.parametrize('shape', [(32, 32), (16, 48), (48, 16)])
def test_newton_schulz_is_torchs_bit_for_bit_single_and_batched(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz
    torch.manual_seed(0)
    matrices = torch.randn(3, *shape, dtype=torch.float64)
    theirs = torch.stack([_zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7) for m in matrices])
    assert torch.equal(torch.stack([newton_schulz(m) for m in matrices]), theirs)
    # The batched call runs the same bfloat16 products as one baddbmm; on the CPUs tried it gives the same bits. If a
    # kernel summed in another order, one rounding of a bfloat16 entry (relative 2**-8, entries below 1.3) is the
    # most that could differ.
    assert (newton_schulz(matrices).double() - theirs.double()).abs().max() <= 1.3 * 2 ** -8


@pytest.mark.numeric
@pytest.mark.parametrize('adjust_lr', ['original', 'match_rms_adamw', 'spectral_unclamped'])
@pytest.mark.parametrize('nesterov', [True, False])
@pytest.mark.parametrize('fast', [False, True])
def test_muon_matches_torch(adjust_lr, nesterov, fast, batches):
    # Without biases every parameter is a matrix. In float64 the only rounding is the bfloat16 Newton-Schulz, which
    # both run with the same operations: the weights agree exactly after 40 steps (0 tolerance, no reordering).
    start = digits_mlp(bias=False).double()
    ours, theirs = copy.deepcopy(start), copy.deepcopy(start)
    train(ours, [Muon(ours.parameters(), lr=0.02, wd=0.01, nesterov=nesterov, adjust_lr=adjust_lr, fast=fast)], batches)
    train(theirs, [torch.optim.Muon(theirs.parameters(), lr=0.02, weight_decay=0.01, nesterov=nesterov,
                                    adjust_lr_fn=adjust_lr)], batches)
    assert max_diff(ours, theirs) == 0 and max_diff(ours, start) > 1e-2


@pytest.mark.numeric
@pytest.mark.parametrize('fast', [False, True])
def test_muon_adamw_matches_torch_muon_beside_torch_adamw(fast, batches):
    start = digits_mlp().double()
    ours, theirs = copy.deepcopy(start), copy.deepcopy(start)
    opt = MuonAdamW(muon_splitter(ours), lr=3e-3, wd=0.05, fast=fast)
    train(ours, [opt], batches)
    muon, adamw = muon_splitter(theirs)
    train(theirs, [torch.optim.Muon(muon['params'], lr=3e-3, weight_decay=0.05, adjust_lr_fn='match_rms_adamw'),
                   torch.optim.AdamW(adamw['params'], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)], batches)
    # AdamW's fused kernel and torch's for-loop AdamW round float64 differently in the last bits
    assert max_diff(ours, theirs) <= 1e-12 and max_diff(ours, start) > 1e-2
    for p in ours.parameters(): p.grad = torch.zeros_like(p)
    for group in opt.param_groups: assert (opt.fast_step_for(group['params'], group) is not None) == fast


def test_muon_splitter_gives_hidden_matrices_to_muon_and_the_rest_to_adamw():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 3))
    muon, adamw = muon_splitter(model)
    assert (muon['kind'], adamw['kind']) == ('muon', 'adamw')
    assert [p is q for p, q in zip(muon['params'], [model[1].weight, model[3].weight])] == [True, True]
    assert len(muon['params']) == 2 and len(adamw['params']) == len(list(model.parameters())) - 2


@pytest.mark.parametrize('make, message', [
    (lambda: Muon([nn.Parameter(torch.zeros(3))]), r"shape \(3,\).*muon_splitter"),
    (lambda: Muon([nn.Parameter(torch.zeros(2, 2, 3, 3))]), r"shape \(2, 2, 3, 3\)"),
    (lambda: Muon([nn.Parameter(torch.zeros(2, 2))], adjust_lr='rms'), "adjust_lr must be one of"),
    (lambda: Muon([nn.Parameter(torch.zeros(2, 2))], ns_steps=0), "ns_steps"),
    (lambda: Muon([nn.Parameter(torch.zeros(2, 2))], ns_steps=100), "ns_steps"),
    (lambda: Muon([nn.Parameter(torch.zeros(2, 2))], mom=1.), "mom"),
    (lambda: MuonAdamW(nn.Linear(2, 2).parameters()), "muon_splitter"),
    (lambda: MuonAdamW([{'params': [nn.Parameter(torch.zeros(2, 2))], 'kind': 'sgd'}]), "'kind'"),
    (lambda: MuonAdamW([{'params': [nn.Parameter(torch.zeros(2))], 'kind': 'muon'}]), "shape"),
])
def test_muon_refuses_bad_input_at_construction(make, message):
    with pytest.raises(ValueError, match=message): make()


def test_muon_adamw_from_a_learner_saves_and_loads(tmp_path):
    from teachloop.data import digits_dls
    from teachloop.learner import Learner
    learn = Learner(digits_dls(bs=64), digits_mlp(), F.cross_entropy, opt_func=MuonAdamW, splitter=muon_splitter, lr=3e-3)
    learn.progress.show_bar = learn.progress.print_rows = False
    learn.fit(1)
    assert isinstance(learn.opt, GroupedOptimizer) and learn.recorder.values[-1][1] < 2.3
    path = learn.save(tmp_path / 'muon.pt')
    other = Learner(digits_dls(bs=64), digits_mlp(), F.cross_entropy, opt_func=MuonAdamW, splitter=muon_splitter)
    other.load(path)
    p = learn.model[3].weight
    assert torch.equal(other.opt.state[other.model[3].weight]['grad_avg'], learn.opt.state[p]['grad_avg'])
    assert [g['kind'] for g in other.opt.param_groups] == ['muon', 'adamw']


# ---- Adafactor

def digits_cnn_double():
    from teachloop.data import digits_cnn
    torch.manual_seed(0)
    return digits_cnn().double()  # 4-D filters (factored over their last two dimensions), biases, a head


@pytest.mark.numeric
@pytest.mark.parametrize('hypers', [{}, {'lr': 3e-3, 'wd': 0.1, 'd': 2.}, {'eps1': 1e-30, 'eps2': 1e-2, 'beta2_decay': -0.5}])
@pytest.mark.parametrize('fast', [False, True])
def test_adafactor_matches_torch(hypers, fast, batches):
    start = digits_cnn_double()
    ours, theirs = copy.deepcopy(start), copy.deepcopy(start)
    train(ours, [Adafactor(ours.parameters(), fast=fast, **hypers)], batches)
    renamed = {{'wd': 'weight_decay'}.get(k, k): v for k, v in hypers.items() if k not in ('eps1', 'eps2')}
    eps = (hypers.get('eps1'), hypers.get('eps2', 1e-3))
    train(theirs, [torch.optim.Adafactor(theirs.parameters(), eps=eps, foreach=fast, **renamed)], batches)
    # float64; torch reads the step size back to the host and applies it with `add_(alpha=)`, we keep it a tensor and
    # multiply: each rounds once per operation at 1e-16, and 40 steps leave the weights within 1e-12 of each other,
    # while any real difference (a misplaced weight decay, clipping, t**-0.8) moves them by more than 1e-6
    assert max_diff(ours, theirs) <= 1e-12 and max_diff(ours, start) > 1e-3


def test_adafactor_keeps_rows_and_columns():
    w = nn.Parameter(torch.randn(5, 7))
    opt = Adafactor([w])
    w.grad = torch.randn(5, 7)
    opt.step()
    assert opt.state[w]['row_var'].shape == (5, 1) and opt.state[w]['col_var'].shape == (1, 7)
    for bad in ({'beta2_decay': 0.5}, {'d': 0.5}, {'eps1': -1.}, {'eps2': -1.}):
        with pytest.raises(ValueError): Adafactor([w], **bad)
