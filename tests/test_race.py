"The race harness: one run, the sweep and its table, a diverging rate kept as a result (at chance accuracy)."
import math
from functools import partial

import torch

from teachloop.lessons import race
from teachloop.data import digits_dls

from teachloop.lessons.race import Racer, race_run, race_table, racers, run_race
from teachloop.optim.core import SGD


def test_a_run_reports_losses_accuracies_and_step_time():
    run = race_run(racers(23)['AdamW'], 1e-2, seed=0, n_epoch=1)
    assert len(run['losses']) == 23 and len(run['accuracies']) == 1 and 0.3 < run['accuracies'][0] <= 1
    assert 0 < run['seconds_per_step'] < 1


def test_the_sweep_picks_the_best_rate_and_the_table_marks_an_edge():
    contenders = {'SGD': Racer(partial(SGD, mom=0.9), (1e-4, 0.3))}
    results = run_race(contenders, seeds=(0, 1), n_epoch=2)
    assert results['SGD']['best_lr'] == 0.3 and len(results['SGD']['runs']) == 2
    table = race_table(results)
    assert '| SGD | 0.0001, 0.3 | 0.3 (edge) |' in table and table.count('\n') == 2


def test_a_diverging_rate_counts_as_chance():
    run = race_run(Racer(SGD, (1e4,)), 1e4, n_epoch=1)
    assert not all(math.isfinite(loss) and loss < 1e6 for loss in run['losses']) and run['accuracies'][0] < 0.2


def first_epoch_order(dl):
    "The targets of a loader's first epoch, in order, its shuffling generator put back as it was."
    state = dl.generator.get_state()
    order = torch.cat([y for _, y in dl]).tolist()
    dl.generator.set_state(state)
    return order


def test_each_seed_of_the_race_draws_its_own_batch_order(monkeypatch):
    made = []
    def kept_loaders(*args, **kwargs):
        dls = real_digits_dls(*args, **kwargs)
        made.append((first_epoch_order(dls.train), torch.cat([y for _, y in dls.valid]).tolist()))
        return dls
    real_digits_dls = race.digits_dls
    monkeypatch.setattr(race, 'digits_dls', kept_loaders)
    for seed in (1, 2, 1): race_run(racers(23)['AdamW'], 1e-2, seed=seed, n_epoch=1)
    (order_1, valid_1), (order_2, valid_2), (order_1_again, _) = made
    assert order_1 == order_1_again and order_1 != order_2 and sorted(order_1) == sorted(order_2)
    assert valid_1 == valid_2  # every run is measured on the same validation images


def test_a_shuffle_seed_changes_the_batch_order_and_not_the_split():
    dls, same, other = digits_dls(shuffle_seed=1), digits_dls(shuffle_seed=1), digits_dls(shuffle_seed=2)
    assert first_epoch_order(dls.train) == first_epoch_order(same.train) != first_epoch_order(other.train)
    assert torch.equal(dls.train.dataset.tensors[0], other.train.dataset.tensors[0])
    assert first_epoch_order(digits_dls(seed=7).train) == first_epoch_order(digits_dls(seed=7, shuffle_seed=7).train)
