"""Logging where users look: the CSV file of the epochs, TensorBoard's event files read back with tensorboard's own
`EventAccumulator`, and the live figure of the losses; resumed fits, `lr_find`, several processes, missing packages."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from teachloop.callback.checkpoint import Checkpoint
from teachloop.callback.core import Recorder, accuracy
from teachloop.callback.loggers import CSVLogger, ShowGraph, TensorBoardLogger, _written_order, read_scalars
from teachloop.callback.schedule import fit_one_cycle  # noqa: F401  (adds Learner.fit_one_cycle and lr_find)
from teachloop.diagnostics.effective_lr import effective_lr_stats
from teachloop.learner import Callback
from teachloop.optim.core import SGD
from teachloop.optim.interop import OptimWrapper
from teachloop.testing import digits_learner, tiny_learner

ROOT = Path(__file__).resolve().parents[1]
f32 = lambda value: float(np.float32(value))  # TensorBoard keeps scalars in float32


def two_groups(model): return [list(model[:-1].parameters()), list(model[-1].parameters())]


def values(scalars, tag): return [value for _, value in scalars[tag]]


# ---- CSVLogger

class FileRows(Callback):
    "How many rows the CSV file has at each epoch's end, once the logger has written."
    order = 61
    def __init__(self, path): self.path, self.seen = path, []
    def after_epoch(self): self.seen.append(len(Path(self.path).read_text().splitlines()) - 1)


def test_csv_logger_writes_each_epochs_row_under_the_recorders_names(tmp_path):
    rows = FileRows(tmp_path / 'history.csv')
    learn = digits_learner(CSVLogger(tmp_path / 'history.csv'), rows, metrics=[accuracy])
    learn.fit(3)
    header, *lines = (tmp_path / 'history.csv').read_text().splitlines()
    assert header.split(',') == learn.recorder.metric_names == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time']
    assert [[float(v) for v in line.split(',')] for line in lines] == learn.recorder.values  # repr round-trips
    assert rows.seen == [1, 2, 3]  # each row as its epoch ends
    assert [list(row.values()) for row in learn.csv_logger.read_log()] == learn.recorder.values


def test_append_adds_this_fits_rows_after_the_files_own_and_the_default_starts_afresh(tmp_path):
    path = tmp_path / 'logs' / 'history.csv'  # a folder that does not exist yet
    learn = tiny_learner(Recorder(), CSVLogger(path, append=True))
    learn.fit(2)
    learn.fit(3)
    assert len(learn.csv_logger.read_log()) == 5 and path.read_text().count('epoch') == 1  # one header
    learn.csv_logger.append = False
    learn.fit(1)
    assert [row['epoch'] for row in learn.csv_logger.read_log()] == [0]


def test_a_folder_as_fname_gets_history_csv_in_it(tmp_path):
    assert CSVLogger(str(tmp_path) + '/').fname == tmp_path / 'history.csv'


def test_append_to_a_file_with_other_columns_is_refused_before_the_fit(tmp_path):
    (tmp_path / 'history.csv').write_text('epoch,train_loss,valid_loss,f1,time\n0,1.0,1.0,0.5,0.1\n')
    learn = tiny_learner(Recorder(), CSVLogger(tmp_path / 'history.csv', append=True))
    before = [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match='same columns'): learn.fit(1)
    assert learn.opt is None and all(map(torch.equal, before, learn.model.parameters()))
    assert (tmp_path / 'history.csv').read_text().count('\n') == 2


@pytest.mark.parametrize('make', [lambda path: CSVLogger(path / 'h.csv'), lambda path: TensorBoardLogger(path),
                                  lambda path: ShowGraph(path / 'g.png')], ids=['CSVLogger', 'TensorBoardLogger', 'ShowGraph'])
def test_each_logger_refuses_a_learner_without_a_recorder(make, tmp_path):
    learn = tiny_learner(make(tmp_path))
    with pytest.raises(ValueError, match='no Recorder'): learn.fit(1)
    assert learn.opt is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize('args, error', [(dict(every=0), ValueError), (dict(effective_lr='yes'), ValueError)])
def test_tensorboard_logger_refuses_bad_arguments_when_made(args, error, tmp_path):
    with pytest.raises(error): TensorBoardLogger(tmp_path, **args)


def test_a_path_below_a_file_is_refused_when_made(tmp_path):
    (tmp_path / 'file').write_text('')
    with pytest.raises(ValueError, match='is a file'): CSVLogger(tmp_path / 'file' / 'history.csv')
    with pytest.raises(ValueError, match='is a file'): TensorBoardLogger(tmp_path / 'file')
    with pytest.raises(ValueError, match='refresh'): ShowGraph(refresh=-1)


class StopAfterBatch(Callback):
    "A KeyboardInterrupt, as from Ctrl-C, after training batch `at` (counted from 1)."
    def __init__(self, at): self.at = at
    def after_batch(self):
        if self.learn.training and self.learn.train_iter == self.at: raise KeyboardInterrupt


def logged_fit(run, *cbs, resume=None, earlier_rows=False):
    "Three epochs of the digits CNN with both loggers and checkpoints in `run` (after a fit of its own: `earlier_rows`)."
    learn = digits_learner(CSVLogger(run / 'history.csv', append=True), TensorBoardLogger(run / 'tb', every=5),
                           Checkpoint(run / 'checkpoints'), metrics=[accuracy])
    if earlier_rows and resume is None: learn.fit(1)  # the rows and batches of another fit, first
    learn.fit(3, cbs=list(cbs), resume=resume)
    return learn


def without_time(path): return [{k: v for k, v in row.items() if k != 'time'} for row in CSVLogger(path).read_log()]


@pytest.mark.numeric
def test_a_fit_resumed_before_where_it_stopped_leaves_the_files_of_the_fit_never_stopped(tmp_path):
    "Stopped in the third epoch and resumed from the first epoch's checkpoint: the second epoch's row and batches, and"
    " those of the third, written by the stopped fit, are replaced; an earlier fit's rows (append) stay."
    whole = logged_fit(tmp_path / 'whole', earlier_rows=True)
    steps = len(whole.dls.train)
    with pytest.raises(KeyboardInterrupt): logged_fit(tmp_path / 'run', StopAfterBatch(2 * steps + 3), earlier_rows=True)
    assert len(without_time(tmp_path / 'run' / 'history.csv')) == 1 + 2
    resumed = logged_fit(tmp_path / 'run', resume=tmp_path / 'run' / 'checkpoints' / 'epoch-001.pt')
    assert without_time(tmp_path / 'run' / 'history.csv') == without_time(tmp_path / 'whole' / 'history.csv')
    assert len(without_time(tmp_path / 'run' / 'history.csv')) == 1 + 3
    assert read_scalars(tmp_path / 'run' / 'tb') == read_scalars(tmp_path / 'whole' / 'tb')
    assert len(read_scalars(tmp_path / 'run' / 'tb')['batch/train_loss']) == 3 * steps + steps  # the earlier fit's too
    assert resumed.recorder.values[-1][:-1] == whole.recorder.values[-1][:-1]


# ---- TensorBoardLogger

@pytest.mark.float32
@pytest.mark.numeric
def test_tensorboard_logger_writes_every_batch_every_group_every_row_and_the_effective_lrs(tmp_path):
    learn = digits_learner(TensorBoardLogger(tmp_path, every=7), metrics=[accuracy], splitter=two_groups)
    learn.fit_one_cycle(2, slice(1e-3, 1e-2))
    scalars, steps = read_scalars(tmp_path), len(learn.recorder.losses)
    assert [step for step, _ in scalars['batch/train_loss']] == list(range(steps))
    assert values(scalars, 'batch/train_loss') == [f32(v) for v in learn.recorder.losses]
    for name in ('lr', 'mom', 'sqr_mom', 'eps', 'wd'):  # the Recorder keeps the last group's
        assert values(scalars, f'hypers/{name}/group1') == [f32(v) for v in learn.recorder.hps[name]], name
    # a tenth of the head's learning rate, to float32's rounding of each (2**-24 relative, twice)
    assert np.allclose(np.array(values(scalars, 'hypers/lr/group0')) * 10, values(scalars, 'hypers/lr/group1'), rtol=1e-6)
    for i, name in enumerate(learn.recorder.metric_names[1:-1], start=1):
        assert scalars[f'epoch/{name}'] == [(steps // 2 * (e + 1) - 1, f32(row[i])) for e, row in enumerate(learn.recorder.values)]
    stats = effective_lr_stats(learn.opt, learn.model, (0.05, 0.5, 0.95))  # the state of the last epoch's end
    assert {tag.split('/')[1] for tag in scalars if tag.startswith('effective_lr/')} == set(stats)
    for layer, quantiles in stats.items():
        for q, value in zip(('q05', 'q50', 'q95'), quantiles.tolist()):
            assert scalars[f'effective_lr/{layer}/{q}'][-1] == (steps - 1, f32(value))


@pytest.mark.parametrize('every', [1, 1000])
def test_every_batch_is_written_however_rarely_the_losses_are_read_back(every, tmp_path):
    learn = tiny_learner(Recorder(), TensorBoardLogger(tmp_path, every=every), n_batches=3)
    learn.fit(2)
    assert values(read_scalars(tmp_path), 'batch/train_loss') == [f32(v) for v in learn.recorder.losses]


def test_effective_lrs_are_left_out_without_a_rule_and_refused_when_asked_for(tmp_path):
    adagrad = lambda params, lr: OptimWrapper(params, opt=torch.optim.Adagrad, lr=lr)  # torch's: no rule
    learn = tiny_learner(Recorder(), TensorBoardLogger(tmp_path / 'a'), opt_func=adagrad)
    learn.fit(1)
    assert not any(tag.startswith('effective_lr') for tag in read_scalars(tmp_path / 'a'))
    learn = tiny_learner(Recorder(), TensorBoardLogger(tmp_path / 'b', effective_lr=True), opt_func=adagrad)
    with pytest.raises(ValueError, match='effective_lr=True.*Adagrad'): learn.fit(1)
    assert learn.opt is None and not (tmp_path / 'b').exists()


def test_without_a_log_dir_each_fit_gets_a_run_folder_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    learn = tiny_learner(Recorder(), TensorBoardLogger())
    learn.fit(1)
    run = learn.tensor_board_logger.run_dir
    assert run.parent == Path('runs') and len(read_scalars(run)['batch/train_loss']) == 2


def test_event_files_of_one_second_and_process_are_read_by_their_counter_as_a_number():
    names = [f'events.out.tfevents.1700000000.my.host.42.{uid}' for uid in (10, 9, 11)]
    assert sorted(names, key=lambda n: _written_order(Path(n))) == [names[1], names[0], names[2]]
    assert sorted(names) == [names[0], names[2], names[1]]  # by name, the tenth file comes first


def test_without_tensorboard_the_logger_names_the_extra_when_made(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, 'tensorboard', None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', None)
    with pytest.raises(ImportError, match=r"pip install 'teachloop\[tensorboard\]'"): TensorBoardLogger(tmp_path)
    with pytest.raises(ImportError, match=r"pip install 'teachloop\[tensorboard\]'"): read_scalars(tmp_path)


# ---- ShowGraph

def test_in_a_script_show_graph_shows_nothing_or_saves_the_figure_after_each_epoch(tmp_path):
    silent = digits_learner(ShowGraph())
    silent.fit(1)
    assert silent.show_graph.fig is None
    learn = digits_learner(ShowGraph(tmp_path / 'losses.png', refresh=0), metrics=[accuracy])
    learn.fit(2)
    assert (tmp_path / 'losses.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    ax = learn.show_graph.fig.axes[0]
    assert list(ax.lines[0].get_ydata()) == learn.recorder.losses
    assert list(ax.lines[-1].get_ydata()) == [row[2] for row in learn.recorder.values]
    assert ax.get_xlim() == (0, 2 * len(learn.dls.train)) and not list(tmp_path.glob('.tmp-*'))


NOTEBOOK = """
import json
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from teachloop.callback.loggers import ShowGraph
from teachloop.testing import digits_learner
InteractiveShell.instance()
shown = []
for refresh in (0, 3600):
    learn = digits_learner(ShowGraph(live=True, refresh=refresh))
    with capture_output() as captured: learn.fit(3)
    shown.append([(sorted(o.data), o.transient['display_id'], o.update) for o in captured.outputs])
