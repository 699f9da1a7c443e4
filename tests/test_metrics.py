"""fastai's metrics (notebook 05c): each described once below, with the outputs it takes and an independent reference
(scikit-learn, or the formula in numpy), and checked by one battery: on random data of the whole set, in a fit whose
validation batches are uneven, on two processes, and given outputs it cannot mean."""
import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import pytest
import torch
from scipy.special import expit, softmax
from sklearn import metrics as skm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import teachloop.metrics as metrics
from teachloop.callback.core import AccumMetric, accuracy
from teachloop.callback.tracker import monitor_mode
from teachloop.data import DataLoaders
from teachloop.learner import Learner
from teachloop.metrics import (BalancedAccuracy, CheckedMetric, ExplainedVariance, F1Score, F1ScoreMulti,
                               MatthewsCorrCoef, MatthewsCorrCoefMulti, Perplexity, Precision, PrecisionMulti, R2Score,
                               Recall, RecallMulti, RocAuc, RocAucBinary, RocAucMulti, accuracy_multi, error_rate, mae,
                               msle, mse, rmse, skm_to_fastai, top_k_accuracy)
from teachloop.testing import quiet

N = 203  # odd: uneven batches of 16, and shares of 102 and 101 items on two processes


def outputs(kind, seed=0):
    "Random predictions and targets of `kind`, in float64 (the predictions) as a model would give them."
    g = torch.Generator().manual_seed(seed)
    if kind == 'classes': return torch.randn(N, 5, dtype=torch.float64, generator=g), torch.randint(0, 5, (N,), generator=g)
    if kind == 'binary': return torch.randn(N, 2, dtype=torch.float64, generator=g), torch.randint(0, 2, (N,), generator=g)
    if kind == 'one output':
        target = torch.randint(0, 2, (N,), generator=g)
        return (target - 0.5 + torch.randn(N, dtype=torch.float64, generator=g))[:, None], target
    if kind == 'labels':
        return torch.randn(N, 4, dtype=torch.float64, generator=g), torch.randint(0, 2, (N, 4), generator=g).double()
    assert kind == 'values'  # positive, for msle
    target = torch.rand(N, dtype=torch.float64, generator=g) * 10
    return (target + torch.randn(N, dtype=torch.float64, generator=g)).abs()[:, None], target


KINDS = ('classes', 'binary', 'one output', 'labels', 'values')


@dataclass
class Described:
    make: Callable  # a new metric (or the one object, for rmse)
    kind: str  # the outputs its reference is checked on
    reference: Callable  # reference(pred, target) on numpy arrays, independent of teachloop
    takes: tuple = ()  # the other kinds it also takes (its outputs cannot be told from a meaningful case)


def picked(p): return p.argmax(-1)
def on(p, thresh=0.5): return expit(p) >= thresh  # fastai's AccumMetric thresholds with >=
def classes_of(score): return lambda p, t: score(t, picked(p))
def labels_of(score): return lambda p, t: score(t, on(p))


def described_averages(name, make, score, kind, **more):
    return {f"{name}, {a}": Described(partial(make, average=a), kind, labels_of(partial(score, average=a)) if
                                      kind == 'labels' else classes_of(partial(score, average=a)), **more)
            for a in ('macro', 'micro', 'weighted')}


