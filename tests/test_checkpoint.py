"""Checkpoints: exact resume (weights bit for bit, same losses), refusals that change nothing, atomic files, trackers."""
import math
import re
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teachloop.callback.checkpoint import Checkpoint, read_checkpoint
from teachloop.callback.tracker import EarlyStopping, ReduceLROnPlateau, SaveModel, TrackerCallback
from teachloop.data import digits_cnn, digits_dls
from teachloop.learner import Callback, CancelFitException, Learner
from teachloop.optim.core import SGD, Adam
from teachloop.optim.recent import ScheduleFreeAdamW

from teachloop.callback.schedule import ParamScheduler, one_cycle_scheds
from teachloop.testing import digits_learner, quiet


class StopAfterEpoch(Callback):
    order = 80
    def __init__(self, epoch): self.stop_epoch = epoch
    def after_epoch(self):
        if self.epoch == self.stop_epoch: raise CancelFitException()


class CtrlCAt(Callback):
    "Raise KeyboardInterrupt before training batch `at_iter` of epoch `at_epoch`, as a Ctrl-C would."
    def __init__(self, at_epoch, at_iter): self.at = (at_epoch, at_iter)
    def before_batch(self):
        if self.training and (self.epoch, self.iter) == self.at: raise KeyboardInterrupt


class Dropout(nn.Module):
    "The digits CNN with a dropout layer, so that the fit draws from torch's global generator every step."
    def __init__(self):
        super().__init__()
        self.body, self.drop = digits_cnn(), nn.Dropout(0.3)
    def forward(self, x): return self.body(self.drop(x))


def weights_equal(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def history(learn):
    return learn.recorder.losses, [row[:-1] for row in learn.recorder.values], dict(learn.recorder.hps)


SETUPS = {
    'sgd': dict(opt_func=lambda params, lr: SGD(params, lr, mom=0.9), lr=0.05, scheds=None),
    'adam': dict(opt_func=Adam, lr=3e-3, scheds=None),
    'one_cycle': dict(opt_func=Adam, lr=3e-3, scheds=lambda: one_cycle_scheds(1e-2)),
    # validation swaps the averaged weights in and out of the model: a resumed fit must swap them the same way
    'schedule_free': dict(opt_func=ScheduleFreeAdamW, lr=3e-3, scheds=None),
}


@pytest.mark.parametrize('stop', ['after_epoch', 'ctrl_c_mid_epoch'])
@pytest.mark.parametrize('setup', SETUPS)
def test_resumed_fit_equals_uninterrupted_fit_bit_for_bit(tmp_path, setup, stop):
    opt_func, lr, scheds = SETUPS[setup]['opt_func'], SETUPS[setup]['lr'], SETUPS[setup]['scheds']
    def sched_cbs(): return [ParamScheduler(scheds())] if scheds else []
    def learner():
        return digits_learner(opt_func=opt_func, lr=lr, model_fn=Dropout,
                              metrics=[lambda p, t: (p.argmax(1) == t).float().mean()])
    straight = learner()
    straight.fit(4, cbs=sched_cbs())
    stopped = learner()
    if stop == 'after_epoch':
        stopped.fit(4, cbs=sched_cbs() + [Checkpoint(tmp_path), StopAfterEpoch(1)])
        path = tmp_path / 'latest.pt'
    else:
        with pytest.raises(KeyboardInterrupt): stopped.fit(4, cbs=sched_cbs() + [Checkpoint(tmp_path), CtrlCAt(2, 7)])
        path = tmp_path / 'interrupted.pt'
        assert read_checkpoint(path)['progress']['batches_done'] == 7
    assert not weights_equal(straight, stopped)
    resumed = learner()
    resumed.fit(4, cbs=sched_cbs(), resume=path)
    assert weights_equal(straight, resumed)
    assert history(straight) == history(resumed)
    assert resumed.opt.state_dict()['state'].keys() == straight.opt.state_dict()['state'].keys()
    for k, v in straight.opt.state_dict()['state'].items():
        for name, value in v.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed.opt.state_dict()['state'][k][name]))


def test_resume_with_fit_one_cycle_from_the_schedule_module(tmp_path):
    straight = digits_learner()
    straight.fit_one_cycle(3, 1e-2)
    stopped = digits_learner()
    stopped.fit_one_cycle(3, 1e-2, cbs=[Checkpoint(tmp_path), StopAfterEpoch(0)])
    resumed = digits_learner()
    resumed.fit_one_cycle(3, 1e-2, resume=tmp_path / 'latest.pt')
    assert weights_equal(straight, resumed) and history(straight) == history(resumed)


