"""Data-parallel training on two CPU processes (gloo): exact equality with one process and the doubled batch, reduced
validation, NaN capture, checkpoints and Ctrl-C, and a rank that fails. The processes are forked from the test process
(started in a fraction of a second); the failing rank and the notebook use `forkserver` (and `spawn`)."""
import math
import os
import signal
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from teachloop.callback.core import GradientAccumulation, accuracy
from teachloop.callback.checkpoint import Checkpoint
from teachloop.callback.tracker import SaveModel
from teachloop.core import process_rank
from teachloop.data import DataLoaders, digits_cnn, load_digits_tensors, tensor_dls
from teachloop.callback.distributed import (GlobalBatchNorm, RankFailed, RanksDisagree, batch_norm_layers, check_world,
                                            digits_bn_cnn, digits_fit, nan_on_one_rank, run_ranks, shard_dls)
from teachloop.diagnostics.effective_lr import EffectiveLRTracker
from teachloop.callback.faults import TerminateOnNaN
from teachloop.learner import (CancelBackwardException, CancelBatchException, CancelEpochException, CancelFitException,
                               CancelStepException, CancelTrainException, Callback, Learner)
from teachloop.callback.nan_capture import NaNCapture, replay_nan
from teachloop.optim.core import SGD, Adam
from teachloop.random_state import set_seed

FORK = dict(world_size=2, start_method='fork', timeout=120)
# Besides run_ranks's own timeout (for the ranks): a net for the test process itself, fixtures included
pytestmark = pytest.mark.timeout(300)
SGD_MOM = partial(SGD, mom=0.9)


def two_rank_fits():
    "In each rank: SGD with momentum (tracking effective learning rates) and Adam under one-cycle, in float64."
    tracker = EffectiveLRTracker(every=10)
    sgd = digits_fit(32, 0.1, 2, SGD_MOM, False, torch.float64, [tracker])
    sgd['lr_history'] = [(h['iter'], {k: v.tolist() for k, v in h['update_ratio'].items()},
                          {k: v.tolist() for k, v in h['effective_lr'].items()}) for h in tracker.history]
    adam = digits_fit(32, 3e-3, 2, Adam, True, torch.float64)
    return sgd, adam


@pytest.fixture(scope='module')
def fits():
    "The fits of two ranks with batches of 32, and of one process with batches of 64."
    ranks = run_ranks(two_rank_fits, **FORK)
    alone = digits_fit(64, 0.1, 2, SGD_MOM, False, torch.float64), digits_fit(64, 3e-3, 2, Adam, True, torch.float64)
    return ranks, alone


@pytest.mark.float32
@pytest.mark.numeric
def test_two_ranks_equal_one_process_with_the_doubled_batch(fits):
    ranks, alone = fits
    for i, name in enumerate(('SGD with momentum', 'Adam with one-cycle')):
        one, (rank0, rank1) = alone[i], (ranks[0][i], ranks[1][i])
        for key, expected in one['weights'].items():
            assert expected.dtype == torch.float64
            assert torch.equal(rank0['weights'][key], rank1['weights'][key]), (name, key)
            # float64 keeps ~16 digits; the sums of the two shards are added in another order than one batch's, and
            # 46 steps amplify that little: 1e-10 leaves a factor of 1e5 for it
            assert (rank0['weights'][key] - expected).abs().max() < 1e-10, (name, key)
        # the loss of each step is the global batch's: the ranks' mean, recorded in float32 (`Recorder.losses`)
        assert rank0['losses'] == rank1['losses'] and len(rank0['losses']) == len(one['losses'])
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(rank0['losses'], one['losses']))


def test_both_ranks_record_the_same_effective_learning_rates(fits):
    ranks, _ = fits
    histories = [ranks[r][0]['lr_history'] for r in (0, 1)]
    assert len(histories[0]) > 2 and histories[0] == histories[1]


@pytest.mark.float32
@pytest.mark.numeric
def test_reduced_validation_equals_one_process_with_an_uneven_last_shard(fits):
    ranks, alone = fits
    valid = tensor_dls(*load_digits_tensors()).valid.dataset
    assert len(valid) % 2 == 1  # 359 digits: shards of 180 and 179
    for i in (0, 1):
        for row0, row1, row in zip(ranks[0][i]['values'], ranks[1][i]['values'], alone[i]['values']):
            assert row0[:4] == row1[:4]
            # one process averages in float32 (relative error a few times 6e-8), the ranks sum in float64
            for a, b in zip(row0[1:4], row[1:4]): assert math.isclose(a, b, rel_tol=1e-6), (row0, row)


def test_a_nan_on_rank_one_stops_both_ranks_at_that_step(tmp_path):
    at = 5
    ranks = run_ranks(nan_on_one_rank, tmp_path, 1, at, **FORK)
    assert [r['captured'] for r in ranks] == [str(tmp_path / f'nan-capture-rank{r}.pt') for r in (0, 1)]
    assert all(r['train_iter'] == at and r['finite'] for r in ranks)
    # either file replays in one process; rank 1's batch brings the NaN back, rank 0's alone does not
    for rank, recurs in ((1, True), (0, False)):
        assert torch.load(tmp_path / f'nan-capture-rank{rank}.pt', weights_only=True)['train_iter'] == at
        fresh = Learner(tensor_dls(*load_digits_tensors(), bs=32), digits_cnn(), torch.nn.functional.cross_entropy,
                        opt_func=SGD_MOM, lr=0.1)
        report = replay_nan(fresh, tmp_path / f'nan-capture-rank{rank}.pt')
        assert report.recurred == recurs and (report.epoch, report.iter) == (0, at)


class CtrlC(Callback):
    "A Ctrl-C that reaches rank `rank` alone at `event` of training step `at`."
    def __init__(self, rank, at, event, order=0):
        self.rank, self.at, self.order = rank, at, order
        setattr(self, event, self.interrupt)
    def interrupt(self):
        if self.learn.training and self.learn.train_iter == self.at and process_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGINT)


def digits_learner_fp32(*cbs):
    set_seed(0)
    learn = Learner(tensor_dls(*load_digits_tensors(), bs=32), digits_cnn(), torch.nn.functional.cross_entropy,
                    opt_func=SGD_MOM, lr=0.1, metrics=[accuracy], cbs=list(cbs))
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def fit_and_report(learn, **kwargs):
    with learn.distributed(): learn.fit_one_cycle(3, 0.1, **kwargs)
    return {'weights': {k: v.clone() for k, v in learn.model.state_dict().items()},
            'rows': [row[:4] for row in learn.recorder.values], 'losses': learn.recorder.losses}


def interrupted_and_resumed(folder, at, event):
    "A fit never stopped; one stopped by a Ctrl-C in rank 1 at step `at`; fits resumed from its file and from epoch 1's."
    whole = fit_and_report(digits_learner_fp32(Checkpoint(folder / 'whole')))
    learn = digits_learner_fp32(Checkpoint(folder / 'cut'))
    try: fit_and_report(learn, cbs=[CtrlC(1, at, event)])
    except KeyboardInterrupt: stopped_at = learn.train_iter
    else: raise AssertionError("the Ctrl-C did not stop the fit")
    dist.barrier()  # rank 0 writes interrupted.pt as its fit ends; the others read it below
    from_ctrl_c = fit_and_report(digits_learner_fp32(Checkpoint(folder / 'again')), resume=folder / 'cut' / 'interrupted.pt')
    from_epoch = fit_and_report(digits_learner_fp32(Checkpoint(folder / 'epoch')), resume=folder / 'cut' / 'epoch-001.pt')
    return whole, from_ctrl_c, from_epoch, stopped_at


# The ranks agree every 8 steps and at each epoch's end (steps 7, 15 and 22 of each epoch of 23), with the gradients of
# that step: a Ctrl-C in rank 1 while it draws step 27's batch, or in step 30's forward pass, goes with step 30's
# gradients and stops both ranks after step 30 (the epoch's 8th); one in step 30's optimizer step comes after that
# message has left, goes with step 38's and stops both after step 38.
@pytest.mark.parametrize('event, at, stop', [('before_batch', 27, 31), ('after_loss', 30, 31), ('after_step', 30, 39)])
def test_checkpoint_and_ctrl_c_on_two_ranks_resume_exactly(tmp_path, event, at, stop):
    ranks = run_ranks(interrupted_and_resumed, tmp_path, at, event, **FORK)
    assert ranks[0][3] == ranks[1][3] == stop
    assert sorted(p.name for p in (tmp_path / 'cut').iterdir()) == ['epoch-001.pt', 'interrupted.pt', 'latest.pt']
    for whole, *resumed, _ in ranks:
        for fit in resumed:
            assert all(torch.equal(fit['weights'][k], w) for k, w in whole['weights'].items())
            assert fit['rows'] == whole['rows'] and fit['losses'] == whole['losses']
    assert all(torch.equal(ranks[0][0]['weights'][k], w) for k, w in ranks[1][0]['weights'].items())