METRICS = {
    'accuracy': Described(lambda: accuracy, 'classes', classes_of(skm.accuracy_score), ('binary',)),
    'error_rate': Described(lambda: error_rate, 'classes', lambda p, t: 1 - skm.accuracy_score(t, picked(p)), ('binary',)),
    'top_k_accuracy': Described(lambda: partial(top_k_accuracy, k=2), 'classes',
                                lambda p, t: skm.top_k_accuracy_score(t, p, k=2, labels=range(5))),
    'BalancedAccuracy': Described(BalancedAccuracy, 'classes', classes_of(skm.balanced_accuracy_score), ('binary',)),
    **described_averages('Precision', Precision, skm.precision_score, 'classes', takes=('binary',)),
    **described_averages('Recall', Recall, skm.recall_score, 'classes', takes=('binary',)),
    **described_averages('F1Score', F1Score, skm.f1_score, 'classes', takes=('binary',)),
    'Precision, binary': Described(Precision, 'binary', classes_of(skm.precision_score)),
    'Recall, binary': Described(Recall, 'binary', classes_of(skm.recall_score)),
    'F1Score, binary': Described(F1Score, 'binary', classes_of(skm.f1_score)),
    'MatthewsCorrCoef': Described(MatthewsCorrCoef, 'classes', classes_of(skm.matthews_corrcoef), ('binary',)),
    'MatthewsCorrCoef, binary': Described(MatthewsCorrCoef, 'binary', classes_of(skm.matthews_corrcoef), ('classes',)),
    'RocAuc': Described(RocAuc, 'classes', lambda p, t: skm.roc_auc_score(t, softmax(p, axis=-1), multi_class='ovr')),
    'RocAucBinary': Described(RocAucBinary, 'binary', lambda p, t: skm.roc_auc_score(t, softmax(p, axis=-1)[:, 1]),
                              ('one output',)),
    'RocAucBinary, one output': Described(RocAucBinary, 'one output', lambda p, t: skm.roc_auc_score(t, p[:, 0]),
                                          ('binary',)),
    'Perplexity': Described(Perplexity, 'classes', lambda p, t: math.exp(skm.log_loss(t, softmax(p, axis=-1),
                                                                                      labels=range(5))), ('binary',)),
    # a plain mean over the items cannot tell targets of 0 and 1 from a regression's values by their shapes, and
    # reading the values would make the device wait at every batch: it takes them
    'accuracy_multi': Described(lambda: accuracy_multi, 'labels', lambda p, t: np.mean((expit(p) > 0.5) == t),
                                ('one output', 'values')),
    'accuracy_multi, one output': Described(lambda: partial(accuracy_multi, thresh=0.4), 'one output',
                                            lambda p, t: np.mean((expit(p[:, 0]) > 0.4) == t), ('labels', 'values')),
    **described_averages('PrecisionMulti', PrecisionMulti, skm.precision_score, 'labels', takes=('one output',)),
    **described_averages('RecallMulti', RecallMulti, skm.recall_score, 'labels', takes=('one output',)),
    **described_averages('F1ScoreMulti', F1ScoreMulti, skm.f1_score, 'labels', takes=('one output',)),
    'F1ScoreMulti, binary': Described(partial(F1ScoreMulti, average='binary'), 'one output',
                                      lambda p, t: skm.f1_score(t, on(p[:, 0]))),
    'PrecisionMulti, binary': Described(partial(PrecisionMulti, average='binary', thresh=0.3), 'one output',
                                        lambda p, t: skm.precision_score(t, on(p[:, 0], 0.3))),
    'RecallMulti, binary': Described(partial(RecallMulti, average='binary'), 'one output',
                                     lambda p, t: skm.recall_score(t, on(p[:, 0]))),
    'MatthewsCorrCoefMulti': Described(MatthewsCorrCoefMulti, 'one output',
                                       lambda p, t: skm.matthews_corrcoef(t, on(p[:, 0]))),
    'RocAucMulti': Described(RocAucMulti, 'labels', lambda p, t: skm.roc_auc_score(t, expit(p)), ('one output',)),
    'RocAucMulti, one output': Described(RocAucMulti, 'one output', lambda p, t: skm.roc_auc_score(t, p[:, 0]),
                                         ('labels',)),
    'mse': Described(lambda: mse, 'values', lambda p, t: skm.mean_squared_error(t, p[:, 0]), ('one output', 'labels')),
    'rmse': Described(lambda: rmse, 'values', lambda p, t: skm.root_mean_squared_error(t, p[:, 0]),
                      ('one output', 'labels')),
    'mae': Described(lambda: mae, 'values', lambda p, t: skm.mean_absolute_error(t, p[:, 0]), ('one output', 'labels')),
    'msle': Described(lambda: msle, 'values', lambda p, t: np.mean((np.log1p(p[:, 0]) - np.log1p(t)) ** 2),
                      ('one output', 'labels')),
    'R2Score': Described(R2Score, 'values', lambda p, t: skm.r2_score(t, p[:, 0]), ('one output', 'labels')),
    'ExplainedVariance': Described(ExplainedVariance, 'values', lambda p, t: skm.explained_variance_score(t, p[:, 0]),
                                   ('one output', 'labels')),
}
PUBLIC_METRICS = {'accuracy_multi', 'error_rate', 'top_k_accuracy', 'mse', 'mae', 'msle', 'rmse', 'Precision', 'Recall',
                  'F1Score', 'BalancedAccuracy', 'MatthewsCorrCoef', 'RocAuc', 'RocAucBinary', 'PrecisionMulti',
                  'RecallMulti', 'F1ScoreMulti', 'MatthewsCorrCoefMulti', 'RocAucMulti', 'R2Score', 'ExplainedVariance',
                  'Perplexity'}