def test_checkpoint_files_keep_and_latest(tmp_path):
    learn = digits_learner()
    learn.fit(5, cbs=[Checkpoint(tmp_path, every_n_epochs=2, keep=1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['epoch-004.pt', 'latest.pt']
    assert os.path.samefile(tmp_path / 'epoch-004.pt', tmp_path / 'latest.pt')
    state = read_checkpoint(tmp_path / 'latest.pt')
    assert state['progress']['epochs_done'] == 4 and len(state['callbacks']['recorder']['values']) == 4
    with pytest.raises(ValueError, match='every_n_epochs'): Checkpoint(tmp_path, every_n_epochs=0)
    with pytest.raises(ValueError, match='keep'): Checkpoint(tmp_path, keep=0)


def test_keep_removes_only_files_this_callback_wrote(tmp_path):
    earlier = tmp_path / 'epoch-009.pt'  # an earlier, longer fit's file in the same folder
    earlier.write_bytes(b'an earlier fit')
    digits_learner().fit(3, cbs=[Checkpoint(tmp_path, keep=1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['epoch-003.pt', 'epoch-009.pt', 'latest.pt']
    assert earlier.read_bytes() == b'an earlier fit'


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    learn = digits_learner()
    learn.fit(1)
    learn.save_checkpoint(tmp_path / 'ck.pt')
    good = (tmp_path / 'ck.pt').read_bytes()
    real_save = torch.save
    def crashing_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)
        raise OSError("disk full")
    monkeypatch.setattr(torch, 'save', crashing_save)
    learn.fit(1)
    with pytest.raises(OSError, match='disk full'): learn.save_checkpoint(tmp_path / 'ck.pt')
    assert (tmp_path / 'ck.pt').read_bytes() == good and os.listdir(tmp_path) == ['ck.pt']


def assert_unchanged(learn, before):
    after = {k: v.clone() for k, v in learn.model.state_dict().items()}
    assert after.keys() == before['model'].keys() and all(torch.equal(after[k], before['model'][k]) for k in after)
    assert history(learn) == before['history'] and learn.opt is before['opt']


def snapshot(learn):
    return {'model': {k: v.clone() for k, v in learn.model.state_dict().items()}, 'history': history(learn), 'opt': learn.opt}


def test_refusals_change_nothing(tmp_path):
    source = digits_learner()
    source.fit(1, cbs=[Checkpoint(tmp_path)])
    other = quiet(Learner(digits_dls(), nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), F.cross_entropy))
    other.fit(1)
    before = snapshot(other)
    with pytest.raises(ValueError, match='do not fit this model'): other.fit(3, resume=tmp_path / 'latest.pt')
    assert_unchanged(other, before)
    (tmp_path / 'cut.pt').write_bytes((tmp_path / 'latest.pt').read_bytes()[:2000])
    learn = digits_learner(seed=1)
    learn.fit(1)
    before = snapshot(learn)
    with pytest.raises(ValueError, match='truncated'): learn.fit(3, resume=tmp_path / 'cut.pt')
    assert_unchanged(learn, before)
    with pytest.raises(ValueError, match='done 1 epochs already'): learn.fit(1, resume=tmp_path / 'latest.pt')
    assert_unchanged(learn, before)
    torch.save({'model': {}}, tmp_path / 'plain.pt')
    with pytest.raises(ValueError, match='not a teachloop checkpoint'): learn.fit(3, resume=tmp_path / 'plain.pt')
    assert_unchanged(learn, before)


def test_refusals_found_only_by_loading_change_nothing(tmp_path):
    "Another optimizer, a missing stateful callback: refused before any callback's before_fit resets the history."
    source = digits_learner(opt_func=SGD, lr=0.05)
    source.fit(2, cbs=[EarlyStopping('valid_loss', 'min', patience=3), Checkpoint(tmp_path), StopAfterEpoch(0)])
    learn = digits_learner(opt_func=Adam)
    learn.fit(1)
    before = snapshot(learn)
    with pytest.raises(ValueError, match='optimizer'):
        learn.fit(2, cbs=[EarlyStopping('valid_loss', 'min', patience=3)], resume=tmp_path / 'latest.pt')
    assert_unchanged(learn, before)
    learn = digits_learner(opt_func=SGD, lr=0.05)
    learn.fit(1)
    before = snapshot(learn)
    with pytest.raises(ValueError, match='early_stopping'): learn.fit(2, resume=tmp_path / 'latest.pt')
    assert_unchanged(learn, before)


def test_a_checkpoint_written_after_a_fit_stopped_inside_a_batch_is_refused_for_resume(tmp_path):
    "An error in a batch's events leaves the model part-way through it: no resume from there, only its weights."
    class Interrupt(Callback):
        def after_pred(self):
            if self.training and self.iter == 5: raise KeyboardInterrupt
    learn = digits_learner()
    with pytest.raises(KeyboardInterrupt): learn.fit(2, cbs=[Interrupt()])
    learn.save_checkpoint(tmp_path / 'mid.pt')
    fresh = digits_learner(seed=1)
    with pytest.raises(ValueError, match='inside batch 5 of epoch 0'): fresh.fit(2, resume=tmp_path / 'mid.pt')
    fresh.load_checkpoint(tmp_path / 'mid.pt')
    assert weights_equal(fresh, learn)


class CtrlCInValidation(Callback):
    "Raise KeyboardInterrupt after validation batch 2 of epoch `epoch`, as a Ctrl-C would."
    def __init__(self, epoch): self.at = epoch
    def after_batch(self):
        if not self.training and self.epoch == self.at and self.iter == 2: raise KeyboardInterrupt


def test_a_ctrl_c_during_a_validation_keeps_the_weights_and_the_fit_goes_on_from_the_last_epochs_end(tmp_path, capsys):
    "The interrupted validation's row would be incomplete: its file is for the weights, latest.pt for the resume."
    whole = digits_learner()
    whole.fit(2)
    stopped = digits_learner()
    with pytest.raises(KeyboardInterrupt): stopped.fit(2, cbs=[Checkpoint(tmp_path), CtrlCInValidation(1)])
    said = capsys.readouterr().out
    assert 'interrupted during a validation' in said and 'latest.pt the end of its last epoch, to resume from' in said
    fresh = digits_learner(seed=1)
    with pytest.raises(ValueError, match='during the validation of epoch 1'):
        fresh.fit(2, resume=tmp_path / 'interrupted.pt')
    fresh.load_checkpoint(tmp_path / 'interrupted.pt')
    assert weights_equal(fresh, stopped)
    fresh.fit(2, resume=tmp_path / 'latest.pt')
    assert weights_equal(fresh, whole) and history(fresh)[0] == history(whole)[0]


def test_interrupted_checkpoint_only_when_the_fit_did_not_end_and_no_step_was_left_half_done(tmp_path):
    learn = digits_learner()
    learn.fit(1, cbs=[Checkpoint(tmp_path)])
    assert not (tmp_path / 'interrupted.pt').exists()
    class FailAfterStep(Callback):
        def after_step(self):
            if self.iter == 3: raise RuntimeError('after the step')
    with pytest.raises(RuntimeError): learn.fit(1, cbs=[Checkpoint(tmp_path), FailAfterStep()])
    assert not (tmp_path / 'interrupted.pt').exists()
    class FailBeforeStep(Callback):
        def before_backward(self):
            if self.iter == 3: raise RuntimeError('before the step')
    with pytest.raises(RuntimeError): learn.fit(2, cbs=[Checkpoint(tmp_path), FailBeforeStep()])
    progress = read_checkpoint(tmp_path / 'interrupted.pt')['progress']
    assert progress['resumable'] and progress['batches_done'] == 3 and progress['epochs_done'] == 0


def test_resume_needs_the_callbacks_whose_state_was_saved(tmp_path):
    learn = digits_learner()
    learn.fit(2, cbs=[EarlyStopping('valid_loss', 'min', patience=3), Checkpoint(tmp_path), StopAfterEpoch(0)])
    assert 'early_stopping' in read_checkpoint(tmp_path / 'latest.pt')['callbacks']
    fresh = digits_learner()
    with pytest.raises(ValueError, match="early_stopping"): fresh.fit(2, resume=tmp_path / 'latest.pt')
    fresh.fit(2, cbs=[EarlyStopping('valid_loss', 'min', patience=3)], resume=tmp_path / 'latest.pt')



class Scripted:
    "A metric whose value at epoch e is `values[e]`."
    __name__ = 'score'
    def __init__(self, values): self.values, self.learn = values, None
    def __call__(self, pred, target): return torch.tensor(float(self.values[self.learn.epoch]))


def scripted_learner(values, **kwargs):
    metric = Scripted(values)
    learn = digits_learner(metrics=[metric], **kwargs)
    metric.learn = learn
    return learn


class KeepWeights(Callback):
    order = 52
    def before_fit(self): self.weights = []
    def after_epoch(self): self.weights.append({k: v.clone() for k, v in self.model.state_dict().items()})


def test_mode_is_checked_and_a_name_that_does_not_say_it_asks_for_it():
    "`mode='auto'` reads the monitored name (tests/test_trackers.py); a name that does not tell, or a bad mode, is refused."
    for cls in (SaveModel, EarlyStopping, ReduceLROnPlateau):
        extra = {'path': 'x.pt'} if cls is SaveModel else {}
        with pytest.raises(ValueError, match="give mode='min' or mode='max'"): cls('my_metric', **extra)
        with pytest.raises(ValueError, match="mode must be 'min'"): cls('accuracy', 'minimum', **extra)
    learn = scripted_learner([0.] * 3)
    with pytest.raises(ValueError, match="monitor 'acc' is not recorded"): learn.fit(1, cbs=[EarlyStopping('acc', 'max')])


@pytest.mark.parametrize('mode, values, min_delta, stopped, best', [
    ('max', [0.2, 0.6, 0.5, 0.55, 0.3, 0.9], 0., 3, 1),
    ('min', [0.9, 0.5, 0.49, 0.495, 0.6, 0.1], 0.02, 3, 1),
    ('min', [0.9, 0.5, 0.4, 0.3, 0.2, 0.1], 0., None, 5),
])
def test_early_stopping_patience_min_delta_and_best_weights(mode, values, min_delta, stopped, best):
    learn = scripted_learner(values)
    stopper, keeper = EarlyStopping('score', mode, patience=2, min_delta=min_delta), KeepWeights()
    learn.fit(6, cbs=[stopper, keeper])
    assert stopper.stopped_epoch == stopped and len(learn.recorder.values) == (stopped + 1 if stopped else 6)
    assert all(torch.equal(v, keeper.weights[best][k]) for k, v in learn.model.state_dict().items())


def test_early_stopping_resumes_with_its_patience(tmp_path):
    values = [0.2, 0.6, 0.5, 0.55, 0.3, 0.9]
    straight = scripted_learner(values)
    straight.fit(6, cbs=[EarlyStopping('score', 'max', patience=2)])
    stopped = scripted_learner(values)
    stopped.fit(6, cbs=[EarlyStopping('score', 'max', patience=2), Checkpoint(tmp_path), StopAfterEpoch(2)])
    resumed = scripted_learner(values)
    stopper = EarlyStopping('score', 'max', patience=2)
    resumed.fit(6, cbs=[stopper], resume=tmp_path / 'latest.pt')
    assert stopper.stopped_epoch == 3 and weights_equal(straight, resumed) and history(straight) == history(resumed)


@pytest.mark.parametrize('cls', [EarlyStopping, SaveModel, ReduceLROnPlateau])
def test_a_resume_with_a_tracker_of_another_monitor_or_mode_is_refused_before_anything_changes(tmp_path, cls):
    "Its best value is of the value it followed: compared with another one's, it would decide at random."
    def tracker(monitor, mode):
        return cls(monitor, mode, path=tmp_path / 'best.pt') if cls is SaveModel else cls(monitor, mode, patience=3)
    values = [0.5, 0.4, 0.45, 0.3]
    source = scripted_learner(values)
    source.fit(4, cbs=[tracker('score', 'max'), Checkpoint(tmp_path), StopAfterEpoch(1)])
    assert {'monitor': 'score', 'mode': 'max'}.items() <= read_checkpoint(tmp_path / 'latest.pt')['callbacks'][
        tracker('score', 'max').name].items()
    learn = scripted_learner(values, seed=1)
    learn.fit(1)
    before = snapshot(learn)
    for monitor, mode in [('valid_loss', 'min'), ('score', 'min')]:
        with pytest.raises(ValueError, match=rf"followed 'score' \(mode='max'\), this {cls.__name__} follows "
                                             rf"'{monitor}' \(mode='{mode}'\).*Resume with {cls.__name__}\('score', "
                                             r"'max', \.\.\.\).*or start a new fit"):
            learn.fit(4, cbs=[tracker(monitor, mode)], resume=tmp_path / 'latest.pt')
        assert_unchanged(learn, before)
    resumed = tracker('score', 'max')
    learn.fit(4, cbs=[resumed], resume=tmp_path / 'latest.pt')  # the same monitor and mode: it goes on
    assert resumed.best == pytest.approx(0.5) and len(learn.recorder.values) == 4


def test_a_trackers_state_saved_without_its_monitor_is_taken(tmp_path):
    "A checkpoint written before trackers saved what they followed says nothing: it resumes as before."
    values = [0.5, 0.4, 0.45, 0.3, 0.35]
    straight = scripted_learner(values)
    straight.fit(5, cbs=[EarlyStopping('score', 'max', patience=3)])
    source = scripted_learner(values)
    source.fit(5, cbs=[EarlyStopping('score', 'max', patience=3), Checkpoint(tmp_path), StopAfterEpoch(1)])
    state = torch.load(tmp_path / 'latest.pt', weights_only=True)
    for key in ('monitor', 'mode'): del state['callbacks']['early_stopping'][key]
    torch.save(state, tmp_path / 'older.pt')
    resumed, stopper = scripted_learner(values), EarlyStopping('score', 'max', patience=3)
    resumed.fit(5, cbs=[stopper], resume=tmp_path / 'older.pt')
    assert weights_equal(straight, resumed) and history(straight) == history(resumed) and stopper.best == pytest.approx(0.5)
    other = EarlyStopping('valid_loss', 'min')
    other.load_state_dict(state['callbacks']['early_stopping'])  # nothing says it differs: taken, as before
    with pytest.raises(ValueError, match="followed 'score'"):
        other.load_state_dict(read_checkpoint(tmp_path / 'latest.pt')['callbacks']['early_stopping'])


def test_save_model_keeps_the_best_epoch(tmp_path):
    learn = scripted_learner([0.5, 0.3, 0.4, 0.2, 0.35])
    keeper = KeepWeights()
    learn.fit(5, cbs=[SaveModel('score', 'min', tmp_path / 'best.pt'), keeper])
    saved = torch.load(tmp_path / 'best.pt', weights_only=True)['model']
    assert all(torch.equal(v, keeper.weights[3][k]) for k, v in saved.items())


def test_reduce_lr_on_plateau():
    learn = scripted_learner([0.5, 0.6, 0.7, 0.4, 0.45, 0.5], opt_func=SGD, lr=0.1)
    learn.fit(6, cbs=[ReduceLROnPlateau('score', 'min', patience=2, factor=0.5, min_lr=0.03)])
    per_epoch = [learn.recorder.lrs[i * len(learn.dls.train)] for i in range(6)]
    assert per_epoch == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.05])
    assert learn.opt.hypers[0]['lr'] == pytest.approx(0.03)
    with pytest.raises(ValueError, match='factor'): ReduceLROnPlateau('score', 'min', factor=2)


@pytest.mark.parametrize('order', [0, 49, 51, 100])
def test_a_save_at_an_epochs_end_resumes_from_the_next_epoch_whatever_its_order(tmp_path, order):
    "A user's callback saving in `after_epoch`, before or after the Recorder's row: the same exact resume."
    class SaveAtEpochEnd(Callback):
        def after_epoch(self):
            if self.epoch == 0: self.learn.save_checkpoint(tmp_path / 'end.pt')
    SaveAtEpochEnd.order = order
    whole = digits_learner()
    whole.fit(2)
    first = digits_learner(SaveAtEpochEnd())
    first.fit(1)
    resumed = digits_learner()
    resumed.fit(2, resume=tmp_path / 'end.pt')
    assert weights_equal(resumed, whole) and history(resumed)[:2] == history(whole)[:2]


def test_paths_are_checked_when_the_callbacks_are_made(tmp_path):
    from teachloop.dashboard.live import TrainingDashboard
    from teachloop.callback.nan_capture import NaNCapture
    a_file = tmp_path / 'a-file'
    a_file.write_text('')
    assert NaNCapture(tmp_path).path == str(tmp_path / 'nan-capture.pt')  # a folder, as the seed's callback takes
    assert SaveModel('valid_loss', 'min', tmp_path).path == tmp_path / 'model.pt'
    assert TrainingDashboard(save_path=f'{tmp_path}/figures/').save_path == tmp_path / 'figures' / 'dashboard.png'
    for make in (lambda: NaNCapture(a_file / 'nan.pt'), lambda: Checkpoint(a_file), lambda: Checkpoint(a_file / 'sub'),
                 lambda: SaveModel('valid_loss', 'min', a_file / 'best.pt'),
                 lambda: TrainingDashboard(save_path=a_file / 'dashboard.png')):
        with pytest.raises(ValueError, match="a-file"): make()


def test_a_nan_capture_into_a_folder_is_written_there(tmp_path):
    from teachloop.callback.nan_capture import NaNCapture, load_capture
    class NaNAt(Callback):
        order = 15
        def after_backward(self):
            if self.train_iter == 3: next(self.model.parameters()).grad.view(-1)[0] = float('nan')
    learn = digits_learner(NaNCapture(tmp_path), NaNAt())
    learn.fit(1)
    assert load_capture(tmp_path / 'nan-capture.pt')['train_iter'] == 3


class Augmented(torch.utils.data.Dataset):
    "The digits with random noise drawn from torch's global generator as each image is loaded; optionally a Ctrl-C."
    def __init__(self, x, y): self.x, self.y, self.interrupt_at, self.loaded = x, y, None, 0
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        self.loaded += 1
        if self.loaded == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, arriving while a batch is being drawn
        return self.x[i] + 0.1 * torch.randn_like(self.x[i]), self.y[i]


def augmented_learner():
    from teachloop.data import DataLoaders, load_digits_tensors
    x, y = load_digits_tensors()
    train = torch.utils.data.DataLoader(Augmented(x[:1024], y[:1024]), batch_size=64, shuffle=True,
                                        generator=torch.Generator().manual_seed(0))
    valid = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[1024:], y[1024:]), batch_size=256)
    torch.manual_seed(0)
    return quiet(Learner(DataLoaders(train, valid), digits_cnn(), F.cross_entropy, lr=3e-3))


