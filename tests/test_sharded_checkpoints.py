"""Sharded checkpoints (`Checkpoint(sharded=True)`): each process writes its shards through torch.distributed.checkpoint
into a folder, and a fit resumed from it equals the fit that never stopped, bit for bit; on two CPU processes (gloo,
FSDP2, float64) and in one."""
import os
import signal
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, TensorDataset

import teachloop.learner
from teachloop.callback.checkpoint import Checkpoint, read_checkpoint
from teachloop.callback.core import accuracy
from teachloop.callback.distributed import run_ranks
from teachloop.callback.schedule import fit_one_cycle  # noqa: F401 (adds `Learner.fit_one_cycle`)
from teachloop.callback.tracker import SaveModel
from teachloop.core import process_rank
from teachloop.data import DataLoaders, digits_cnn, load_digits_tensors
from teachloop.learner import Callback, Learner, gathered, tensors_to_load
from teachloop.optim.core import SGD, Adam
from teachloop.random_state import set_seed
from test_checkpoint import CtrlCAt, StopAfterEpoch

FORK = dict(world_size=2, start_method='fork', timeout=120)
pytestmark = pytest.mark.timeout(300)
# the optimizers the fits are resumed with: momentum, Adam's two averages and step count, torch's Adam (a step tensor)
OPTIMIZERS = {'sgd_momentum': (partial(SGD, mom=0.9), 0.1), 'adam': (Adam, 3e-3), 'torch_adamw': (torch.optim.AdamW, 3e-3)}
N_EPOCH = 2


class CtrlC(Callback):
    "A Ctrl-C that reaches rank `rank` alone after the loss of training step `at`."
    def __init__(self, rank, at): self.rank, self.at = rank, at
    def after_loss(self):
        if self.learn.training and self.learn.train_iter == self.at and process_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGINT)


class StateAtEpochEnd(Callback):
    "The whole weights and optimizer state as epoch `epoch` ends (every rank gathers them: a collective)."
    order = 90
    def __init__(self, epoch): self.epoch_seen, self.state = epoch, None
    def after_epoch(self):
        if self.epoch == self.epoch_seen: self.state = whole_state(self.learn)


class StateAtStart(Callback):
    "The weights and optimizer state a resumed fit starts its first epoch from."
    def __init__(self): self.state = None
    def before_epoch(self):
        if self.state is None: self.state = whole_state(self.learn)


def learner(opt_name, *cbs, bs=16, n_train=384):
    "The digits CNN in float64 on `n_train` training items in batches of `bs` (12 batches an epoch in each of 2 ranks)."
    set_seed(0)
    x, y = load_digits_tensors()
    dls = DataLoaders(DataLoader(TensorDataset(x[:n_train].double(), y[:n_train]), batch_size=bs, shuffle=True,
                                 generator=torch.Generator().manual_seed(0)),
                      DataLoader(TensorDataset(x[-40:].double(), y[-40:]), batch_size=20))
    opt_func, lr = OPTIMIZERS[opt_name]
    learn = Learner(dls, digits_cnn().double(), F.cross_entropy, opt_func=opt_func, lr=lr, metrics=[accuracy],
                    cbs=list(cbs))
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def whole_state(learn):
    "The weights and the optimizer's per-parameter state of `learn`, gathered whole, on the CPU."
    weights = {k: v.detach().clone() for k, v in gathered(learn.model.state_dict()).items()}
    opt = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
           for i, s in gathered(learn.opt.state_dict()['state']).items()}
    return {'weights': weights, 'opt': opt}


def report(learn):
    return {**whole_state(learn), 'losses': learn.recorder.losses, 'rows': [row[:4] for row in learn.recorder.values]}


def fit(learn, strategy='fsdp', **kwargs):
    "`learn` fitted for N_EPOCH epochs with one cycle in `learn.distributed()`; its report."
    with learn.distributed(strategy=strategy): learn.fit_one_cycle(N_EPOCH, **kwargs)
    return report(learn)