def ctrl_c_with_the_flag_through_a_host_group(through_host):
    "A fit with a Ctrl-C in rank 1 at step 30's forward, the flag sent as with nccl (its own group) or with the gradients."
    learn = digits_learner_fp32()
    with learn.distributed() as parallel:
        if through_host: parallel._host_group, parallel._made_host_group = dist.new_group(backend='gloo'), True
        try: learn.fit(2, cbs=[CtrlC(1, 30, 'after_loss')])
        except KeyboardInterrupt: pass
    return learn.train_iter, learn.recorder.losses


def test_a_ctrl_c_flag_sent_through_the_hosts_group_stops_at_the_same_step():
    "On GPUs the flag is a host value sent apart from the losses (which ride with the gradients): same step, same losses."
    apart, together = (run_ranks(ctrl_c_with_the_flag_through_a_host_group, through_host, **FORK) for through_host in (True, False))
    assert [rank[0] for rank in apart] == [rank[0] for rank in together] == [31, 31]
    assert apart[0][1] == apart[1][1] == together[0][1] and len(together[0][1]) == 31


def save_the_best_on_two_ranks(folder):
    "Each rank's `save` calls under SaveModel, its validation losses, and the saved file read right after the epoch's save."
    import teachloop.callback.tracker as tracker
    learn = digits_learner_fp32(SaveModel('valid_loss', 'min', folder / 'best.pt'))
    saves, read = [], []
    plain_save = tracker.atomic_save
    def save(*args, **kwargs):
        saves.append(learn.epoch)
        return plain_save(*args, **kwargs)
    tracker.atomic_save = save
    class ReadBack(Callback):
        order = SaveModel.order + 1  # right after SaveModel: the file must be whole in every rank by then
        def after_epoch(self):
            saved = torch.load(folder / 'best.pt', weights_only=True)['model']
            read.append(all(torch.equal(v, saved[k]) for k, v in self.learn.model.state_dict().items()))
    with learn.distributed(): learn.fit(3, 0.05, cbs=[ReadBack()])
    return saves, [row[2] for row in learn.recorder.values], read


def test_save_model_writes_from_rank_zero_and_the_others_wait_for_it(tmp_path):
    ranks = run_ranks(save_the_best_on_two_ranks, tmp_path, **FORK)
    (saves0, losses, read0), (saves1, losses1, read1) = ranks
    improved = [epoch for epoch, loss in enumerate(losses) if loss < min(losses[:epoch], default=math.inf)]
    assert losses == losses1 and improved and saves0 == improved and saves1 == []
    # read by both ranks right after each epoch's save: the file holds that epoch's weights exactly when it improved
    assert read0 == read1 == [epoch in improved for epoch in range(3)]


class OwnLosses(Callback):
    "This rank's own loss of each training batch, read before DistributedTrainer sends it; cancel (in every rank) some batches."
    order = 10
    def __init__(self, cancel=None): self.cancel, self.seen = cancel, []
    def after_loss(self):
        if not self.learn.training: return
        self.seen.append(self.learn.loss.item())
        if self.cancel is CancelBatchException and self.learn.iter % 5 == 3: raise self.cancel()
    def before_backward(self):  # a backward cancelled by a callback that runs before DistributedTrainer's `before_backward`
        if self.cancel is CancelBackwardException and self.learn.iter % 5 == 4: raise self.cancel()


def own_and_recorded_losses(dtype, cancel):
    "A fit of one epoch: each batch's loss as this rank computed it, and as the Recorder holds it."
    set_seed(0)
    x, y = load_digits_tensors()
    own = OwnLosses(cancel)
    learn = Learner(tensor_dls(x.to(dtype), y, bs=32), digits_cnn().to(dtype),
                    lambda pred, target: torch.nn.functional.cross_entropy(pred.float(), target),  # a float32 loss
                    opt_func=SGD_MOM, lr=0.1, cbs=[own])
    learn.progress.show_bar = learn.progress.print_rows = False
    with learn.distributed(): learn.fit(1)
    return own.seen, learn.recorder.losses


@pytest.mark.numeric
@pytest.mark.parametrize('dtype, cancel', [(torch.float32, CancelBatchException), (torch.float32, CancelBackwardException),
                                           (torch.bfloat16, None)])
@pytest.mark.float32
def test_recorded_losses_are_the_means_over_the_ranks(dtype, cancel):
    "Also of batches cancelled before their backward (no gradients carry them), and of a float32 loss of bf16 weights."
    (own0, recorded0), (own1, recorded1) = run_ranks(own_and_recorded_losses, dtype, cancel, **FORK)
    assert recorded0 == recorded1 and len(recorded0) == len(own0) == 23
    # float32 losses, halved and summed in float32: a rounding of 2**-24 relative each time, 1e-6 leaves room for two
    assert all(math.isclose(mean, (a + b) / 2, rel_tol=1e-6) for mean, a, b in zip(recorded0, own0, own1))


def ctrl_c_at_the_fits_last_step(event):
    learn = digits_learner_fp32()
    try:
        with learn.distributed(): learn.fit(1, cbs=[CtrlC(1, 22, event)])
    except KeyboardInterrupt: return learn.train_iter
    return None


@pytest.mark.parametrize('event', ['after_backward', 'after_step'])
def test_a_ctrl_c_after_the_fits_last_message_left_still_stops_every_rank(event):
    assert run_ranks(ctrl_c_at_the_fits_last_step, event, **FORK) == [23, 23]


def ctrl_c_after_data_parallels_after_batch():
    "A Ctrl-C in rank 1 in a callback's `after_batch` after DistributedTrainer's (order 45): the Recorder's, a Checkpoint's."
    learn = digits_learner_fp32()
    try:
        # `train_iter` counts step 30 done in `after_batch` (order -10): 31 is step 30's, a step carrying a message
        with learn.distributed(): learn.fit(2, cbs=[CtrlC(1, 31, 'after_batch', order=60)])
    except KeyboardInterrupt: return learn.train_iter
    return None


def test_a_ctrl_c_late_in_a_batch_waits_for_the_next_message_in_every_rank():
    "Rank 1's gate hands it to DistributedTrainer instead of raising it alone: both ranks stop after step 38, the next message."
    assert run_ranks(ctrl_c_after_data_parallels_after_batch, **FORK) == [39, 39]


def refuse_a_deferred_nan_check(folder):
    learn = digits_learner_fp32(NaNCapture(folder, check_every=2, sync_free=True))
    weights = [p.clone() for p in learn.model.parameters()]
    with learn.distributed():
        try: learn.fit(1)
        except ValueError as e: return str(e), all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters()))


def test_nan_capture_refuses_deferred_answers_when_several_processes_train(tmp_path):
    "Each rank would read its answer at its own step: refused before the fit changes anything."
    for message, untouched in run_ranks(refuse_a_deferred_nan_check, tmp_path, **FORK):
        assert 'NaNCapture(sync_free=True)' in message and 'with several processes' in message and untouched


class BlockOnRankZero(Callback):
    "In rank 0, put a folder where the file `path` is about to be written (at the first epoch's end): its write fails."
    order = 0
    def __init__(self, path): self.path = path
    def after_epoch(self):
        if process_rank() == 0 and self.epoch == 0: self.path.mkdir()


def a_write_that_fails_on_rank_zero(folder, saver):
    path = folder / 'best.pt' if saver == 'SaveModel' else folder / 'epoch-001.pt'
    cb = SaveModel('valid_loss', 'min', path) if saver == 'SaveModel' else Checkpoint(folder)
    learn = digits_learner_fp32(cb, BlockOnRankZero(path))
    start = time.monotonic()
    try:
        with learn.distributed(): learn.fit(2)
    except Exception as e: return type(e).__name__, str(e), time.monotonic() - start, learn.epoch
    return None