def test_a_ctrl_c_while_an_augmented_batch_is_drawn_resumes_exactly(tmp_path):
    "Random augmentation from the global generator and a real Ctrl-C during loading: the resumed fit is the same."
    straight = augmented_learner()
    straight.fit(2)
    stopped = augmented_learner()
    stopped.dls.train.dataset.interrupt_at = 1024 + 64 * 5 + 6  # epoch 2, while its batch 5 (of 16) is drawn
    with pytest.raises(KeyboardInterrupt): stopped.fit(2, cbs=[Checkpoint(tmp_path)])
    progress = read_checkpoint(tmp_path / 'interrupted.pt')['progress']
    assert (progress['epochs_done'], progress['batches_done']) == (1, 6)  # the batch being drawn was trained on first
    resumed = augmented_learner()
    resumed.fit(2, resume=tmp_path / 'interrupted.pt')
    assert weights_equal(straight, resumed) and history(straight) == history(resumed)


def augmented_learner_with(train_loader_args):
    "The augmented digits with the training loader built from `train_loader_args(dataset)`, and dropout drawing too."
    from teachloop.data import DataLoaders, load_digits_tensors
    x, y = load_digits_tensors()
    dataset = Augmented(x[:1024], y[:1024])
    train = torch.utils.data.DataLoader(dataset, batch_size=64, **train_loader_args(dataset))
    valid = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[1024:], y[1024:]), batch_size=256)
    torch.manual_seed(0)
    return quiet(Learner(DataLoaders(train, valid), Dropout(), F.cross_entropy, lr=3e-3))