def same(a, b):
    "Whether the reports (or states) `a` and `b` are equal: every tensor bit for bit."
    if torch.is_tensor(a): return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def largest_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point())


# ---- two ranks, FSDP2

# The ranks agree every 8 steps and at each epoch's end (steps 7 and 11 of each epoch of 12): a Ctrl-C in rank 1 at
# step 13 (epoch 1) goes with step 19's message, and both ranks stop after step 19, 8 batches into the epoch.
CTRL_C_AT, STOPPED_AFTER = 13, 20


def sharded_fits_interrupted_and_resumed(folder):
    "For each optimizer: a fit never stopped; one stopped by a Ctrl-C; fits resumed from its folder and epoch 1's."
    found = {}
    for name in OPTIMIZERS:
        at_epoch_end = StateAtEpochEnd(0)
        whole = fit(learner(name, at_epoch_end))
        cut = learner(name, Checkpoint(folder / name, sharded=True))
        try: fit(cut, cbs=[CtrlC(1, CTRL_C_AT)])
        except KeyboardInterrupt: stopped_at = cut.train_iter
        else: raise AssertionError("the Ctrl-C did not stop the fit")
        local = {k: v.to_local().shape for k, v in cut.model.state_dict().items()}
        from_ctrl_c = fit(learner(name), resume=folder / name / 'interrupted')
        resumed = learner(name)
        from_epoch = fit(resumed, resume=folder / name / 'epoch-001')
        to_fill = tensors_to_load(resumed, read_checkpoint(folder / name / 'epoch-001'))  # what a resume reads into
        local_shape = lambda t: tuple(getattr(t, 'to_local', lambda: t)().shape)
        read_into = {'weight': local_shape(to_fill['model']['0.0.weight']),  # the first parameter: 16 rows
                     'opt': [local_shape(t) for t in to_fill['opt']['state'][0].values() if torch.is_tensor(t) and t.ndim]}
        found[name] = dict(whole=whole, from_ctrl_c=from_ctrl_c, from_epoch=from_epoch, stopped_at=stopped_at,
                           local=local, epoch_end=at_epoch_end.state, read_into=read_into)
    return found


@pytest.fixture(scope='session')  # once per test worker: the group's tests may come between other files' tests
def sharded_fits(tmp_path_factory):
    folder = tmp_path_factory.mktemp('sharded')
    return folder, run_ranks(sharded_fits_interrupted_and_resumed, folder, **FORK)


@pytest.mark.ranks
@pytest.mark.parametrize('name', list(OPTIMIZERS))
def test_sharded_checkpoints_of_two_ranks_resume_bit_for_bit(sharded_fits, name):
    folder, ranks = sharded_fits
    assert ranks[0][name]['stopped_at'] == ranks[1][name]['stopped_at'] == STOPPED_AFTER
    assert sorted(p.name for p in (folder / name).iterdir()) == ['epoch-001', 'interrupted', 'latest']
    assert os.readlink(folder / name / 'latest') == 'epoch-001'
    for rank in ranks:
        whole = rank[name]['whole']
        assert whole['weights']['0.0.weight'].dtype == torch.float64 and whole['opt'] and len(whole['losses']) == 24
        for resumed in ('from_ctrl_c', 'from_epoch'):
            assert same(rank[name][resumed], whole), (name, resumed)  # weights, optimizer state, losses, rows
        # each rank trained on its rows only: the first dimension of every parameter cut in two
        assert rank[name]['local']['0.0.weight'] == (8, 1, 3, 3)
        # and a resume reads into each rank its own rows only, of the weights and of the optimizer's state
        read_into = rank[name]['read_into']  # (a step count has no rows to cut: left out)
        assert read_into['weight'] == (8, 1, 3, 3) and read_into['opt'] and set(read_into['opt']) == {(8, 1, 3, 3)}