def value(metric, pred, target):
    out = metric(pred, target)
    return float(out)


def reference(described, seed=0):
    pred, target = outputs(described.kind, seed)
    return described.reference(pred.numpy(), target.numpy())


def test_every_metric_of_the_module_is_described():
    described = {key.split(',')[0] for key in METRICS} - {'accuracy'}
    assert described == PUBLIC_METRICS and PUBLIC_METRICS <= set(metrics.__all__)


@pytest.mark.float32
@pytest.mark.numeric
@pytest.mark.parametrize('key', METRICS)
def test_on_the_whole_set_each_metric_is_its_reference(key):
    "float64 predictions: the metrics that are means count in float32 (accuracy), whose mean of 203 zeros and ones is "
    "within 2**-24 of the fraction; the others are scikit-learn's own arithmetic on the same numbers."
    described = METRICS[key]
    pred, target = outputs(described.kind)
    assert math.isclose(value(described.make(), pred, target), reference(described), abs_tol=1e-6)


class Lookup(nn.Module):
    "The stored predictions of the items whose indices it is given; a weight of 1, for data-parallel training to hold."
    def __init__(self, table):
        super().__init__()
        self.register_buffer('table', table)
        self.scale = nn.Parameter(torch.ones((), dtype=table.dtype))
    def forward(self, index): return self.table[index] * self.scale


def no_loss(pred, target): return (pred * 0).sum()


def lookup_learner(kind, keys, seed=0):
    "A learner whose model gives `kind`'s random predictions, validated in batches of 16 (the last of 11), with `keys`."
    pred, target = outputs(kind, seed)
    index = torch.arange(N)
    loader = DataLoader(TensorDataset(index, target), batch_size=16)
    made = []
    for key in keys:
        metric = METRICS[key].make()
        if isinstance(metric, (AccumMetric, Perplexity)) and metric is not rmse: metric.name = key  # one column each
        made.append(metric)
    return quiet(Learner(DataLoaders(loader, loader), Lookup(pred), no_loss, metrics=made))


def keys_of(kind): return [k for k, d in METRICS.items() if d.kind == kind and not k.startswith('accuracy_multi, ')]


@pytest.mark.float32
@pytest.mark.numeric
@pytest.mark.parametrize('kind', KINDS)
def test_in_a_fit_the_recorder_gives_each_metric_the_whole_sets_value(kind):
    "Uneven batches: a mean over items averaged by batch sizes, the rest over all the batches kept; the Recorder's "
    "weighted mean is taken in float32 (2**-24 relative a step)."
    keys = keys_of(kind)
    learn = lookup_learner(kind, keys)
    assert len(learn.dls.valid) == 13
    got = dict(zip(keys, learn.validate()[1:]))
    for key in keys: assert math.isclose(got[key], reference(METRICS[key]), rel_tol=1e-6, abs_tol=1e-7), key