LOADERS = {
    'own_generator': lambda ds: dict(shuffle=True, generator=torch.Generator().manual_seed(0)),
    # the sampler draws its permutation from torch's global generator, the loader only its workers' base seed
    'sampler_on_global_rng': lambda ds: dict(sampler=torch.utils.data.RandomSampler(ds),
                                             generator=torch.Generator().manual_seed(0)),
    'no_generator': lambda ds: dict(shuffle=True),
}


class FailDuringBatch(Callback):
    "An error in the forward pass of training batch `at` of epoch 1, after the batch was drawn (and augmented)."
    def __init__(self, at, event): self.at, self.event = at, event
    def _fail(self):
        if self.training and (self.epoch, self.iter) == (1, self.at): raise RuntimeError('out of memory (played)')
    def before_batch(self):
        if self.event == 'before_batch': self._fail()
    def after_pred(self):
        if self.event == 'after_pred': self._fail()


@pytest.mark.parametrize('event', ['before_batch', 'after_pred'])
@pytest.mark.parametrize('loader', LOADERS)
def test_an_error_in_the_middle_of_an_augmented_batch_resumes_exactly(tmp_path, loader, event):
    "The random states saved are those of the batch boundary, not of the error's moment (batch drawn, dropout run)."
    straight = augmented_learner_with(LOADERS[loader])
    straight.fit(2)
    failed = augmented_learner_with(LOADERS[loader])
    with pytest.raises(RuntimeError, match='played'):
        failed.fit(2, cbs=[Checkpoint(tmp_path), FailDuringBatch(5, event)])
    assert read_checkpoint(tmp_path / 'interrupted.pt')['progress']['batches_done'] == 5
    resumed = augmented_learner_with(LOADERS[loader])
    resumed.fit(2, resume=tmp_path / 'interrupted.pt')
    assert weights_equal(straight, resumed) and history(straight) == history(resumed)