@pytest.mark.parametrize('saver', ['SaveModel', 'Checkpoint'])
def test_a_write_that_fails_in_rank_zero_stops_every_rank_with_its_reason(tmp_path, saver):
    (kind0, message0, seconds0, epoch0), (kind1, message1, seconds1, epoch1) = run_ranks(
        a_write_that_fails_on_rank_zero, tmp_path, saver, **FORK)
    assert kind0 == 'IsADirectoryError' and epoch0 == epoch1 == 0  # within run_ranks's limit: no rank left waiting
    assert kind1 == 'RuntimeError' and 'rank 0 could not write' in message1 and 'IsADirectoryError' in message1


class Crash(Callback):
    "Raise in rank `rank` at training step `at`."
    def __init__(self, rank, at): self.rank, self.at = rank, at
    def after_loss(self):
        if self.learn.training and self.learn.train_iter == self.at and process_rank() == self.rank:
            raise ValueError(f"rank {self.rank} broke at step {self.at}")


def crash_on_rank_one():
    return digits_fit(32, 0.1, 2, SGD_MOM, cbs=[Crash(1, 3)])


@pytest.mark.parametrize('start_method', ['forkserver', 'spawn'])  # the two a notebook may use
def test_a_rank_that_raises_stops_the_others_with_a_clear_error(start_method):
    with pytest.raises(RankFailed, match=r"rank 1 of 2 raised ValueError: rank 1 broke at step 3") as failed:
        run_ranks(crash_on_rank_one, world_size=2, timeout=120, start_method=start_method)
    assert 'Traceback' in str(failed.value)


class CancelInOneRank(Callback):
    "Raise `cancel` in rank 1's `event` at its training step `at` (the first epoch's)."
    def __init__(self, cancel, event, at=3): self.cancel, self.event, self.at = cancel, event, at
    def _maybe(self, event):
        if self.training and event == self.event and self.train_iter == self.at and process_rank() == 1: raise self.cancel()
    def before_batch(self): self._maybe('before_batch')
    def after_pred(self): self._maybe('after_pred')
    def after_loss(self): self._maybe('after_loss')
    def before_backward(self): self._maybe('before_backward')
    def after_backward(self): self._maybe('after_backward')
    def before_step(self): self._maybe('before_step')
    def after_step(self): self._maybe('after_step')
    def after_batch(self): self._maybe('after_batch')


def cancel_in_one_rank(cancel, event):
    learn = digits_learner_fp32(CancelInOneRank(cancel, event))
    with learn.distributed():
        learn.fit(2)
        n_iter = len(learn.dls.train)  # this rank's shard
    return {'steps': learn.train_iter, 'rows': [row[:3] for row in learn.recorder.values], 'n_iter': n_iter,
            'weights': {k: v.clone() for k, v in learn.model.state_dict().items()}}


@pytest.mark.parametrize('cancel, event', [(CancelFitException, 'after_loss'), (CancelEpochException, 'after_loss'),
                                           (CancelTrainException, 'after_batch')])
def test_a_cancel_raised_in_one_rank_is_agreed_by_every_rank_after_the_same_batch(cancel, event):
    "Rank 1 alone cancels at its step 3: the request rides with the next message (8 steps apart at most), and every"
    " rank then cancels the same after the same batch, with the same weights."
    rank0, rank1 = run_ranks(cancel_in_one_rank, cancel, event, **FORK)
    assert rank0['steps'] == rank1['steps'] and str(rank0['rows']) == str(rank1['rows'])  # (nan: not validated)
    assert all(torch.equal(rank0['weights'][k], rank1['weights'][k]) for k in rank0['weights'])
    n_iter, steps, rows = rank0['n_iter'], rank0['steps'], rank0['rows']
    if cancel is CancelFitException: assert 3 < steps <= 3 + 1 + 8 and len(rows) <= 1  # stopped in the first epoch
    else: assert n_iter + 3 < steps <= n_iter + 3 + 1 + 8 and len(rows) == 2  # the first epoch cut short, the second whole
    if cancel is CancelEpochException: assert math.isnan(rows[0][2])  # the cut epoch was not validated
    if cancel is CancelTrainException: assert not math.isnan(rows[0][2])  # its training cut short, the epoch was


def cancel_alone(cancel, event, strategy, at=3):
    learn = digits_learner_fp32(CancelInOneRank(cancel, event, at))
    try:
        with learn.distributed(strategy=strategy): learn.fit(2)
    except RanksDisagree as e: refused = str(e)
    else: refused = None
    return learn.train_iter, refused, {k: v.clone() for k, v in learn.model.state_dict().items()}


@pytest.mark.parametrize('at', [3, 6, 7])  # 7: a batch that carries a message (every 8th), 6: the one before it
@pytest.mark.parametrize('cancel, event', [(CancelBatchException, 'after_loss'), (CancelBackwardException, 'before_backward'),
                                           (CancelStepException, 'before_step')])
def test_a_cancel_of_a_batch_or_step_in_one_rank_alone_is_refused_at_the_next_step(cancel, event, at):
    "Before: a batch or backward cancelled in rank 1 alone ended in gloo's abort (SIGABRT), a step trained on apart silently."
    (iter0, refused0, weights0), (iter1, refused1, weights1) = run_ranks(cancel_alone, cancel, event, 'ddp', at, **FORK)
    assert refused0 == refused1 and 'CancelBatchException, CancelBackwardException or CancelStepException' in refused0
    if cancel is CancelStepException:  # both at the next step, rank 1 one step behind: refused with the weights apart
        assert (iter0, iter1) == (at + 1, at + 1) and f'rank 0 at training batch {at + 1} of the fit, 0 cancelled; ' \
                                                       f'rank 1 at training batch {at + 1} of the fit, 1 cancelled' in refused0
    else:  # rank 0's step met rank 1's next one: refused before the optimizer stepped on the mixed gradients
        assert (iter0, iter1) == (at, at + 1) and f'rank 0 at training batch {at} of the fit, 0 cancelled; rank 1 at ' \
                                                  f'training batch {at + 1} of the fit, 1 cancelled' in refused0
        assert all(torch.equal(weights0[k], weights1[k]) for k in weights0)


def test_a_batch_cancelled_in_one_rank_after_its_step_parts_no_rank():
    "Cancelled in `after_step` (as the learner's message suggests), the step was taken in every rank: nothing to refuse."
    (iter0, refused0, weights0), (iter1, refused1, weights1) = run_ranks(cancel_alone, CancelBatchException, 'after_step',
                                                                         'ddp', **FORK)
    assert refused0 is refused1 is None and iter0 == iter1
    assert all(torch.equal(weights0[k], weights1[k]) for k in weights0)


# One for each part whose collectives a lone cancel skips: the forward, the backward, the step.
@pytest.mark.parametrize('cancel, event', [(CancelBatchException, 'before_batch'), (CancelBackwardException, 'before_backward'),
                                           (CancelBatchException, 'after_backward'), (CancelStepException, 'before_step')])
def test_a_batch_backward_or_step_cancelled_in_one_rank_alone_under_fsdp2_is_refused_before_its_collectives(cancel, event):
    "Before: a lone cancel before the backward ended in gloo's abort (SIGABRT), a lone step's in a refusal 8 steps on."
    (iter0, refused0, _), (iter1, refused1, _) = run_ranks(cancel_alone, cancel, event, 'fsdp', **FORK)
    # both ranks stop at the cancelled batch, before the part whose collectives rank 1 skips (its step included)
    assert (iter0, iter1) == (3, 3) and refused0 == refused1
    assert 'rank 0 at training batch 3 of the fit, 0 cancelled; rank 1 at training batch 3 of the fit, 1 cancelled' in refused0



def cancel_alone_accumulating(folder, event, at):
    "A lone CancelBatchException at `event` of rank 1's batch `at`, under FSDP2 with gradient accumulation and NaNCapture."
    learn = digits_learner_fp32(CancelInOneRank(CancelBatchException, event, at), GradientAccumulation(128),
                                NaNCapture(folder))
    try:
        with learn.distributed(strategy='fsdp'): learn.fit(1)
    except RanksDisagree as e: return learn.train_iter, str(e)
    return learn.train_iter, None