def opt_bytes_by_file(folder):
    "The bytes of the optimizer state's tensors in each of the DCP files of `folder`, by file name."
    found = {}
    for index, where in FileSystemReader(folder).read_metadata().storage_data.items():
        if index.fqn.startswith('opt.'): found[where.relative_path] = found.get(where.relative_path, 0) + where.length
    return found


@pytest.mark.ranks
def test_each_rank_writes_its_own_shards_about_half_of_the_optimizer_state(sharded_fits, tmp_path):
    folder, _ = sharded_fits
    alone = learner('adam', Checkpoint(tmp_path, sharded=True))
    alone.fit(1)
    whole, = opt_bytes_by_file(tmp_path / 'epoch-001').values()
    shards = opt_bytes_by_file(folder / 'adam' / 'epoch-001')
    assert sorted(os.listdir(folder / 'adam' / 'epoch-001')) == ['.metadata', '__0_0.distcp', '__1_0.distcp', 'state.pt']
    assert sorted(shards) == ['__0_0.distcp', '__1_0.distcp']
    assert all(size <= 0.6 * whole for size in shards.values())
    # the small file holds each tensor's shape and dtype, not its data
    saved = read_checkpoint(folder / 'adam' / 'epoch-001')
    assert saved['model']['0.0.weight'].is_meta and saved['model']['0.0.weight'].shape == (16, 1, 3, 3)
    assert saved['opt']['state'][0]['grad_avg'].is_meta and saved['progress']['epochs_done'] == 1


@pytest.mark.ranks
def test_a_checkpoint_of_two_ranks_resumes_in_one_process_from_the_same_state(sharded_fits):
    "World size 2 -> 1 at an epoch's end, with the same global batch (32): DCP reads every shard into whole tensors."
    folder, ranks = sharded_fits
    for name in OPTIMIZERS:
        start = StateAtStart()
        learn = learner(name, start, bs=32)
        with pytest.warns(UserWarning, match='random states of 2 processes'):
            alone = fit(learn, strategy='ddp', resume=folder / name / 'epoch-001')
        two_ranks = ranks[0][name]
        assert same(start.state, two_ranks['epoch_end']), name  # the state the fit goes on from: the very same
        assert alone['rows'][0] == two_ranks['whole']['rows'][0] and len(alone['losses']) == 24
        # then an epoch in one process: each step's gradient is a sum over 32 items in another order than the two
        # ranks' sum of their halves (float64; measured: 1e-17 to 6e-17)
        assert largest_difference(alone['weights'], two_ranks['whole']['weights']) <= 1e-15, name


# ---- one process

@pytest.mark.parametrize('name', list(OPTIMIZERS))
def test_a_sharded_checkpoint_in_one_process_resumes_bit_for_bit(tmp_path, name):
    straight = learner(name)
    straight.fit_one_cycle(3)
    for stop, file in (([StopAfterEpoch(1)], 'latest'), ([CtrlCAt(2, 5)], 'interrupted')):
        cut = learner(name, Checkpoint(tmp_path / file, sharded=True, keep=1))
        try: cut.fit_one_cycle(3, cbs=stop)
        except KeyboardInterrupt: pass
        resumed = learner(name)
        resumed.fit_one_cycle(3, resume=tmp_path / file / file)
        assert same(report(resumed), report(straight)), (name, file)
    # keep=1: the newest epoch's folder, the link to it, and nothing left of the temporary folders
    assert sorted(os.listdir(tmp_path / 'latest')) == ['epoch-002', 'latest']
    assert sorted(os.listdir(tmp_path / 'interrupted')) == ['epoch-002', 'interrupted', 'latest']
    assert sorted(os.listdir(tmp_path / 'latest' / 'latest')) == ['.metadata', '__0_0.distcp', 'state.pt']