def test_a_save_at_an_epochs_end_waits_for_every_callback_and_resumes_whatever_its_order(tmp_path):
    "A callback of order 0 saving in after_epoch, before EarlyStopping (55) has counted that epoch: the file is written"
    " once every callback has heard the epoch's end, and the resumed fit stops where the whole one does."
    class SaveAtEpochEnd(Callback):
        order = 0
        def after_epoch(self):
            if self.epoch == 0: self.learn.save_checkpoint(tmp_path / 'end.pt')
    values = [0.5, 0.6, 0.4, 0.7]
    whole, stopper = scripted_learner(values), EarlyStopping('score', 'min', patience=1)
    whole.fit(4, cbs=[stopper])
    scripted_learner(values).fit(1, cbs=[EarlyStopping('score', 'min', patience=1), SaveAtEpochEnd()])
    assert read_checkpoint(tmp_path / 'end.pt')['callbacks']['early_stopping']['best'] == 0.5  # the tracker had counted it
    resumed, resumed_stopper = scripted_learner(values), EarlyStopping('score', 'min', patience=1)
    resumed.fit(4, cbs=[resumed_stopper], resume=tmp_path / 'end.pt')
    assert resumed_stopper.stopped_epoch == stopper.stopped_epoch == 1 and weights_equal(whole, resumed)


@pytest.mark.parametrize('make', [lambda folder: Checkpoint(folder),
                                  lambda folder: SaveModel('valid_loss', 'min', folder / 'best.pt')])
def test_a_save_folder_spoiled_after_the_callback_was_made_is_refused_before_the_first_step(tmp_path, make):
    "The folder replaced by a file between making the callback and the fit: refused in before_fit, nothing trained."
    callback = make(tmp_path / 'saves')
    (tmp_path / 'saves').write_text('not a folder')
    learn = digits_learner()
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match='saves'): learn.fit(1, cbs=[callback])
    assert learn.train_iter == 0 and all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))


def test_a_save_from_inside_a_batch_keeps_the_random_states_of_its_start(tmp_path):
    "A user's callback saving in before_batch (the batch drawn and augmented already): the resume is still exact."
    class SaveInBatch(Callback):
        def before_batch(self):
            if self.training and (self.epoch, self.iter) == (1, 5): self.learn.save_checkpoint(tmp_path / 'in.pt')
    straight = augmented_learner_with(LOADERS['own_generator'])
    straight.fit(2)
    augmented_learner_with(LOADERS['own_generator']).fit(2, cbs=[Checkpoint(tmp_path), SaveInBatch()])
    assert read_checkpoint(tmp_path / 'in.pt')['progress']['batches_done'] == 5
    resumed = augmented_learner_with(LOADERS['own_generator'])
    resumed.fit(2, resume=tmp_path / 'in.pt')
    assert weights_equal(straight, resumed) and history(straight) == history(resumed)


@pytest.mark.cuda
def test_a_fit_resumed_mid_epoch_on_the_gpu_continues_its_history(tmp_path):
    "The epoch's first losses come back from the file on the CPU; the resumed batches' losses are on the GPU."
    def learner():
        learn = digits_learner()
        learn.device.device = torch.device('cuda')
        return learn
    straight = learner()
    straight.fit(2)
    stopped = learner()
    with pytest.raises(KeyboardInterrupt): stopped.fit(2, cbs=[Checkpoint(tmp_path), CtrlCAt(1, 7)])
    before = stopped.recorder.losses
    resumed = learner()
    resumed.fit(2, resume=tmp_path / 'interrupted.pt')
    losses = resumed.recorder.losses
    assert len(losses) == len(straight.recorder.losses) and losses[:len(before)] == before
    assert len(resumed.recorder.values) == 2 and all(math.isfinite(v) for v in resumed.recorder.values[1][1:3])


# ---- a scheduled fit: the call that continues it, and resumes that would not --------------------------------------

SCHEDULED_FITS = {  # a scheduled fit of 4 epochs (SGDR: 1 + 2), and where a Ctrl-C interrupts it
    'one_cycle': ("fit_one_cycle(4)", (2, 5)),
    'one_cycle_tuned': ("fit_one_cycle(4, lr_max=1e-2, div=10., pct_start=0.4, moms=(0.9, 0.8, 0.9))", (1, 3)),
    'one_cycle_slice': ("fit_one_cycle(4, lr_max=slice(1e-3, 1e-2))", (2, 5)),
    'flat_cos': ("fit_flat_cos(4, lr=1e-2)", (3, 2)),
    'sgdr': ("fit_sgdr(2, 1, lr_max=1e-2)", (1, 4)),
}


def three_group_splitter(model): return [list(m.parameters()) for m in (model[0], model[1], model[2:])]