@pytest.mark.parametrize('event, at', [('after_backward', 4), ('after_backward', 5)])  # a batch that ends no step; one that does
def test_a_lone_cancel_under_fsdp2_with_accumulation_and_nan_capture_is_refused_at_its_batch(tmp_path, event, at):
    "Two batches of 32 on each of 2 ranks make a step of 128: batch 4 is set aside (NaNCapture checks it: a collective)."
    (iter0, refused0), (iter1, refused1) = run_ranks(cancel_alone_accumulating, str(tmp_path), event, at, **FORK)
    assert (iter0, iter1) == (at, at) and refused0 == refused1
    assert f'rank 1 at training batch {at} of the fit, 1 cancelled' in refused0


def environment_variable(name): return os.environ.get(name)


def test_the_ranks_get_the_environment_of_the_moment_they_start(monkeypatch):
    "A forkserver's processes fork from a server started earlier, whose variables are older: they still get today's."
    run_ranks(environment_variable, 'TEACHLOOP_SET_LATER', world_size=2, timeout=120)  # the server runs from here on
    monkeypatch.setenv('TEACHLOOP_SET_LATER', 'set after the first call')
    assert run_ranks(environment_variable, 'TEACHLOOP_SET_LATER', world_size=2, timeout=120) == \
        ['set after the first call'] * 2


def raise_and_live_on(folder):
    "Rank 1's fit raises at step 3; the error is caught, and each rank lives on."
    learn = digits_learner_fp32(Crash(1, 3))
    try:
        with learn.distributed(): learn.fit(2)
    except Exception as e: found = (type(e).__name__, str(e), getattr(e, '__notes__', []), learn.train_iter)
    (folder / f'rank{process_rank()}-done').touch()
    # rank 1 stays, its process alive, until rank 0 has its answer: before, rank 0 waited out the group's timeout
    while not (folder / 'rank0-done').exists(): time.sleep(0.01)
    return found, torch.distributed.is_initialized()


def test_a_rank_that_raises_and_lives_on_stops_the_others_at_once_naming_it(tmp_path):
    "The others' collective fails when the rank ends its group, not after the group's timeout (here run_ranks's 120 s)."
    (error0, alive0), (error1, alive1) = run_ranks(raise_and_live_on, tmp_path, **FORK)
    assert error1[:2] == ('ValueError', 'rank 1 broke at step 3') and error1[3] == 3
    assert error1[2] == ['(raised in Crash.after_loss)']  # the learner's note, no other rank's
    assert error0[3] in (3, 4)  # rank 0 stopped in the step it waited for rank 1 in (its loss of step 3 computed)
    assert error0[2][-1] == ('rank 1 of 2 raised ValueError: rank 1 broke at step 3 (the first rank whose fit raised); '
                             'this rank stopped with it')
    assert not alive0 and not alive1  # the group is ended: its ranks no longer meet in the same collectives


class RefuseFirstFit(Callback):
    def before_fit(self):
        if self.learn.fit_state.epoch == 0 and not getattr(self, 'refused', False):
            self.refused = True
            raise ValueError("refused")


def refused_then_fit():
    learn = digits_learner_fp32(RefuseFirstFit())
    with learn.distributed():
        with pytest.raises(ValueError, match='refused'): learn.fit(1)
        learn.fit(1)
    return learn.train_iter, [p.detach().clone() for p in learn.model.parameters()]


def test_a_fit_refused_before_its_loop_in_every_rank_leaves_the_group_in_step():
    (iters0, weights0), (iters1, weights1) = run_ranks(refused_then_fit, **FORK)
    assert iters0 == iters1 == 23 and all(torch.equal(a, b) for a, b in zip(weights0, weights1))


def test_without_a_process_group_distributed_refuses_before_anything_changes(monkeypatch):
    learn = digits_learner_fp32()
    dls, cbs = learn.dls, list(learn.cbs)
    monkeypatch.setenv('WORLD_SIZE', '2')
    with pytest.raises(ValueError, match='init_distributed'):
        with learn.distributed(): learn.fit(1)
    assert learn.dls is dls and learn.cbs == cbs and learn.opt is None


class Stream(IterableDataset):
    def __iter__(self): return iter([(torch.zeros(2), torch.zeros(1))] * 4)


@pytest.mark.parametrize('train, message', [
    ([(torch.zeros(4, 2), torch.zeros(4, 1))], 'not a torch DataLoader'),
    (DataLoader(Stream(), batch_size=2), 'IterableDataset'),
    (DataLoader(TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1)), batch_size=2, sampler=range(8)), 'DistributedSampler'),
])
def test_loaders_a_sampler_cannot_share_out_are_refused_before_anything_changes(train, message):
    set_seed(0)
    learn = Learner(DataLoaders(train), torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, default_cbs=False)
    dls, weights = learn.dls, [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=message):
        with learn.distributed(): learn.fit(1)
    assert learn.dls is dls and learn.opt is None and all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters()))


def test_alone_the_shards_are_the_whole_data_in_the_distributed_sampler_order():
    dls = tensor_dls(*load_digits_tensors(), bs=32)
    alone = shard_dls(dls, 0, 1)
    sampler = alone.train.sampler
    sampler.set_epoch(3)
    expected = DistributedSampler(dls.train.dataset, num_replicas=1, rank=0, shuffle=True, seed=42)
    expected.set_epoch(3)
    assert list(sampler) == list(expected) and sorted(sampler) == list(range(len(dls.train.dataset)))
    assert list(alone.valid.sampler) == list(range(len(dls.valid.dataset)))
    check_world()  # alone, without WORLD_SIZE: nothing to join


def nccl_fit():
    return digits_fit(32, 0.1, 3, SGD_MOM, cbs=[])  # one epoch of 45 steps leaves the loss near 2.2 even on one CPU


@pytest.mark.cuda
def test_the_same_fit_on_gpus_with_nccl():
    "One process per GPU (a single GPU is a world of 1, still through DDP and nccl): identical weights, a loss that falls."
    ranks = run_ranks(nccl_fit, world_size=torch.cuda.device_count(), backend='nccl', timeout=300)
    for rank in ranks[1:]:
        assert all(torch.equal(w, ranks[0]['weights'][k]) for k, w in rank['weights'].items())
    assert ranks[0]['values'][-1][2] < 1.0 and ranks[0]['values'][-1][3] > 0.8  # one CPU process: 0.24 and 0.94


def quiet_except_rank_zero():
    "What rank 1's progress callback shows during a fit and after the block, with rank 0's."
    learn = digits_learner_fp32()
    learn.progress.show_bar = learn.progress.print_rows = True
    seen = []
    class Look(Callback):
        def after_epoch(self): seen.append((self.learn.progress.show_bar, self.learn.progress.print_rows, shout.loud,
                                            self.learn.processes.several))
    class Shout(Callback):  # a user's callback that shows something takes part by saying how to quieten it
        loud = True
        def quieten(self):
            self.loud = False
            return lambda: setattr(self, 'loud', True)
    shout = Shout()
    learn.add_cbs([shout])
    with learn.distributed():
        learn.fit(1, cbs=[Look()])
        valid = learn.validate()  # outside a fit, in the block: each rank its shard, summed
        weights = [p.clone() for p in learn.model.parameters()]
        try: learn.fit(1, cbs=[TerminateOnNaN()])
        except ValueError as e: refused = str(e) if all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters())) else None
    return (seen, (learn.progress.show_bar, learn.progress.print_rows, shout.loud, learn.processes.several), valid,
            learn.validate(), refused)


def test_only_rank_zero_shows_progress_and_rows_and_validate_sums_the_shards():
    "And a callback that would stop one rank on its own loss is refused before the fit changes anything."
    ranks = run_ranks(quiet_except_rank_zero, **FORK)
    assert all('TerminateOnNaN would stop the fit' in rank[4] for rank in ranks)
    assert ranks[0][:2] == ([(True, True, True, True)], (True, True, True, False))
    assert ranks[1][:2] == ([(False, False, False, True)], (True, True, True, False))
    # after the block each rank validates on the whole set alone: the same numbers, to float32's rounding
    assert ranks[0][2] == ranks[1][2] and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(ranks[0][2], ranks[0][3]))


def test_the_callback_alone_is_refused_before_anything_changes():
    from teachloop.callback.distributed import DistributedTrainer
    learn = digits_learner_fp32()
    with pytest.raises(ValueError, match='learn.distributed'): learn.fit(1, cbs=[DistributedTrainer()])
    assert learn.opt is None and learn.train_iter == 0