print(json.dumps(shown))
"""


def test_in_a_notebook_show_graph_updates_one_displayed_figure_in_place():
    "An IPython shell as a kernel has: one display with an id, then updates of it; at most one drawing per `refresh`."
    done = subprocess.run([sys.executable, '-c', NOTEBOOK], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, 'MPLBACKEND': 'Agg'})
    assert done.returncode == 0, done.stderr
    every_epoch, once_an_hour = json.loads(done.stdout.splitlines()[-1])
    assert [update for _, _, update in every_epoch] == [False, True, True]
    assert len({display_id for _, display_id, _ in every_epoch}) == 1
    assert all('image/png' in kinds for kinds, _, _ in every_epoch)
    assert [update for _, _, update in once_an_hour] == [False, True]  # the first epoch, and the fit's end


# ---- lr_find and several processes

def test_the_loggers_stay_silent_during_lr_find(tmp_path):
    learn = digits_learner(CSVLogger(tmp_path / 'history.csv'), TensorBoardLogger(tmp_path / 'tb'),
                           ShowGraph(tmp_path / 'losses.png'))
    learn.lr_find(num_it=10)
    assert not list(tmp_path.iterdir())
    learn.fit(1)
    assert len(learn.csv_logger.read_log()) == 1
    assert len(read_scalars(tmp_path / 'tb')['batch/train_loss']) == len(learn.dls.train)


def logged_in_a_rank(folder):
    "In each of two ranks: a fit of the digits CNN with the three loggers writing into the same `folder`."
    learn = digits_learner(CSVLogger(folder / 'history.csv'), TensorBoardLogger(folder / 'tb'),
                           ShowGraph(folder / 'losses.png', refresh=0), metrics=[accuracy])
    with learn.distributed(): learn.fit(2)
    return learn.recorder.values, learn.show_graph.fig is None, learn.tensor_board_logger.quiet


@pytest.mark.ranks
def test_under_two_processes_only_the_first_writes_and_the_others_are_quiet_only_meanwhile(tmp_path):
    from teachloop.callback.distributed import run_ranks
    (rows0, no_figure0, quiet0), (rows1, no_figure1, quiet1) = run_ranks(logged_in_a_rank, tmp_path, world_size=2,
                                                                         start_method='fork', timeout=120)
    assert not no_figure0 and no_figure1 and not quiet0 and not quiet1  # quiet only within the block
    assert [row[:-1] for row in rows0] == [row[:-1] for row in rows1]
    assert [list(row.values())[:-1] for row in CSVLogger(tmp_path / 'history.csv').read_log()] == [r[:-1] for r in rows0]
    assert len(list((tmp_path / 'tb').glob('*tfevents*'))) == 1
    assert values(read_scalars(tmp_path / 'tb'), 'epoch/valid_loss') == [f32(row[2]) for row in rows0]


def test_fits_started_in_one_second_get_run_folders_of_their_own(tmp_path, monkeypatch):
    "SummaryWriter's default name has the second in it: two fits in one second would write one run."
    pytest.importorskip('tensorboard')
    import datetime
    import teachloop.callback.loggers as loggers
    class OneSecond(datetime.datetime):
        @classmethod
        def now(cls, tz=None): return cls(2026, 11, 25, 0, 0, 0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loggers, 'datetime', OneSecond)
    first, second = TensorBoardLogger(), TensorBoardLogger()
    digits_learner(first).fit(1)
    digits_learner(second).fit(1)
    assert second.run_dir == first.run_dir.with_name(first.run_dir.name + '_2') and second.run_dir.exists()
