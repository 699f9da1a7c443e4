"The race harness: one run, the sweep and its table, a diverging rate kept as a result (at chance accuracy)."
import math
from functools import partial

from teachloop.race import Racer, race_run, race_table, racers, run_race
from teachloop.optimizer import SGD


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
    assert not all(math.isfinite(loss) for loss in run['losses']) and run['accuracies'][0] < 0.2