class Started(Callback):
    "Write the file `started` into `folder` in rank 0 at training step `at`."
    def __init__(self, folder, at): self.folder, self.at = folder, at
    def after_batch(self):
        if self.learn.training and self.learn.train_iter == self.at and process_rank() == 0:
            (self.folder / 'started').touch()


def long_fit(folder):
    learn = digits_learner_fp32(Checkpoint(folder), Started(folder, 30))
    with learn.distributed(): learn.fit(50)


def interrupt_when_started(folder):
    "Send this process a Ctrl-C once `folder/started` exists (the ranks are training)."
    deadline = time.monotonic() + 60
    while not (folder / 'started').exists() and time.monotonic() < deadline: time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_in_the_launching_process_stops_every_rank_after_the_same_batch(tmp_path):
    "As 'interrupt kernel' in a notebook: `run_ranks` passes the Ctrl-C on, the ranks stop together, rank 0 saves."
    import threading
    threading.Thread(target=interrupt_when_started, args=(tmp_path,), daemon=True).start()
    with pytest.raises(KeyboardInterrupt): run_ranks(long_fit, tmp_path, **FORK)
    state = torch.load(tmp_path / 'interrupted.pt', weights_only=True)
    assert state['progress']['resumable'] and 30 < state['progress']['train_iter'] < 50 * 23


def evaluate_on_some_ranks(rank0, rank1):
    "After a fit in the block, rank 0 does `rank0` and rank 1 does `rank1` ('validate', 'get_preds', 'fit' or nothing)."
    learn = digits_learner_fp32()
    calls = {'validate': learn.validate, 'get_preds': learn.get_preds, 'fit': lambda: learn.fit(1)}
    start = time.monotonic()
    try:
        with learn.distributed():
            learn.fit(1)
            start, weights = time.monotonic(), [p.clone() for p in learn.model.parameters()]
            action = rank0 if process_rank() == 0 else rank1
            result = calls[action]() if action else None
    except Exception as e:
        untouched = all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters()))
        return type(e).__name__, str(e), time.monotonic() - start, untouched
    return 'done', result if action == 'validate' else None, time.monotonic() - start, None


@pytest.mark.parametrize('rank0, rank1, said', [
    ('validate', None, ['rank 0 validates (learn.validate or learn.get_preds)', 'rank 1 leaves the block']),
    ('get_preds', None, ['rank 0 validates (learn.validate or learn.get_preds)', 'rank 1 leaves the block']),
    ('validate', 'fit', ['rank 0 validates (learn.validate or learn.get_preds)', 'rank 1 fits']),
    (None, 'fit', ['rank 0 leaves the block', 'rank 1 fits']),
])
def test_ranks_doing_different_things_in_the_block_all_stop_at_once_saying_what_each_did(rank0, rank1, said):
    "Instead of the one left waiting failing on a closed connection once the other has gone (or both waiting forever)."
    for kind, message, seconds, untouched in run_ranks(evaluate_on_some_ranks, rank0, rank1, **FORK):
        assert kind == 'RanksDisagree' and all(part in message for part in said), message
        # at once: a rank left waiting would sit in its collective for 300 s, past run_ranks's limit (FORK's 120 s)
        assert 'validate on every rank, or after the block' in message
        assert untouched is not False  # a fit that would have gone on alone is refused before it changes anything


def test_validating_on_every_rank_in_the_block_still_works():
    (kind0, values0, _, _), (kind1, values1, _, _) = run_ranks(evaluate_on_some_ranks, 'validate', 'validate', **FORK)
    assert kind0 == kind1 == 'done' and values0 == values1 and len(values0) == 2


class BreakAt(Callback):
    "Raise in every rank at training step `at`."
    def __init__(self, at): self.at = at
    def after_loss(self):
        if self.learn.training and self.learn.train_iter == self.at: raise ValueError(f"broke at step {self.at}")


def batch_norm_fits(bs, sync_bn):
    "Two fits of the BatchNorm CNN in float64 in one block, the optimizer made before it; its layers in and after the block."
    set_seed(0)
    x, y = load_digits_tensors()
    learn = Learner(tensor_dls(x.double(), y, bs=bs), digits_bn_cnn().double(), torch.nn.functional.cross_entropy,
                    opt_func=SGD_MOM, lr=0.1)
    learn.progress.show_bar = learn.progress.print_rows = False
    learn.create_opt()
    own = batch_norm_layers(learn.model)
    with learn.distributed(sync_bn=sync_bn):
        learn.fit(1)
        inside = [type(m).__name__ for m in batch_norm_layers(learn.model)]
        learn.fit(1)
    restored = all(a is b for a, b in zip(batch_norm_layers(learn.model), own))
    weights = {k: v.clone() for k, v in learn.model.state_dict().items()}
    try:  # a block left by an error gives the layers back too
        with learn.distributed(sync_bn=sync_bn): learn.fit(1, cbs=[BreakAt(3)])
    except ValueError: restored_after_error = all(a is b for a, b in zip(batch_norm_layers(learn.model), own))
    return weights, inside, restored, restored_after_error


@pytest.mark.numeric
def test_sync_bn_on_two_ranks_equals_one_process_with_the_doubled_batch():
    "Weights and running statistics; without the switch each rank normalises its own shard, another fit."
    alone, *_ = batch_norm_fits(64, False)
    for sync_bn in (True, False):
        for weights, inside, restored, restored_after_error in run_ranks(batch_norm_fits, 32, sync_bn, **FORK):
            assert restored and restored_after_error and len(inside) == 3
            assert inside == (['GlobalBatchNorm'] * 3 if sync_bn else ['BatchNorm2d'] * 3)
            gap = max((weights[k] - w).abs().max().item() for k, w in alone.items())
            # float64 and the sums of the shards added in another order than one batch's: 1e-10 leaves a factor of 1e5
            if sync_bn: assert gap < 1e-10
            else: assert gap > 1e-3  # 0.2 here: statistics of 32 items in each rank instead of the 64 of one batch


class BatchNormKinds(Callback):
    "The classes of the model's BatchNorm layers at the end of the fit."
    def after_fit(self): self.kinds = [type(m).__name__ for m in batch_norm_layers(self.learn.model)]


def gpu_batch_norm_fit():
    kinds = BatchNormKinds()
    fit = digits_fit(32, 0.1, 1, SGD_MOM, cbs=[kinds], batch_norm=True, sync_bn=True)
    return kinds.kinds, fit['values']


@pytest.mark.cuda
def test_sync_bn_on_gpus_is_torchs_sync_batch_norm():
    for kinds, values in run_ranks(gpu_batch_norm_fit, world_size=torch.cuda.device_count(), backend='nccl', timeout=300):
        assert kinds == ['SyncBatchNorm'] * 3 and values[-1][3] > 0.5


def test_sync_bn_on_a_model_without_batch_norm_is_refused_before_anything_changes():
    learn = digits_learner_fp32()
    dls, cbs = learn.dls, list(learn.cbs)
    with pytest.raises(ValueError, match=r'sync_bn=True, but the model has no BatchNorm layer'):
        with learn.distributed(sync_bn=True): learn.fit(1)
    assert learn.dls is dls and learn.cbs == cbs and learn.opt is None


def global_batch_norm_on_half(x, weight, upstream):
    "A GlobalBatchNorm (cumulative running statistics) on this rank's half of `x`, and the gradients of `(out * upstream).sum()`."
    layer = GlobalBatchNorm(x.shape[1], momentum=None).double()
    with torch.no_grad(): layer.weight.copy_(weight)
    half = x.chunk(2)[dist.get_rank()].clone().requires_grad_()
    out = layer(half)
    (out * upstream.chunk(2)[dist.get_rank()]).sum().backward()
    return out.detach(), half.grad, layer.weight.grad, layer.bias.grad, layer.running_mean, layer.running_var