def validate_every_kind_in_a_rank():
    "In each of two processes: each kind's learner validated on its share of the items."
    found = {}
    for kind in KINDS:
        learn = lookup_learner(kind, keys_of(kind))
        with learn.distributed(): found[kind] = learn.validate()[1:]
    return found


@pytest.mark.float32
@pytest.mark.ranks
@pytest.mark.numeric
def test_on_two_processes_each_metric_is_the_whole_sets():
    "Each process validates about half the items; gathered, the values are the whole set's (in another order: float64 "
    "sums within 1e-12, float32 means of the plain metrics within 1e-6)."
    from teachloop.callback.distributed import run_ranks
    rank0, rank1 = run_ranks(validate_every_kind_in_a_rank, world_size=2, start_method='fork', timeout=240)
    assert rank0 == rank1
    for kind in KINDS:
        for key, got in zip(keys_of(kind), rank0[kind]):
            assert math.isclose(got, reference(METRICS[key]), rel_tol=1e-6, abs_tol=1e-7), key


def weighted_in_a_rank():
    learn = lookup_learner('classes', [])
    learn.metrics = [F1Score(average='macro', sample_weight=np.ones(N))]
    try:
        with learn.distributed(): return learn.validate()
    except ValueError as e: return str(e)


@pytest.mark.ranks
def test_on_two_processes_a_sample_weight_in_the_sets_order_is_refused():
    from teachloop.callback.distributed import run_ranks
    ranks = run_ranks(weighted_in_a_rank, world_size=2, start_method='fork', timeout=120)
    assert all(isinstance(r, str) and 'sample_weight follows the validation set' in r for r in ranks), ranks
    alone = lookup_learner('classes', [])  # in one process the order is the set's: taken
    alone.metrics = [F1Score(average='macro', sample_weight=np.ones(N))]
    assert math.isclose(alone.validate()[1], reference(METRICS['F1Score, macro']), abs_tol=1e-12)


REFUSALS = [(key, kind) for key, d in METRICS.items() for kind in KINDS if kind != d.kind and kind not in d.takes]


@pytest.mark.parametrize('key, kind', REFUSALS, ids=[f"{k}-{kind}" for k, kind in REFUSALS])
def test_a_metric_given_outputs_it_cannot_mean_refuses_them_naming_what_to_do(key, kind):
    pred, target = outputs(kind)
    with pytest.raises(ValueError) as refused: value(METRICS[key].make(), pred, target)
    said = str(refused.value)
    # teachloop's own refusals (of the shapes) name the metric or the argument to use. A regression's targets given to
    # a metric of labels have the shapes of a binary classifier's: scikit-learn refuses their values when the whole
    # set's value is computed, as it refuses an average='binary' of several labels, or MCC of several labels
    theirs = r"format is not supported|can't handle a mix of|multilabel-indicator is not supported|choose another average"
    assert re.search(r"\buse \w|give ", said) or re.search(theirs, said), said


