"""Layer statistics against the same quantities taken by hand, hooks present only at ticks, a fit left unchanged,
bounded memory, and bad input refused before the fit."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.diagnostics import layer_stats as module
from teachloop.data import DataLoaders
from teachloop.learner import CancelBatchException, Callback, Learner
from teachloop.diagnostics.layer_stats import LayerStats, dead_share, saturated_share
from teachloop.optim.core import SGD
from teachloop.testing import quiet

pytestmark = pytest.mark.numeric
# float64 throughout: the callback and the reference run the same reductions on the same tensors, so they agree to
# the last bits; 1e-12 relative leaves room for a different summation order.
RTOL = 1e-12


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def batches(n, seed=0):
    torch.manual_seed(seed)
    return [(torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))) for _ in range(n)]


def learner(model, data, cbs, lr=0.1):
    return quiet(Learner(DataLoaders(data, None), model, F.cross_entropy, opt_func=SGD, lr=lr, cbs=list(cbs)))


def by_hand(model, xb, yb):
    "Outputs of layers 1 (tanh) and 3 (relu) with their gradients, and the weights' gradients, before any step."
    outputs = {}
    def keep(name):
        def hook(module, inputs, output): output.retain_grad(); outputs[name] = output
        return hook
    handles = [model[i].register_forward_hook(keep(str(i))) for i in (1, 3)]
    F.cross_entropy(model(xb), yb).backward()
    for h in handles: h.remove()
    weights = {n: (p.grad.norm().item(), (p.grad.std() / p.std()).item()) for n, p in model.named_parameters() if p.dim() >= 2}
    model.zero_grad()
    return outputs, weights


def test_statistics_equal_those_taken_by_hand():
    data = batches(1)
    model = net()
    outputs, weights = by_hand(copy.deepcopy(model), *data[0])
    stats = LayerStats(every=1, bins=10)
    learner(model, data, [stats]).fit(1)
    tick = stats.ticks[0]
    layers = {e['layer']: e for e in tick['layers']}
    assert sorted(layers) == ['1', '3'] and tick['step'] == 0
    tanh_out, relu_out = outputs['1'], outputs['3']
    assert layers['1']['saturated'] == pytest.approx((tanh_out.abs() > 0.97).double().mean().item(), rel=RTOL)
    assert layers['3']['dead'] == pytest.approx(1 - (relu_out > 0).any(dim=0).double().mean().item(), rel=RTOL)
    for name, out in outputs.items():
        assert layers[name]['mean'] == pytest.approx(out.mean().item(), rel=RTOL)
        assert layers[name]['std'] == pytest.approx(out.std().item(), rel=RTOL)
        assert layers[name]['grad_std'] == pytest.approx(out.grad.std().item(), rel=RTOL)
        for key, values in (('hist', out), ('grad_hist', out.grad)):
            counts, (lo, hi) = layers[name][key]
            reference, _ = np.histogram(values.detach().numpy(), bins=10, range=(values.min().item(), values.max().item()))
            assert counts.tolist() == reference.tolist() and lo.item() == values.min().item()
    for name, (norm, ratio) in weights.items():
        assert tick['weights'][name]['grad_norm'] == pytest.approx(norm, rel=RTOL)
        assert tick['weights'][name]['grad_to_data'] == pytest.approx(ratio, rel=RTOL)


def test_hooks_live_only_during_a_tick_and_the_fit_is_unchanged():
    data = batches(5)
    watched_model, plain_model = net(), net()

    class HookCount(Callback):
        order = 70
        def before_fit(self): self.counts = []
        def after_batch(self): self.counts.append(sum(len(m._forward_hooks) for m in self.model.modules()))
    count = HookCount()
    stats = LayerStats(every=2)
    learner(watched_model, data, [stats, count]).fit(2)
    learner(plain_model, data, []).fit(2)
    assert [t['step'] for t in stats.ticks] == [0, 2, 4, 6, 8]
    assert count.counts == [0] * 10  # removed after each tick's backward, before the batch ends
    assert all(torch.equal(a, b) for a, b in zip(watched_model.state_dict().values(), plain_model.state_dict().values()))


def test_memory_is_bounded_and_a_cancelled_tick_leaves_no_hook():
    class CancelAt(Callback):
        def after_pred(self):
            if self.train_iter == 3: raise CancelBatchException()
    model = net()
    stats = LayerStats(every=1, max_ticks=3)
    learner(model, batches(6), [stats, CancelAt()]).fit(1)
    assert [t['step'] for t in stats.ticks] == [2, 4, 5]  # the last three; the cancelled batch 3 gave none
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_shares_by_definition():
    relu, sigmoid = nn.ReLU(), nn.Sigmoid()
    a = torch.tensor([[0., 1., 0.], [0., 2., -0.]], dtype=torch.float64)
    assert dead_share(relu, a).item() == pytest.approx(2 / 3, rel=RTOL)
    conv_out = torch.zeros(2, 4, 3, 3, dtype=torch.float64); conv_out[1, 2, 0, 0] = 1.  # channel 2 fires once
    assert dead_share(relu, conv_out).item() == pytest.approx(3 / 4, rel=RTOL)
    s = torch.tensor([0.999, 0.5, 0.001, 0.9], dtype=torch.float64)
    assert saturated_share(sigmoid, s).item() == 0.5 and saturated_share(relu, s) is None


def test_bad_input_is_refused_before_the_fit():
    for bad in ({'every': 0}, {'bins': 1}, {'max_ticks': 0}):
        with pytest.raises(ValueError, match=next(iter(bad))): LayerStats(**bad)
    model = net()
    start = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="no modules named \\['body'\\]"):
        learner(model, batches(1), [LayerStats(modules=['body'])]).fit(1)
    linear_only = nn.Sequential(nn.Linear(4, 3)).double()
    with pytest.raises(ValueError, match='no tanh, sigmoid or ReLU-like layers'):
        learner(linear_only, batches(1), [LayerStats()]).fit(1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), start.values()))
    watched = LayerStats(modules=['2'], every=1)  # any module by name, here a Linear
    learner(model, batches(1), [watched]).fit(1)
    assert [e['layer'] for e in watched.ticks[0]['layers']] == ['2'] and watched.ticks[0]['layers'][0]['dead'] is None


def test_no_host_reads_between_ticks(host_reads):
    reads, per_batch = host_reads(module), []

    class Probe(Callback):
        order = 100
        def after_batch(self): per_batch.append(len(reads))
    learner(net(), batches(8), [LayerStats(every=4), Probe()]).fit(1)
    new_reads = [b - a for a, b in zip([0] + per_batch, per_batch)]
    assert [i for i, n in enumerate(new_reads) if n] == [0, 4], new_reads  # the host waits at ticks only
    assert new_reads[0] == new_reads[4] == 3  # summaries, histogram counts, histogram ranges: one transfer each


class TwiceReLU(nn.Module):
    "One ReLU called twice in a forward, as torchvision's BasicBlock calls its `relu`: after a layer and after a sum."
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.relu, self.head = nn.Linear(4, 8), nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 3)
    def forward(self, x): return self.head(self.relu(self.fc2(self.relu(self.fc1(x))) + x[:, :3]))


def each_call_by_hand(model, xb, yb):
    "The outputs of every call of `model.relu`, in call order, with their gradients."
    outputs = []
    def keep(module, inputs, output): output.retain_grad(); outputs.append(output)
    handle = model.relu.register_forward_hook(keep)
    F.cross_entropy(model(xb), yb).backward()
    handle.remove()
    return outputs


def test_a_module_called_twice_in_a_forward_gives_each_call_with_its_own_gradient():
    torch.manual_seed(0)
    model, data = TwiceReLU().double(), batches(1)
    first, second = each_call_by_hand(copy.deepcopy(model), *data[0])
    assert (first.numel(), second.numel()) == (128, 48)  # 16 examples of 8 units, then of 3
    stats = LayerStats(every=1, bins=10)
    learner(model, data, [stats]).fit(1)
    layers = {e['layer']: e for e in stats.ticks[0]['layers']}
    assert list(layers) == ['relu#1', 'relu#2'] and {e['module'] for e in layers.values()} == {'relu'}
    for name, out in (('relu#1', first), ('relu#2', second)):
        entry = layers[name]
        assert entry['std'] == pytest.approx(out.std().item(), rel=RTOL)
        assert entry['grad_std'] == pytest.approx(out.grad.std().item(), rel=RTOL)
        assert entry['dead'] == pytest.approx(1 - (out > 0).any(dim=0).double().mean().item(), rel=RTOL)
        assert entry['hist'][0].sum().item() == entry['grad_hist'][0].sum().item() == out.numel()
        assert entry['grad_hist'][1][0].item() == out.grad.min().item()
    assert set(stats.history('grad_std')) == {'relu#1', 'relu#2'}


def test_a_resnet_block_shows_both_of_its_relus():
    models = pytest.importorskip('torchvision.models.resnet')
    torch.manual_seed(0)
    block = models.BasicBlock(3, 3)  # its `relu` (in place) runs after bn1 and again after the sum with the input
    model = nn.Sequential(nn.Unflatten(1, (3, 2, 2)), block, nn.Flatten(), nn.Linear(12, 3)).double()
    data = [(torch.randn(16, 12, dtype=torch.float64), torch.randint(0, 3, (16,)))]
    stats = LayerStats(every=1)
    learner(model, data, [stats]).fit(1)
    assert [(e['layer'], e['module']) for e in stats.ticks[0]['layers']] == [('1.relu#1', '1.relu'), ('1.relu#2', '1.relu')]