@pytest.mark.numeric
def test_global_batch_norm_on_two_halves_is_batch_norm_on_the_whole_batch():
    "Outputs, input gradients and running statistics; the ranks' weight gradients add up to the whole batch's."
    generator = torch.Generator().manual_seed(0)
    x, upstream = (torch.randn(8, 3, 5, dtype=torch.float64, generator=generator) * 2 + 1 for _ in range(2))
    weight = torch.rand(3, dtype=torch.float64, generator=generator) + 0.5
    halves = run_ranks(global_batch_norm_on_half, x, weight, upstream, **FORK)
    reference = torch.nn.BatchNorm1d(3, momentum=None).double()
    with torch.no_grad(): reference.weight.copy_(weight)
    whole = x.clone().requires_grad_()
    out = reference(whole)
    (out * upstream).sum().backward()
    ours = [torch.cat([h[i] for h in halves]) for i in (0, 1)] + [sum(h[i] for h in halves) for i in (2, 3)]
    theirs = [out.detach(), whole.grad, reference.weight.grad, reference.bias.grad]
    for i in (4, 5): assert torch.equal(halves[0][i], halves[1][i])
    ours += [halves[0][4], halves[0][5]]
    theirs += [reference.running_mean, reference.running_var]
    for name, a, b in zip(('output', 'input grad', 'weight grad', 'bias grad', 'running mean', 'running var'), ours, theirs):
        # float64 on values of order 1-10: the sums of squares lose a few digits to the mean's square, nowhere near 1e-12
        assert (a - b).abs().max() < 1e-12, name


# ---- each rank its shards (FSDP2): checkpoints, accumulation and clipping

def sharded_fit_and_report(learn, **kwargs):
    from teachloop.callback.distributed import gathered
    with learn.distributed(strategy='fsdp'): learn.fit_one_cycle(2, 0.1, **kwargs)
    return {'weights': {k: gathered(v).clone() for k, v in learn.model.state_dict().items()},
            'rows': [row[:4] for row in learn.recorder.values], 'losses': learn.recorder.losses}


def sharded_interrupted_and_resumed(folder):
    "FSDP2: a fit never stopped; one stopped by a Ctrl-C in rank 1 at step 30; fits resumed from its file and the first epoch's."
    whole = sharded_fit_and_report(digits_learner_fp32(Checkpoint(folder / 'whole')))
    learn = digits_learner_fp32(Checkpoint(folder / 'cut'))
    try: sharded_fit_and_report(learn, cbs=[CtrlC(1, 30, 'after_loss')])
    except KeyboardInterrupt: stopped_at = learn.train_iter
    else: raise AssertionError("the Ctrl-C did not stop the fit")
    dist.barrier()
    saved = torch.load(folder / 'cut' / 'interrupted.pt', weights_only=True)
    local = {k: v.to_local().shape for k, v in learn.model.state_dict().items()}
    from_ctrl_c = sharded_fit_and_report(digits_learner_fp32(Checkpoint(folder / 'again')),
                                         resume=folder / 'cut' / 'interrupted.pt')
    from_epoch = sharded_fit_and_report(digits_learner_fp32(Checkpoint(folder / 'epoch')),
                                        resume=folder / 'cut' / 'epoch-001.pt')
    return whole, from_ctrl_c, from_epoch, stopped_at, {k: v.shape for k, v in saved['model'].items()}, local


@pytest.mark.slow
def test_sharded_checkpoints_hold_the_whole_model_and_resume_exactly(tmp_path):
    ranks = run_ranks(sharded_interrupted_and_resumed, tmp_path, **FORK)
    assert ranks[0][3] == ranks[1][3] == 31
    whole_shapes, local_shapes = ranks[0][4], ranks[0][5]
    # the file holds each parameter whole, and each rank trains on its rows only (the first dimension cut in two)
    assert whole_shapes['0.0.weight'] == (16, 1, 3, 3) and local_shapes['0.0.weight'] == (8, 1, 3, 3)
    for whole, *resumed in (rank[:3] for rank in ranks):
        for fit in resumed:
            assert all(torch.equal(fit['weights'][k], w) for k, w in whole['weights'].items())
            assert fit['rows'] == whole['rows'] and fit['losses'] == whole['losses']


def accumulated_and_clipped(strategy, bs):
    "The float64 digits CNN, steps of 64 samples in batches of `bs` per rank, gradients clipped to norm 0.5."
    from teachloop.callback.core import GradientAccumulation
    from teachloop.callback.distributed import gathered
    from teachloop.callback.faults import GradientClipping
    set_seed(0)
    x, y = load_digits_tensors()
    class Steps(Callback):
        taken = 0
        def after_step(self): self.taken += 1
    steps = Steps()
    learn = Learner(tensor_dls(x.double(), y, bs=bs), digits_cnn().double(), torch.nn.functional.cross_entropy,
                    opt_func=SGD_MOM, lr=0.1, cbs=[GradientAccumulation(64), GradientClipping(0.5), steps])
    learn.progress.show_bar = learn.progress.print_rows = False
    with learn.distributed(strategy=strategy): learn.fit(1)
    return [gathered(p.detach()).clone() for p in learn.model.parameters()], steps.taken


def test_sharded_accumulation_and_clipping_equal_one_process_with_the_global_batch():
    "Two ranks of 16 items a batch, FSDP2, a step every 2 batches, clipped by the global norm: one process of 32 a batch."
    ranks = run_ranks(accumulated_and_clipped, 'fsdp', 16, **FORK)
    alone, steps = accumulated_and_clipped('ddp', 32)  # a world of one: the items in the order the two ranks share
    assert ranks[0][1] == steps and steps > 10
    # float64: the shards' gradients are reduce-scattered, summed in another order than one batch's (1e-16 a step)
    assert max((a - b).abs().max().item() for a, b in zip(ranks[0][0], alone)) <= 1e-12
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][0], ranks[1][0]))


# ---- the whole set in the block, data sets of other lengths, per-rank seeds, another global batch

def float64_learner(n_train=192, n_valid=11, bs=16):
    "The digits CNN in float64 on `n_train` training items and an odd number of validation items (an uneven last shard)."
    set_seed(0)
    x, y = load_digits_tensors()
    dls = DataLoaders(DataLoader(TensorDataset(x[:n_train].double(), y[:n_train]), batch_size=bs, shuffle=True,
                                 generator=torch.Generator().manual_seed(0)),
                      DataLoader(TensorDataset(x[-n_valid:].double(), y[-n_valid:]), batch_size=4))
    learn = Learner(dls, digits_cnn().double(), torch.nn.functional.cross_entropy, opt_func=SGD_MOM, lr=0.1,
                    metrics=[accuracy])
    learn.progress.show_bar = learn.progress.print_rows = False
    return learn


def predictions_in_and_after_the_block():
    learn = float64_learner()
    with learn.distributed():
        learn.fit(1)
        inside = learn.get_preds(with_input=True, with_decoded=True), learn.validate()
    return inside, (learn.get_preds(with_input=True, with_decoded=True), learn.validate())


@pytest.mark.numeric
def test_get_preds_and_validate_in_the_block_give_the_whole_set_in_order():
    "Before, each rank got its shard's predictions (6 and 5 of 11 items), silently."
    for (preds, valid), (alone, valid_alone) in run_ranks(predictions_in_and_after_the_block, **FORK):
        inputs, probs, targets, decoded = preds
        assert len(probs) == 11 and torch.equal(inputs, alone[0]) and torch.equal(targets, alone[2])
        assert torch.equal(decoded, alone[3])
        # float64: the same weights on every item, in batches of other items (the sums' order differs at most)
        assert (probs - alone[1]).abs().max() < 1e-12
        assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(valid, valid_alone))


def fit_on_data_of_another_length(lengths):
    learn = float64_learner(n_train=lengths[process_rank()])
    weights = [p.clone() for p in learn.model.parameters()]
    own, cbs = learn.dls, list(learn.cbs)
    try:
        with learn.distributed(): learn.fit(1)
    except ValueError as e:
        untouched = all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters()))
        return str(e), untouched and learn.dls is own and learn.cbs == cbs
    return None, None


@pytest.mark.parametrize('lengths', [(192, 190), (192, 120)])
def test_ranks_with_data_sets_of_other_lengths_are_refused_when_the_block_starts(lengths):
    "Before: 192 and 190 items trained on silently with other losses per rank; 192 and 120 ended in a C++ abort."
    for message, untouched in run_ranks(fit_on_data_of_another_length, lengths, **FORK):
        assert f"training sets differ in length (rank 0: {lengths[0]}, rank 1: {lengths[1]})" in message
        assert untouched


def draws_with_rank_seeds(rank_seed):
    set_seed(0)
    learn = float64_learner()
    with learn.distributed(rank_seed=rank_seed): inside = torch.rand(4)
    return inside