def scheduled_learner(setup):
    "The digits CNN, batches of 128 (12 a fit's epoch), three parameter groups for a slice of learning rates."
    return digits_learner(bs=128, **({'splitter': three_group_splitter} if setup == 'one_cycle_slice' else {}))


def printed_call(capsys):
    "The call the interrupted fit's message says continues it."
    message = capsys.readouterr().out
    found = re.search(r"`(\w+\(.*\))` continues it", message)
    assert found, message
    return found.group(1)


@pytest.mark.parametrize('setup', SCHEDULED_FITS)
def test_the_printed_call_continues_an_interrupted_scheduled_fit_bit_for_bit(tmp_path, capsys, setup):
    call, at = SCHEDULED_FITS[setup]
    straight = scheduled_learner(setup)
    eval(f"learn.{call}", {'learn': straight})
    stopped = scheduled_learner(setup)
    with pytest.raises(KeyboardInterrupt):
        eval(f"learn.{call[:-1]}, cbs=cbs)", {'learn': stopped, 'cbs': [Checkpoint(tmp_path), CtrlCAt(*at)]})
    resume_call = printed_call(capsys)
    assert resume_call.endswith(f"resume={str(tmp_path / 'interrupted.pt')!r})"), resume_call
    resumed = scheduled_learner(setup)
    eval(f"learn.{resume_call}", {'learn': resumed})
    assert weights_equal(straight, resumed)
    assert history(straight) == history(resumed)  # the losses, the epoch rows, and the lr (and mom) of every batch
    assert straight.recorder.hps['lr'][0] != straight.recorder.hps['lr'][-1]


def one_cycle_interrupted(tmp_path, capsys):
    "A fit_one_cycle(4) interrupted in epoch 2 by a Ctrl-C: its checkpoint, and the call its message printed."
    learn = scheduled_learner('one_cycle')
    with pytest.raises(KeyboardInterrupt): learn.fit_one_cycle(4, cbs=[Checkpoint(tmp_path), CtrlCAt(2, 5)])
    return tmp_path / 'interrupted.pt', printed_call(capsys)


def test_a_resume_with_another_schedule_is_refused_before_the_fit_with_the_call_that_continues(tmp_path, capsys):
    path, call = one_cycle_interrupted(tmp_path, capsys)
    assert call == f"fit_one_cycle(4, lr_max=0.003, resume={str(path)!r})"
    learn = scheduled_learner('one_cycle')
    learn.fit(1)
    before = snapshot(learn)
    for resume in ("learn.fit(4, resume=path)",  # would train at a constant learning rate
                   "learn.fit_one_cycle(4, lr_max=1e-2, resume=path)",
                   "learn.fit_one_cycle(4, pct_start=0.3, resume=path)",
                   "learn.fit_flat_cos(4, resume=path)",
                   "learn.fit(4, cbs=[ParamScheduler(one_cycle_scheds(1e-2))], resume=path)"):
        with pytest.raises(ValueError) as refused: eval(resume, {'learn': learn, 'path': path, **globals()})
        assert f"`{call}`" in str(refused.value), (resume, str(refused.value))
        assert_unchanged(learn, before)
    with pytest.raises(ValueError, match='length'): learn.fit_one_cycle(5, resume=path)
    assert_unchanged(learn, before)


def test_a_resume_with_other_rates_per_group_names_both_lists(tmp_path):
    "A one-cycle fit with a slice of rates (one per group), resumed with another slice: the message shows both."
    learn = scheduled_learner('one_cycle_slice')
    with pytest.raises(KeyboardInterrupt):
        learn.fit_one_cycle(4, lr_max=slice(1e-3, 1e-2), cbs=[Checkpoint(tmp_path), CtrlCAt(2, 5)])
    again = scheduled_learner('one_cycle_slice')
    with pytest.raises(ValueError) as refused: again.fit_one_cycle(4, lr_max=slice(1e-3, 2e-2), resume=tmp_path / 'interrupted.pt')
    assert re.search(r"in 'lr' at training batch 0 \(\[[\d.e-]+, [\d.e-]+, [\d.e-]+\] in the checkpoint's fit, "
                     r"\[[\d.e-]+, [\d.e-]+, [\d.e-]+\] here\)", str(refused.value)), str(refused.value)


def test_rates_that_differ_beyond_four_digits_are_shown_in_full(tmp_path):
    "The rates of a resumed fit are shown to 4 significant digits; where those look alike, in full, so that they differ."
    learn = scheduled_learner('one_cycle')
    with pytest.raises(KeyboardInterrupt): learn.fit_one_cycle(4, lr_max=3e-3, cbs=[Checkpoint(tmp_path), CtrlCAt(2, 5)])
    # one cycle starts at lr_max / 25, to a few ulps (a cosine's end point): 0.00012 saved, to 4 digits
    for lr_max, shown in [(1e-2 / 3, ('0.00012', '0.0001333')), (3.0001e-3, None)]:
        with pytest.raises(ValueError) as refused:
            scheduled_learner('one_cycle').fit_one_cycle(4, lr_max=lr_max, resume=tmp_path / 'interrupted.pt')
        found = re.search(r"in 'lr' at training batch 0 \(([\d.e-]+) in the checkpoint's fit, ([\d.e-]+) here\)",
                          str(refused.value))
        assert found, str(refused.value)
        if shown: assert found.groups() == shown
        else:  # alike to 4 digits: in full, two numbers that differ, each the rate to float64's precision
            assert found[1] != found[2] and [float(v) for v in found.groups()] == pytest.approx([3e-3 / 25, lr_max / 25],
                                                                                                 rel=1e-14)


def test_a_schedule_is_refused_for_a_fit_that_had_none(tmp_path):
    plain = scheduled_learner('one_cycle')
    with pytest.raises(KeyboardInterrupt): plain.fit(4, cbs=[Checkpoint(tmp_path), CtrlCAt(2, 5)])
    learn = scheduled_learner('one_cycle')
    with pytest.raises(ValueError, match=r"no schedule.*`fit\(4, resume="): learn.fit_one_cycle(4, resume=tmp_path / 'interrupted.pt')
    assert learn.train_iter == 0