@pytest.mark.parametrize('make, pred, target, says', [
    (lambda: accuracy, torch.randn(8, 1), torch.randint(0, 2, (8,)), r'accuracy_multi\(thresh=0.5, sigmoid=True\)'),
    (lambda: error_rate, torch.randn(8), torch.randint(0, 2, (8,)), 'accuracy_multi'),
    (F1Score, torch.randn(8, 1), torch.randint(0, 2, (8,)), r'F1ScoreMulti\(\)'),
    (F1Score, torch.randn(8, 5), torch.randint(0, 5, (8,)), "average='macro', 'micro' or 'weighted'"),
    (RocAuc, torch.randn(8, 2), torch.randint(0, 2, (8,)), r'RocAucBinary\(\)'),
    (RocAucBinary, torch.randn(8, 5), torch.randint(0, 5, (8,)), r'RocAuc\(\)'),
    (MatthewsCorrCoef, torch.randn(8, 1), torch.randint(0, 2, (8,)), r'MatthewsCorrCoefMulti\(\)'),
    (F1ScoreMulti, torch.randn(8, 5), torch.randint(0, 5, (8,)), r'use F1Score\(\)'),
    (lambda: accuracy_multi, torch.randn(8, 5), torch.randint(0, 5, (8,)), 'use accuracy'),
    (lambda: rmse, torch.randn(8, 5), torch.randint(0, 5, (8,)), 'use accuracy'),
    (lambda: mse, torch.randn(8, 5), torch.randn(8, 3), '40 predictions'),
    (lambda: partial(top_k_accuracy, k=5), torch.randn(8, 5), torch.randint(0, 5, (8,)), 'give k from 1'),
    (lambda: partial(skm_to_fastai, skm.cohen_kappa_score)(), torch.randn(8, 1), torch.randint(0, 2, (8,)),
     r'skm_to_fastai\(cohen_kappa_score, thresh=0.5\)'),
])
def test_each_refusal_names_the_metric_or_argument_to_use(make, pred, target, says):
    with pytest.raises(ValueError, match=says): value(make(), pred, target)


def test_skm_to_fastai_prepares_as_fastai_and_checks_as_its_arguments_say():
    "is_class: the arg-max; thresh: a sigmoid then >= thresh; is_class=False: the values as they are."
    pred, target = outputs('classes')
    kappa = skm_to_fastai(skm.cohen_kappa_score)
    assert float(kappa(pred, target)) == skm.cohen_kappa_score(target, pred.argmax(-1))
    labels, on_off = outputs('labels')
    hamming = skm_to_fastai(skm.hamming_loss, thresh=0.3, flatten=False)
    assert float(hamming(labels, on_off)) == skm.hamming_loss(on_off, torch.sigmoid(labels) >= 0.3)
    values, truth = outputs('values')
    assert float(skm_to_fastai(skm.max_error, is_class=False)(values, truth)) == skm.max_error(truth, values[:, 0])
    with pytest.raises(ValueError, match='use accuracy'): skm_to_fastai(skm.max_error, is_class=False)(pred, target)


@pytest.mark.float32
@pytest.mark.numeric
def test_perplexity_counts_every_position_of_a_sequence():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(6, 7, 11, dtype=torch.float64, generator=g), torch.randint(0, 11, (6, 7), generator=g)
    by_hand = math.exp(nn.functional.cross_entropy(pred.reshape(-1, 11), target.reshape(-1)).item())
    assert math.isclose(Perplexity()(pred, target).item(), by_hand, rel_tol=1e-12)
    half = Perplexity()(pred.to(torch.bfloat16), target).item()  # computed in float32 from bfloat16 scores
    assert math.isclose(half, by_hand, rel_tol=1e-2)


@pytest.mark.parametrize('key', METRICS)
def test_the_trackers_read_each_metrics_direction_from_its_name(key):
    "Every column these metrics make can be followed by EarlyStopping or SaveModel without `mode`."
    metric = METRICS[key].make()
    name = getattr(metric, 'name', None) or getattr(getattr(metric, 'func', metric), '__name__')
    lower = {'error_rate', 'mse', 'rmse', 'mae', 'msle', 'perplexity'}
    assert monitor_mode(name) == ('min' if name in lower else 'max'), name


def test_a_checked_metric_is_an_accum_metric_with_its_check_first():
    assert issubclass(CheckedMetric, AccumMetric)
    seen = []
    def check(pred, target, name):
        seen.append(name)
        return pred * 2, target
    doubled = CheckedMetric(lambda p, t: p.sum(), check, name='doubled')
    assert doubled(torch.ones(3), torch.zeros(3)).item() == 6 and seen == ['doubled']
