"""Fine-tuning (notebook 09a): the head found in torchvision's and timm's networks (built without weights: nothing is
downloaded), the two groups of `backbone_splitter`, fastai's `create_head`, `replace_head`, and the freeze /
discriminative-rate workflow with the body's batch normalisations training while it is frozen (`train_bn`)."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.callback.core import accuracy
from teachloop.data import load_digits_tensors, tensor_dls
from teachloop.fine_tune import (AdaptiveConcatPool2d, SigmoidRange, backbone_splitter, create_head, head_names,
                                 last_layer, replace_head)
from teachloop.learner import Callback, Learner
from teachloop.optim.interop import norm_params
from teachloop.random_state import set_seed
from teachloop.testing import quiet

torchvision = pytest.importorskip('torchvision')
timm = pytest.importorskip('timm')

SMALL_VIT = dict(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)
# (how to build it, the children that make its head: read from the architecture's source)
NETWORKS = {
    'tv resnet18': (lambda: torchvision.models.resnet18(num_classes=7), ['fc']),
    'tv mobilenet_v3_small': (lambda: torchvision.models.mobilenet_v3_small(num_classes=7), ['classifier']),
    'tv efficientnet_b0': (lambda: torchvision.models.efficientnet_b0(num_classes=7), ['classifier']),
    'tv densenet121': (lambda: torchvision.models.densenet121(num_classes=7), ['classifier']),
    'tv shufflenet_v2_x0_5': (lambda: torchvision.models.shufflenet_v2_x0_5(num_classes=7), ['fc']),
    'tv squeezenet1_1': (lambda: torchvision.models.squeezenet1_1(num_classes=7), ['classifier']),  # a conv head
    'tv vit': (lambda: torchvision.models.VisionTransformer(num_classes=7, **SMALL_VIT), ['heads']),
    'timm resnet18': (lambda: timm.create_model('resnet18', num_classes=7), ['fc']),
    'timm efficientnet_b0': (lambda: timm.create_model('efficientnet_b0', num_classes=7), ['classifier']),
    'timm convnext_atto': (lambda: timm.create_model('convnext_atto', num_classes=7), ['head']),
    'timm vit_tiny_patch16_224': (lambda: timm.create_model('vit_tiny_patch16_224', num_classes=7), ['head']),
    'timm mobilenetv3_small_050': (lambda: timm.create_model('mobilenetv3_small_050', num_classes=7), ['classifier']),
    'timm levit_128s': (lambda: timm.create_model('levit_128s', num_classes=7), ['head', 'head_dist']),  # two heads
}


@pytest.mark.parametrize('name', NETWORKS)
def test_the_head_is_found_in_torchvision_and_timm_networks(name):
    make, expected = NETWORKS[name]
    model = make()
    assert head_names(model) == expected
    last = model.get_submodule(last_layer(model))
    assert getattr(last, 'out_features', getattr(last, 'out_channels', None)) == 7  # the layer of the classes


@pytest.mark.parametrize('name', NETWORKS)
def test_the_splitter_makes_the_body_and_the_head_of_every_parameter_once(name):
    make, expected = NETWORKS[name]
    model = make()
    body, head = backbone_splitter(model)
    assert body and head and len({id(p) for p in body + head}) == len(body) + len(head)
    assert {id(p) for p in body + head} == {id(p) for p in model.parameters()}
    assert {id(p) for p in head} == {id(p) for n in expected for p in model.get_submodule(n).parameters()}


def test_a_models_own_parameters_go_to_the_body():
    "A ViT's class token and position embeddings are the model's own: no child holds them."
    model = timm.create_model('vit_tiny_patch16_224', num_classes=7)
    body, _ = backbone_splitter(model)
    assert {id(model.cls_token), id(model.pos_embed)} <= {id(p) for p in body}


def test_a_model_that_is_all_head_is_refused_with_what_to_do():
    wrapped = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    with pytest.raises(ValueError, match='splitter of your own'): backbone_splitter(wrapped)
    with pytest.raises(ValueError, match='no parameters'): head_names(nn.Sequential(nn.ReLU()))


def test_create_head_has_fastais_layers():
    "fastai 2.8's create_head(512, 7): concat pool, flatten, [BN, dropout 0.25, Linear, ReLU], [BN, dropout 0.5, Linear]."
    head = create_head(512, 7)
    assert [type(m).__name__ for m in head] == ['AdaptiveConcatPool2d', 'Flatten', 'BatchNorm1d', 'Dropout', 'Linear',
                                                'ReLU', 'BatchNorm1d', 'Dropout', 'Linear']
    assert [m.p for m in head if isinstance(m, nn.Dropout)] == [0.25, 0.5]
    linears = [m for m in head if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features, m.bias) for m in linears] == [(1024, 512, None), (512, 7, None)]
    plain = create_head(64, 3, lin_ftrs=[], ps=0., pool=False, first_bn=False, y_range=(0, 5))
    assert [type(m).__name__ for m in plain] == ['Linear', 'SigmoidRange'] and plain[0].bias is not None
    with pytest.raises(ValueError, match='one per block'): create_head(64, 3, ps=[0.1, 0.2, 0.3])


def test_the_concat_pool_is_the_maximum_and_the_mean_and_the_range_a_scaled_sigmoid():
    x = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    pooled = AdaptiveConcatPool2d()(x)
    assert torch.equal(pooled[:, :5, 0, 0], x.flatten(2).max(-1).values)
    assert torch.allclose(pooled[:, 5:, 0, 0], x.flatten(2).mean(-1), rtol=1e-15, atol=0)
    y = SigmoidRange(-1, 3)(x)
    assert torch.allclose(y, torch.sigmoid(x) * 4 - 1) and y.min() > -1 and y.max() < 3


@pytest.mark.parametrize('name', ['tv resnet18', 'tv mobilenet_v3_small', 'timm convnext_atto', 'tv vit'])
def test_replace_head_swaps_the_last_layer_and_keeps_every_other_weight(name):
    model = NETWORKS[name][0]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replaced = last_layer(model)
    replace_head(model, 4, lin_ftrs=[16])
    kept = {k: v for k, v in model.state_dict().items() if k in before}
    assert all(torch.equal(v, before[k]) for k, v in kept.items())
    assert set(before) - set(kept) == {f'{replaced}.weight', f'{replaced}.bias'}
    size = 224 if name.startswith('timm') else 32
    model.eval()
    assert model(torch.randn(2, 3, size, size)).shape == (2, 4)


def test_replace_head_refuses_what_it_cannot_replace():
    with pytest.raises(ValueError, match='is a Conv2d, not a Linear'): replace_head(NETWORKS['tv squeezenet1_1'][0](), 4)
    with pytest.raises(ValueError, match=r'reset_classifier\(n_out\)'): replace_head(NETWORKS['timm levit_128s'][0](), 4)


def digits_images(n=160):
    "The first `n` digits, upsampled to 32 pixels in three channels, with their labels."
    x, y = load_digits_tensors()
    return F.interpolate(x[:n], size=32, mode='bilinear', align_corners=False).repeat(1, 3, 1, 1), y[:n]


def resnet_learner(train_bn=True, opt_func=None):
    set_seed(0)
    x, y = digits_images()
    model = replace_head(torchvision.models.resnet18(num_classes=10), 10)
    kwargs = {} if opt_func is None else {'opt_func': opt_func}
    return quiet(Learner(tensor_dls(x, y, bs=32), model, F.cross_entropy, splitter=backbone_splitter,
                         train_bn=train_bn, metrics=[accuracy], **kwargs))


def changed(model, before, names):
    return {n for n in names if not torch.equal(model.state_dict()[n], before[n])}


@pytest.mark.parametrize('train_bn', [True, False])
def test_frozen_the_body_keeps_every_weight_but_its_batch_norms_which_train_with_train_bn(train_bn):
    learn = resnet_learner(train_bn)
    model = learn.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bn_layers = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    bn_affine = {f'{n}.{p}' for n in bn_layers for p in ('weight', 'bias')}
    bn_stats = {f'{n}.{s}' for n in bn_layers for s in ('running_mean', 'running_var')}
    convs = {f'{n}.weight' for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    head = {k for k in before if k.startswith('fc.') and 'num_batches' not in k}
    learn.freeze()
    assert {id(p) for p in model.parameters() if p.requires_grad} == \
        {id(p) for p in model.fc.parameters()} | ({id(p) for p in norm_params(model)} if train_bn else set())
    learn.fit_one_cycle(1, slice(1e-2))
    assert changed(model, before, convs) == set()  # Adam's decoupled weight decay included: no gradient, no step
    assert changed(model, before, bn_affine) == (bn_affine if train_bn else set())
    assert changed(model, before, bn_stats) == bn_stats  # train() mode: the statistics follow the data either way
    assert changed(model, before, head) == head
    learn.unfreeze()
    assert all(p.requires_grad for p in model.parameters())


class GroupRates(Callback):
    def before_fit(self): self.rates, self.trainable = [], [all(p.requires_grad for p in g) for g in
                                                            backbone_splitter(self.learn.model)]
    def after_batch(self):
        if self.learn.training: self.rates.append([h['lr'] for h in self.learn.opt.hypers])


def test_one_cycle_with_a_slice_gives_the_body_its_lower_rate_at_every_batch():
    learn = resnet_learner()
    rates = GroupRates()
    learn.fit_one_cycle(2, lr_max=slice(1e-5, 1e-3), cbs=[rates])
    assert all(math.isclose(head / body, 100) for body, head in rates.rates)
    peak = max(rates.rates, key=lambda r: r[1])
    assert math.isclose(peak[1], 1e-3, rel_tol=1e-2) and math.isclose(peak[0], 1e-5, rel_tol=1e-2)


def test_fine_tune_trains_the_head_alone_then_everything_at_fastais_rates(monkeypatch):
    "fastai's fine_tune(2, 1e-2): one cycle at slice(1e-2) frozen (pct_start 0.99), then two at slice(5e-5, 5e-3)."
    learn = resnet_learner()
    calls, plain = [], Learner.fit_one_cycle
    @functools.wraps(plain)  # the schedule reads the signature of the method called
    def recorded(self, n_epoch, lr_max=None, **kwargs):
        body, head = backbone_splitter(self.model)
        calls.append((n_epoch, lr_max, kwargs, all(p.requires_grad for p in body), all(p.requires_grad for p in head)))
        return plain(self, n_epoch, lr_max, **kwargs)
    monkeypatch.setattr(Learner, 'fit_one_cycle', recorded)
    rates = GroupRates()
    learn.fine_tune(2, 1e-2, cbs=[rates])
    assert calls == [(1, slice(1e-2), {'pct_start': 0.99, 'cbs': [rates]}, False, True),
                     (2, slice(5e-5, 5e-3), {'pct_start': 0.3, 'div': 5.0, 'cbs': [rates]}, True, True)]
    assert len(rates.rates) == 2 * len(learn.dls.train) and len(learn.recorder.values) == 2  # the second fit's
    assert all(math.isclose(head / body, 100) for body, head in rates.rates)