def test_save_and_load_in_shards_and_load_checkpoint(tmp_path):
    learn = learner('adam')
    learn.fit(1)
    assert learn.save(tmp_path / 'saved', sharded=True) == tmp_path / 'saved'
    assert sorted(os.listdir(tmp_path / 'saved')) == ['.metadata', '__0_0.distcp', 'state.pt']
    again = learner('adam').load(tmp_path / 'saved')
    assert same(whole_state(again), whole_state(learn))
    weights_only = learner('adam').load(tmp_path / 'saved', with_opt=False)
    assert same(weights_only.model.state_dict(), learn.model.state_dict()) and weights_only.opt is None
    learn.save(tmp_path / 'saved', sharded=True, with_opt=False)  # a folder there already is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ['saved'] and 'opt' not in read_checkpoint_file(tmp_path / 'saved')
    checkpointed = learner('adam', Checkpoint(tmp_path / 'ck', sharded=True))
    checkpointed.fit(1)
    loaded = learner('adam').load_checkpoint(tmp_path / 'ck' / 'latest')
    assert same(whole_state(loaded), whole_state(checkpointed))


def read_checkpoint_file(folder): return torch.load(folder / 'state.pt', weights_only=True)


# ---- refusals

def snapshot(learn): return [p.detach().clone() for p in learn.model.parameters()], learn.opt


def unchanged(learn, before):
    weights, opt = before
    return all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters())) and learn.opt is opt


def test_a_sharded_checkpoint_that_does_not_fit_is_refused_before_anything_changes(tmp_path, monkeypatch):
    learner('adam', Checkpoint(tmp_path / 'ck', sharded=True)).fit(1)
    read = []  # the shards are read only once every check has passed
    monkeypatch.setattr(teachloop.learner, 'load_shards', lambda *args: read.append(args))
    other = Learner(DataLoaders(*[DataLoader(TensorDataset(torch.zeros(4, 1, 8, 8, dtype=torch.float64),
                                                           torch.zeros(4, dtype=torch.long)), batch_size=2)] * 2),
                    torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)).double(), F.cross_entropy)
    before = snapshot(other)
    with pytest.raises(ValueError, match='the saved weights do not fit this model'):
        other.fit(2, resume=tmp_path / 'ck' / 'latest')
    assert unchanged(other, before)
    with pytest.raises(ValueError, match='the saved weights do not fit this model'): other.load(tmp_path / 'ck' / 'latest')
    assert unchanged(other, before)
    sgd = learner('sgd_momentum')  # the same model, another optimizer
    before = snapshot(sgd)
    with pytest.raises(ValueError, match='this state was saved by an optimizer running'):
        sgd.fit(2, resume=tmp_path / 'ck' / 'latest')
    assert unchanged(sgd, before)
    done = learner('adam')
    with pytest.raises(ValueError, match='has done 1 epochs already'): done.fit(1, resume=tmp_path / 'ck' / 'latest')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match="a sharded checkpoint's folder holds state.pt"):
        done.fit(2, resume=tmp_path / 'empty')
    assert not read


def test_bad_sharded_arguments_are_refused_when_the_callback_is_made(tmp_path):
    with pytest.raises(TypeError, match="sharded must be True or False, got 'yes'"): Checkpoint(tmp_path, sharded='yes')


def interrupted_mid_epoch_in_shards(folder):
    learn = learner('sgd_momentum', Checkpoint(folder, sharded=True))
    try: fit(learn, cbs=[CtrlC(1, CTRL_C_AT)])
    except KeyboardInterrupt: return learn.train_iter
    raise AssertionError("the Ctrl-C did not stop the fit")


def fit_into_a_folder_of_each_node(folder, stale=False):
    "A checkpoint folder that each rank sees apart (two machines without a shared folder): the fit is refused."
    if stale and process_rank() == 1:  # what an earlier check, cut short, left in rank 1's own folder: not rank 0's file
        (folder / 'node1').mkdir(parents=True)
        (folder / 'node1' / '.written-by-rank-0').write_text('0')
    learn = learner('sgd_momentum', Checkpoint(folder / f'node{process_rank()}', sharded=True))
    try: fit(learn)
    except ValueError as e: return str(e), learn.train_iter, len(learn.recorder.losses)
    raise AssertionError("the fit was not refused")