def test_a_fit_scheduled_by_a_param_scheduler_of_ones_own_needs_the_same_one(tmp_path, capsys):
    def scheduler(lr=1e-2): return ParamScheduler(one_cycle_scheds(lr))
    straight, straight_scheduler = scheduled_learner('one_cycle'), scheduler()
    straight.fit(4, cbs=[straight_scheduler])
    stopped = scheduled_learner('one_cycle')
    with pytest.raises(KeyboardInterrupt): stopped.fit(4, cbs=[scheduler(), Checkpoint(tmp_path), CtrlCAt(2, 5)])
    path = tmp_path / 'interrupted.pt'
    message = capsys.readouterr().out
    assert f"`fit(4, cbs=[...], resume={str(path)!r})` continues it, with the same ParamScheduler in cbs" in message
    learn = scheduled_learner('one_cycle')
    with pytest.raises(ValueError, match=r"ParamScheduler of \['lr', 'mom'\]"): learn.fit(4, resume=path)
    with pytest.raises(ValueError, match=r"differs.*at training batch 0"): learn.fit(4, cbs=[scheduler(2e-2)], resume=path)
    assert learn.train_iter == 0
    resumed_scheduler = scheduler()
    learn.fit(4, cbs=[resumed_scheduler], resume=path)
    assert weights_equal(straight, learn) and history(straight) == history(learn)
    assert resumed_scheduler.hps == straight_scheduler.hps  # what it set before the interruption too


def test_a_learner_with_a_scheduler_of_its_own_can_be_saved_before_any_fit(tmp_path):
    learn = digits_learner(ParamScheduler(one_cycle_scheds(1e-2)))
    learn.save_checkpoint(tmp_path / 'fresh.pt')  # no fit yet, so no length to evaluate the schedule over
    assert read_checkpoint(tmp_path / 'fresh.pt')['schedules'] is None


def test_a_resume_may_leave_out_an_observer_with_a_state_but_not_a_callback_that_changes_the_fit(tmp_path):
    "An observer's saved state (Checkpoint's files) is not needed to go on; a tracker's and EarlyStopping's are."
    straight = digits_learner()
    straight.fit(3)
    watched = digits_learner()
    watched.fit(3, cbs=[Checkpoint(tmp_path / 'watched'), SaveModel('valid_loss', 'min', tmp_path / 'best.pt'),
                        TrackerCallback('valid_loss', 'min'), StopAfterEpoch(0)])
    state = read_checkpoint(tmp_path / 'watched' / 'latest.pt')
    # a tracker of the user's own may act on what it tracks; SaveModel loads the best weights when the fit ends
    assert set(state['callbacks']) == {'checkpoint', 'recorder', 'save_model', 'tracker'}
    assert set(state['observers']) == {'checkpoint', 'recorder'}
    with pytest.raises(ValueError, match=r"\['save_model', 'tracker'\], which this fit lacks"):
        digits_learner().fit(3, resume=tmp_path / 'watched' / 'latest.pt')
    resumed = digits_learner()
    resumed.fit(3, cbs=[TrackerCallback('valid_loss', 'min'), SaveModel('valid_loss', 'min', tmp_path / 'best.pt',
                                                                        restore_best=False)],
                resume=tmp_path / 'watched' / 'latest.pt')
    # without Checkpoint, and SaveModel leaving the last weights: the same fit
    assert weights_equal(resumed, straight)

    stopping = digits_learner()
    stopping.fit(3, cbs=[Checkpoint(tmp_path / 'stopping'), EarlyStopping('valid_loss', 'min', patience=5),
                         StopAfterEpoch(0)])
    refused = digits_learner()
    before = {k: v.clone() for k, v in refused.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"holds the state of callbacks \['early_stopping'\], which this fit lacks"):
        refused.fit(3, resume=tmp_path / 'stopping' / 'latest.pt')
    assert all(torch.equal(v, refused.model.state_dict()[k]) for k, v in before.items()) and refused.opt is None


def test_a_resumed_checkpoint_callback_removes_the_files_its_interrupted_fit_wrote(tmp_path):
    "With keep=2, the resumed fit removes epoch 1's and 2's files, written before the Ctrl-C, as epochs 3 and 4 come."
    stopped = digits_learner()
    with pytest.raises(KeyboardInterrupt): stopped.fit(4, cbs=[Checkpoint(tmp_path, keep=2), CtrlCAt(2, 3)])
    assert sorted(p.name for p in tmp_path.glob('epoch-*.pt')) == ['epoch-001.pt', 'epoch-002.pt']
    resumed = digits_learner()
    resumed.fit(4, cbs=[Checkpoint(tmp_path, keep=2)], resume=tmp_path / 'interrupted.pt')
    assert sorted(p.name for p in tmp_path.glob('epoch-*.pt')) == ['epoch-003.pt', 'epoch-004.pt']
    # in another folder the files are not its own: it leaves them where they are
    (tmp_path / 'other').mkdir()
    other = digits_learner()
    other.fit(4, cbs=[Checkpoint(tmp_path / 'other', keep=1)], resume=tmp_path / 'epoch-003.pt')
    assert sorted(p.name for p in tmp_path.glob('epoch-*.pt')) == ['epoch-003.pt', 'epoch-004.pt']
    assert sorted(p.name for p in (tmp_path / 'other').glob('epoch-*.pt')) == ['epoch-004.pt']


class FailAfterForward(Callback):
    "An error in training step `at` (counted from 0), after its forward has updated BatchNorm's statistics."
    def __init__(self, at): self.at = at
    def after_loss(self):
        if self.training and self.train_iter == self.at: raise RuntimeError('out of memory (played)')


def bn_cnn():
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10))


def test_an_error_inside_a_batch_leaves_the_learner_and_its_file_at_the_batchs_start(tmp_path):
    "Weights and BatchNorm statistics as a fit stopped just before that batch left them, in the learner and the file."
    before = digits_learner(model_fn=bn_cnn)
    with pytest.raises(KeyboardInterrupt): before.fit(2, cbs=[CtrlCAt(0, 5)])  # held until step 4 is whole
    failed = digits_learner(model_fn=bn_cnn)
    with pytest.raises(RuntimeError, match='played'): failed.fit(2, cbs=[Checkpoint(tmp_path), FailAfterForward(5)])
    assert weights_equal(failed, before)
    saved = read_checkpoint(tmp_path / 'interrupted.pt')['model']
    assert all(torch.equal(saved[k], v) for k, v in before.model.state_dict().items())