def test_rank_seed_gives_each_rank_its_own_random_numbers():
    "As Accelerate's device_specific seeds: the same seed plus the rank (dropout masks differ between the shards)."
    apart = run_ranks(draws_with_rank_seeds, 7, **FORK)
    for rank, drawn in enumerate(apart):
        set_seed(7 + rank)
        assert torch.equal(drawn, torch.rand(4))
    assert not torch.equal(apart[0], apart[1])
    same = run_ranks(draws_with_rank_seeds, None, **FORK)
    assert torch.equal(same[0], same[1])  # by default the ranks' streams are left as they were (seeded alike here)
    with pytest.raises(ValueError, match='rank_seed must be a whole number >= 0'):
        with float64_learner().distributed(rank_seed=-1): pass


def interrupted_mid_epoch(folder):
    learn = float64_learner(bs=8)  # 12 batches an epoch in each rank
    learn.add_cbs([Checkpoint(folder)])
    with learn.distributed():
        try: learn.fit(2, cbs=[CtrlC(1, 3, 'after_loss')])
        except KeyboardInterrupt: return learn.train_iter
    raise AssertionError("the Ctrl-C did not stop the fit")


def test_a_mid_epoch_resume_with_another_global_batch_is_refused_before_anything_is_loaded(tmp_path):
    "Before: 2 processes of 8 resumed by one of 8 trained on silently, on other items."
    assert run_ranks(interrupted_mid_epoch, tmp_path, **FORK) == [8, 8]  # the ranks agree on the Ctrl-C at step 8
    path = tmp_path / 'interrupted.pt'
    learn = float64_learner(bs=8)
    weights = [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError) as refused: learn.fit(2, resume=path)
    message = str(refused.value)
    assert ('written in epoch 0 after 8 batches, by 2 processes with batches of 8 (a global batch of 16); this fit has '
            '1 process with batches of 8 (a global batch of 8)') in message and "latest.pt" in message
    assert all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters())) and not learn.recorder.values
    # the same global batch in one process goes on
    learn = float64_learner(bs=16)
    with pytest.warns(UserWarning, match='random states of 2 processes'): learn.fit(2, resume=path)
    assert len(learn.recorder.values) == 2


def save_and_export_in_the_block(folder, strategy):
    "In the block: `learn.save` and `learn.export` from every rank; how many times this rank traced and wrote a program."
    import teachloop.inference as inference
    from teachloop.learner import gathered
    traced, trace_and_write = [], inference.trace_and_write
    inference.trace_and_write = lambda *args: traced.append(1) or trace_and_write(*args)
    learn = float64_learner()
    learn.add_cbs([SaveModel('valid_loss', 'min', folder / f'{strategy}-best.pt')])  # and loads the best at the end
    with learn.distributed(strategy=strategy):
        learn.fit(1)
        learn.save(folder / f'{strategy}.pt')
        whole = {k: gathered(v).clone() for k, v in learn.model.state_dict().items()}
        try: refused = str(learn.export(folder / f'{strategy}.pt2')) and None
        except ValueError as e: refused = str(e)
    return len(traced), whole, refused


@pytest.mark.parametrize('strategy', ['ddp', 'fsdp'])
def test_save_and_export_in_the_block_write_the_whole_model_once(tmp_path, strategy):
    "Before, every rank wrote the export; under FSDP2 `learn.save` and SaveModel wrote rank 0's shards alone, and `export` was refused."
    from teachloop.inference import load_learner
    (traced0, whole, refused0), (traced1, _, refused1) = run_ranks(save_and_export_in_the_block, tmp_path, strategy, **FORK)
    for name in (f'{strategy}.pt', f'{strategy}-best.pt'):  # one epoch: the best weights are the last
        saved = torch.load(tmp_path / name, weights_only=True)['model']
        assert saved['0.0.weight'].shape == (16, 1, 3, 3) and all(torch.equal(saved[k], w) for k, w in whole.items())
    learn = float64_learner()
    learn.load(tmp_path / f'{strategy}.pt')  # the whole model, in one process
    # rank 0 traced the whole model (under FSDP2 its gathered copy) and wrote it; rank 1 waited
    assert (traced0, traced1, refused0, refused1) == (1, 0, None, None)
    x = learn.dls.valid.dataset.tensors[0]
    exported = load_learner(tmp_path / f'{strategy}.pt2')
    assert torch.equal(exported.model(x), learn.model.eval()(x))


def export_of_a_model_that_cannot_be_copied(folder):
    "A forward hook holding a lock (which no copy takes): sharded all the same; `export` refused, saying why."
    import threading
    class Guarded:
        def __init__(self): self.lock = threading.Lock()
        def __call__(self, module, inputs, output): return output
    learn = float64_learner()
    learn.model.register_forward_hook(Guarded())
    with learn.distributed(strategy='fsdp'):
        learn.fit(1)
        try: learn.export(folder / 'guarded.pt2')
        except ValueError as e: return str(e)


def test_a_model_that_cannot_be_copied_still_shards_and_its_export_says_why(tmp_path):
    refused = run_ranks(export_of_a_model_that_cannot_be_copied, tmp_path, **FORK)
    assert refused[0] == refused[1] and 'could not be copied before sharding (TypeError' in refused[0]
    assert not (tmp_path / 'guarded.pt2').exists()


def export_of_a_model_sharded_by_hand(folder):
    "`fully_shard` called by the user, not by `learn.distributed`: `export` refused in the block, nothing written."
    from torch.distributed.fsdp import fully_shard
    learn = float64_learner()
    fully_shard(learn.model)
    with learn.distributed():
        try: learn.export(folder / 'by-hand.pt2')
        except ValueError as e: return str(e)


def test_export_of_a_model_sharded_by_hand_is_refused_naming_the_ways_to_export_it(tmp_path):
    refused = run_ranks(export_of_a_model_sharded_by_hand, tmp_path, **FORK)
    assert refused[0] == refused[1] and "learn.distributed(strategy='fsdp')" in refused[0] and 'learn.save(path)' in refused[0]
    assert not (tmp_path / 'by-hand.pt2').exists()


def rows_gathered_both_ways():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from teachloop.learner import rows_through_host
    whole = torch.arange(15, dtype=torch.float64).reshape(5, 3)  # 5 rows: 3 on rank 0, 2 on rank 1
    rows = distribute_tensor(whole, init_device_mesh('cpu', (2,)), [Shard(0)])
    return rows.to_local().shape, rows_through_host(rows), rows.full_tensor()


def test_rows_sent_through_the_host_make_the_whole_tensor_as_dtensors_all_gather():
    "The way gloo gathers GPU shards (its functional all-gather crashed there), checked on the CPU against DTensor's own."
    for (local, through_host, full), rows in zip(run_ranks(rows_gathered_both_ways, **FORK), (3, 2)):
        assert local == (rows, 3) and torch.equal(through_host, full) and torch.equal(full, torch.arange(15.).reshape(5, 3).double())


NODE_SCRIPT = '''
import os, sys, torch
from pathlib import Path
from teachloop.callback.distributed import digits_fit, init_distributed
from teachloop.callback.loggers import CSVLogger
from teachloop.core import default_device
init_distributed('gloo')
folder = Path(sys.argv[1])  # this node's own folder: nothing is shared between the nodes
result = digits_fit(32, 0.1, 1, dtype=torch.float64, cbs=[CSVLogger(folder / 'log.csv')])
torch.save({'weights': result['weights'], 'values': result['values'], 'device': str(default_device()),
            **{k: int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'GROUP_RANK')}}, folder / 'result.pt')
'''