@pytest.mark.ranks
def test_a_sharded_checkpoint_folder_that_the_ranks_do_not_share_is_refused_before_the_fit(tmp_path):
    for message, steps, losses in run_ranks(fit_into_a_folder_of_each_node, tmp_path, **FORK):
        assert "rank 1 of 2 did not find the file rank 0 wrote into the checkpoint folder" in message
        assert 'a folder that all of them share' in message and steps == losses == 0
    assert os.listdir(tmp_path) == ['node0'] and not os.listdir(tmp_path / 'node0')  # rank 0's file is gone
    for message, steps, losses in run_ranks(fit_into_a_folder_of_each_node, tmp_path / 'stale', True, **FORK):
        assert "rank 1 of 2 did not find the file rank 0 wrote" in message and steps == losses == 0
    three = run_ranks(fit_into_a_folder_of_each_node, tmp_path / 'three', **{**FORK, 'world_size': 3})
    assert all("ranks 1, 2 of 3 did not find the file rank 0 wrote" in message for message, _, _ in three)


@pytest.mark.ranks
def test_a_mid_epoch_resume_in_one_process_with_another_global_batch_is_refused_before_loading(tmp_path, monkeypatch):
    assert run_ranks(interrupted_mid_epoch_in_shards, tmp_path, **FORK) == [STOPPED_AFTER] * 2
    read = []
    monkeypatch.setattr(teachloop.learner, 'load_shards', lambda *args: read.append(args))
    learn = learner('sgd_momentum')  # one process, batches of 16: a global batch of 16, not 32
    before = snapshot(learn)
    with pytest.raises(ValueError, match=r'by 2 processes with batches of 16 \(a global batch of 32\)'):
        fit(learn, strategy='ddp', resume=tmp_path / 'interrupted')
    assert unchanged(learn, (before[0], learn.opt)) and not learn.recorder.losses and not read


# ---- SaveModel(sharded=True): the best epoch's weights, each process writing its shards

def best_weights_saved(folder, strategy, sharded):
    "A fit whose best epoch (the highest validation loss) is written by SaveModel and loaded back at its end."
    ends = [StateAtEpochEnd(epoch) for epoch in range(N_EPOCH)]
    for epoch, cb in enumerate(ends): cb.name = f'state_at_end_of_{epoch}'
    saver = SaveModel('valid_loss', 'max', folder / ('best' if sharded else 'best.pt'), sharded=sharded)
    learn = learner('adam', saver, *ends)
    with learn.distributed(strategy=strategy): learn.fit_one_cycle(N_EPOCH)
    best = max(range(N_EPOCH), key=lambda epoch: learn.recorder.values[epoch][2])
    return whole_state(learn)['weights'], ends[best].state['weights'], ends[-1].state['weights'], sorted(
        p.name for p in (folder / 'best').iterdir()) if sharded else None


@pytest.mark.ranks
def test_save_model_in_shards_ends_with_the_best_epochs_weights_as_the_whole_file_does(tmp_path):
    for rank in run_ranks(partial(_both_savers, tmp_path), **FORK):
        (restored, best, last, files), (restored_file, _, _, _) = rank
        assert same(restored, best) and not same(best, last) and same(restored, restored_file)
        assert files == ['.metadata', '__0_0.distcp', '__1_0.distcp', 'state.pt']


def _both_savers(folder):
    return [best_weights_saved(folder / name, 'fsdp', sharded) for name, sharded in (('shards', True), ('file', False))]


def test_save_model_in_shards_in_one_process(tmp_path):
    restored, best, last, files = best_weights_saved(tmp_path, 'ddp', True)
    assert same(restored, best) and not same(best, last) and files == ['.metadata', '__0_0.distcp', 'state.pt']
    with pytest.raises(TypeError, match='sharded must be True or False'): SaveModel(path=tmp_path / 'b', sharded='yes')