def test_the_same_callback_in_another_folder_or_a_later_fit_leaves_the_earlier_files(tmp_path):
    "Files are removed only by the fit that wrote them (or one resumed from it, in the same folder)."
    cb = Checkpoint(tmp_path / 'one', keep=2)
    learn = digits_learner()
    with pytest.raises(KeyboardInterrupt): learn.fit(4, cbs=[cb, CtrlCAt(2, 3)])
    cb.folder = tmp_path / 'two'  # resumed into another folder, with the same callback: the first folder's files stay
    learn.fit(4, cbs=[cb], resume=tmp_path / 'one' / 'interrupted.pt')
    assert sorted(p.name for p in (tmp_path / 'one').glob('epoch-*.pt')) == ['epoch-001.pt', 'epoch-002.pt']
    assert sorted(p.name for p in (tmp_path / 'two').glob('epoch-*.pt')) == ['epoch-003.pt', 'epoch-004.pt']
    cb.folder = tmp_path / 'three'  # a new fit: its own files only
    learn.fit(3, cbs=[cb])
    assert sorted(p.name for p in (tmp_path / 'two').glob('epoch-*.pt')) == ['epoch-003.pt', 'epoch-004.pt']
    assert sorted(p.name for p in (tmp_path / 'three').glob('epoch-*.pt')) == ['epoch-002.pt', 'epoch-003.pt']


def lazy_bn_cnn():
    return nn.Sequential(nn.LazyConv2d(8, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.LazyLinear(10))


def test_a_model_with_lazy_batchnorm_fits_with_a_checkpoint_and_an_error_leaves_its_start(tmp_path):
    before = digits_learner(model_fn=lazy_bn_cnn)
    with pytest.raises(KeyboardInterrupt): before.fit(1, cbs=[CtrlCAt(0, 5)])
    failed = digits_learner(model_fn=lazy_bn_cnn)
    with pytest.raises(RuntimeError, match='played'): failed.fit(1, cbs=[Checkpoint(tmp_path), FailAfterForward(5)])
    assert weights_equal(failed, before)


class FailInValidation(Callback):
    def after_pred(self):
        if not self.training: raise RuntimeError('failed validation (played)')


def test_an_error_in_a_later_validation_leaves_the_model_and_the_interrupted_file_alone(tmp_path):
    learn = digits_learner(model_fn=bn_cnn)
    cb = Checkpoint(tmp_path)
    learn.add_cbs([cb])
    with pytest.raises(RuntimeError, match='played'): learn.fit(2, cbs=[FailAfterForward(5)])
    written = (tmp_path / 'interrupted.pt').read_bytes()
    with torch.no_grad(): learn.model[1].running_mean.fill_(3.)  # the user's change after the failed fit
    learn.add_cbs([FailInValidation()])
    with pytest.raises(RuntimeError, match='played'): learn.validate()
    assert torch.equal(learn.model[1].running_mean, torch.full((8,), 3.))
    assert (tmp_path / 'interrupted.pt').read_bytes() == written


class ErrorInTrainingBatch(Callback):
    "An error as training batch `at` (counted over the fit) begins."
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.training and self.train_iter == self.at: raise RuntimeError('an error in a batch')


@pytest.mark.parametrize('at', [23, 24])  # 23 batches an epoch: the first batch of the second epoch, and the second
def test_an_error_in_an_epochs_first_batch_resumes_exactly(tmp_path, at):
    "The epoch's loader drew its order as the epoch began: a resume draws the same one again (its generator's state "
    "from the epoch's start), whether the error came in the epoch's first batch or a later one."
    from teachloop.testing import digits_learner
    straight = digits_learner()
    straight.fit(3)
    learn = digits_learner(Checkpoint(tmp_path))
    with pytest.raises(RuntimeError, match='an error in a batch'): learn.fit(3, cbs=[ErrorInTrainingBatch(at)])
    resumed = digits_learner(Checkpoint(tmp_path))
    resumed.fit(3, resume=tmp_path / 'interrupted.pt')
    assert all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()))
    assert [r[:-1] for r in resumed.recorder.values] == [r[:-1] for r in straight.recorder.values]


class ErrorInValidation(Callback):
    def before_batch(self):
        if not self.training and self.epoch == 1 and self.iter == 1: raise RuntimeError('an error in a validation')


def test_an_error_in_a_validation_says_which_file_resumes(tmp_path, capsys):
    "`interrupted.pt` from a validation holds good weights but no whole epoch: the message offers `latest.pt` instead "
    "of a resume that would be refused."
    from teachloop.testing import digits_learner
    learn = digits_learner(Checkpoint(tmp_path))
    with pytest.raises(RuntimeError, match='an error in a validation'): learn.fit(3, cbs=[ErrorInValidation()])
    said = capsys.readouterr().out
    assert 'continues it' not in said and f"{tmp_path / 'latest.pt'} the end of its last epoch" in said
    assert not read_checkpoint(tmp_path / 'interrupted.pt')['progress']['resumable']
    digits_learner(Checkpoint(tmp_path)).fit(3, resume=tmp_path / 'latest.pt')  # goes on from epoch 1's start


def test_a_fit_interrupted_twice_in_one_epoch_with_a_loader_drawing_from_the_global_generator_resumes_exactly(tmp_path):
    "The resumed epoch starts from its start's global random states before a ResumePoints notes them again: the "
    "second checkpoint of the same epoch keeps the epoch's real start, not the first checkpoint's batch boundary."
    from torch.utils.data import DataLoader, TensorDataset
    from teachloop.data import DataLoaders, load_digits_tensors, split_by_seed
    from teachloop.testing import digits_learner
    x, y = load_digits_tensors()
    train, valid = split_by_seed(len(x))
    def learner(*cbs):
        learn = digits_learner(*cbs)
        learn.dls = DataLoaders(DataLoader(TensorDataset(x[train], y[train]), batch_size=64, shuffle=True),
                                DataLoader(TensorDataset(x[valid], y[valid]), batch_size=128))
        return learn
    torch.manual_seed(1)
    straight = learner()
    straight.fit(2)
    torch.manual_seed(1)
    with pytest.raises(RuntimeError): learner(Checkpoint(tmp_path)).fit(2, cbs=[ErrorInTrainingBatch(28)])
    with pytest.raises(RuntimeError):
        learner(Checkpoint(tmp_path)).fit(2, cbs=[ErrorInTrainingBatch(35)], resume=tmp_path / 'interrupted.pt')
    resumed = learner(Checkpoint(tmp_path))
    resumed.fit(2, resume=tmp_path / 'interrupted.pt')
    assert all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()))