@pytest.mark.slow
def test_two_nodes_launched_by_torchrun_with_c10d_rendezvous_equal_one_process(tmp_path):
    "Two launches of `torchrun --nnodes 2` on this host, one process each, meeting through c10d's rendezvous."
    import subprocess
    import sys
    from pathlib import Path
    from teachloop.callback.distributed import free_port
    script = tmp_path / 'train.py'
    script.write_text(NODE_SCRIPT)
    endpoint, nodes = f'127.0.0.1:{free_port()}', [tmp_path / 'node0', tmp_path / 'node1']
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(Path(__file__).resolve().parents[1])}
    launches = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--nnodes', '2', '--nproc-per-node', '1',
                                  '--rdzv-backend', 'c10d', '--rdzv-endpoint', endpoint, '--rdzv-id', 'teachloop',
                                  str(script), str(folder)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
                for folder in nodes if folder.mkdir() is None]
    outputs = [launch.communicate(timeout=600)[0] for launch in launches]  # a net for a hang, not a measure
    assert all(launch.returncode == 0 for launch in launches), outputs
    results = [torch.load(folder / 'result.pt', weights_only=True) for folder in nodes]
    assert sorted(r['RANK'] for r in results) == [0, 1] and {r['LOCAL_RANK'] for r in results} == {0}
    assert {r['WORLD_SIZE'] for r in results} == {2} and {r['device'] for r in results} == {'cpu'}
    first = next(folder for folder, r in zip(nodes, results) if r['RANK'] == 0)
    assert [sorted(p.name for p in folder.iterdir()) for folder in nodes if folder != first] == [['result.pt']]
    assert (first / 'log.csv').read_text().count('\n') == 2  # the header and epoch 0: written by global rank 0 only
    alone = digits_fit(64, 0.1, 1, dtype=torch.float64)
    for r in results:
        # float64: the two halves' gradients are summed in another order than one batch's (1e-16 a step)
        assert max((w - alone['weights'][k]).abs().max().item() for k, w in r['weights'].items()) < 1e-10
        assert [row[:4] for row in r['values']] == [row[:4] for row in results[0]['values']]  # all but the time


def resume_from_a_folder_this_node_lacks(folder):
    "Rank 0 finds the checkpoint; rank 1's path leads nowhere, as on a second machine that does not share the folder."
    learn = float64_learner()
    weights = [p.clone() for p in learn.model.parameters()]
    path = folder / 'run' / 'latest.pt' if process_rank() == 0 else folder / 'elsewhere' / 'latest.pt'
    start = time.monotonic()
    try:
        with learn.distributed(): learn.fit(2, resume=path)
    except ValueError as e:
        return str(e), time.monotonic() - start, all(torch.equal(a, b) for a, b in zip(weights, learn.model.parameters()))
    return None, None, None


def test_a_resume_that_a_rank_cannot_read_is_refused_in_every_rank_naming_the_folder_to_share(tmp_path):
    "Before: rank 1 failed to read the file while rank 0 went into the fit and died later on a closed connection."
    learn = float64_learner()
    learn.add_cbs([Checkpoint(tmp_path / 'run')])
    learn.fit(1)  # in this process: the checkpoint the ranks resume from
    for message, seconds, untouched in run_ranks(resume_from_a_folder_this_node_lacks, tmp_path, **FORK):
        assert message.startswith('rank 1 of 2 could not read the checkpoint') and 'must be shared' in message
        assert untouched  # refused before the fit in both ranks: none left waiting in a collective (run_ranks's limit)


def mixed_precision_fit(strategy, dtype):
    from teachloop.callback.core import MixedPrecision
    from teachloop.learner import gathered
    learn = digits_learner_fp32(MixedPrecision(dtype))
    with learn.distributed(strategy=strategy): learn.fit(3)
    return [gathered(p.detach()).clone() for p in learn.model.parameters()], [row[:4] for row in learn.recorder.values]



class InfInRankZero(Callback):
    "An inf in rank 0's own gradients at training batch 2 (under FSDP2 in its shard only), after the backward."
    def after_backward(self):
        if self.training and self.train_iter == 2 and process_rank() == 0:
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, 'to_local') else grad).view(-1)[0] = float('inf')


def lone_inf_fit():
    from teachloop.callback.core import MixedPrecision
    learn = digits_learner_fp32(MixedPrecision(torch.float16), InfInRankZero())
    with learn.distributed(strategy='fsdp'): learn.fit(1)
    return learn.mixed_precision.skipped, learn.mixed_precision.scaler.get_scale()


def test_an_inf_in_one_ranks_shard_skips_the_float16_step_in_every_rank():
    "Each rank unscales its own shards: DTensor's check for non-finite values agrees over the ranks, so every rank skips."
    (skipped0, scale0), (skipped1, scale1) = run_ranks(lone_inf_fit, **FORK)
    assert skipped0 == skipped1 == 1 and scale0 == scale1

@pytest.mark.slow
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_mixed_precision_under_fsdp2_trains_as_under_ddp(dtype):
    "Autocast and (float16) the loss scale on sharded parameters: the same fit as DDP's, both ranks alike."
    sharded = run_ranks(mixed_precision_fit, 'fsdp', dtype, **FORK)
    whole, rows = run_ranks(mixed_precision_fit, 'ddp', dtype, **FORK)[0]
    assert all(torch.equal(a, b) for a, b in zip(sharded[0][0], sharded[1][0]))
    # float32 weights, the gradients reduce-scattered instead of all-reduced: summed in another order, about 1 ulp
    # (6e-8 of a weight) a step, 2.5e-8 apart after the 69 steps here; 1e-5 is far below what a skipped step or a
    # wrong loss scale does (1e-3 and more)
    assert max((a - b).abs().max().item() for a, b in zip(sharded[0][0], whole)) < 1e-5
    assert rows[-1][3] > 0.5 and all(math.isclose(a, b, rel_tol=1e-5) for r, s in zip(rows, sharded[0][1]) for a, b in zip(r, s))


def nan_under_fsdp2(folder):
    from teachloop.callback.distributed import PoisonBatch
    from teachloop.learner import gathered
    learn = digits_learner_fp32(NaNCapture(folder))
    with learn.distributed(strategy='fsdp'): learn.fit(2, cbs=[PoisonBatch(1, 5)])
    return learn.train_iter, learn.nan_capture.captured, all(bool(gathered(p.detach()).isfinite().all()) for p in learn.model.parameters())


def test_a_nan_on_one_sharded_rank_stops_both_at_that_step_with_finite_weights(tmp_path):
    assert run_ranks(nan_under_fsdp2, tmp_path, **FORK) == [(5, str(tmp_path / f'nan-capture-rank{r}.pt'), True) for r in (0, 1)]


def dashboard_and_trackers(strategy):
    import numpy as np
    from teachloop.dashboard.live import TrainingDashboard
    dashboard, tracker = TrainingDashboard(live=False), EffectiveLRTracker(every=3)
    learn = float64_learner()
    learn.opt_func = Adam  # effective lrs that differ between the elements of a layer, and so between its shards
    learn.add_cbs([dashboard])
    with learn.distributed(strategy=strategy): learn.fit(2, lr=1e-2, cbs=[tracker])
    effective = [v for h in tracker.history for v in h['effective_lr'].values()]
    return (dashboard.series['loss'].y.copy(), {k: dict(zip(s.x.tolist(), s.y.tolist())) for k, s in dashboard.ratio_series.items()},
            [h['update_ratio'] for h in tracker.history], [h['effective_lr'] for h in tracker.history],
            all(bool(np.isfinite(v.numpy()).all()) for v in effective))


def test_the_dashboard_and_the_effective_lr_tracker_watch_a_sharded_fit_whole():
    "Under FSDP2 they measure every layer whole, as under DDP; before, rank 0's rows only (and before that, a crash)."
    sharded, whole = (run_ranks(dashboard_and_trackers, strategy, **FORK)[0] for strategy in ('fsdp', 'ddp'))
    close = lambda a, b: float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max() / torch.as_tensor(b).abs().max())
    # float64: the two strategies sum the shards' gradients in other orders (1e-16 a step)
    assert len(sharded[0]) == len(whole[0]) == 12 and close(sharded[0], whole[0]) < 1e-12
    # the dashboard measures a step when it draws a frame: the steps both fits measured
    both = {k: sorted(v.keys() & whole[1][k].keys()) for k, v in sharded[1].items()}
    assert sharded[1].keys() == whole[1].keys() and all(both.values()) and all(
        close([v[step] for step in both[k]], [whole[1][k][step] for step in both[k]]) < 1e-10 for k, v in sharded[1].items())
    assert len(sharded[2]) == len(whole[2]) == 4 and all(
        a.keys() == b.keys() and all(close(a[k], b[k]) < 1e-10 for k in a) for a, b in zip(sharded[2], whole[2]))
    assert all(a.keys() == b.keys() and all(close(a[k], b[k]) < 1e-10 for k in a) for a, b in zip(sharded[3], whole[3]))
    assert sharded[4] and whole[4]  # every layer's effective lrs, finite
