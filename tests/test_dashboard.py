"Tests of the dashboard and its parts: controls, device buffers, downsampling, steering from threads, background fits."
import math
from functools import partial
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from teachloop.dashboard import live as dash
from teachloop.dashboard import buffers as dashboard_buffers, controls as dashboard_controls, plot as dashboard_plot, widget as dashboard_widget
from teachloop.callback.core import DeviceCallback, smooth_values
from teachloop.dashboard.live import TrainingDashboard
from teachloop.dashboard.buffers import BoundedSeries, DeviceBuffer, RunningSmoother, downsample_minmax
from teachloop.dashboard.controls import FitControls, SteeringCallback, fit_background
from teachloop.diagnostics.effective_lr import effective_lr_stats
from teachloop.data import DataLoaders, digits_cnn, digits_dls, regression_2d
from teachloop.diagnostics.layer_stats import LayerStats
from teachloop.learner import Callback, CancelFitException, EventLog, Learner
from teachloop.optim.core import SGD, Adam
from teachloop.diagnostics.sharpness import Sharpness
from teachloop.testing import digits_learner

DLS = digits_dls(bs=64)  # for the number of batches; each learner gets fresh loaders (they own a shuffling generator)


def wait_until(condition, timeout=60):
    "Poll `condition` (a state check, not a timing assertion) until it holds."
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline: raise AssertionError("condition not reached")
        time.sleep(0.005)


# ---- controls -------------------------------------------------------------------------------------------------------

def test_controls_reject_bad_values_without_changing_anything():
    controls = FitControls()
    controls.set_hyper('lr', 0.1)
    for name, value in [('lr', -1.), ('mom', 1.), ('wd', 'big')]:
        with pytest.raises((ValueError, TypeError), match=name):
            controls.set_hyper(name, value)
    assert controls.requested_hypers() == ({'lr': 0.1}, 1)


def test_stop_ends_a_pause_and_finish_clears_both():
    controls = FitControls()
    controls.pause()
    assert controls.paused and not controls.wait_while_paused(timeout=0.01)
    controls.stop()
    assert controls.stop_requested and not controls.paused and controls.wait_while_paused(timeout=0)
    controls.pause()  # a stopped fit cannot be paused any more
    assert not controls.paused
    controls.finish_fit()
    assert not controls.stop_requested and not controls.paused


def test_controls_count_every_request_from_many_threads():
    controls = FitControls()
    def request(i):
        for k in range(200): controls.set_hyper('lr', (i * 200 + k) * 1e-6)
    threads = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    hypers, version = controls.requested_hypers()
    assert version == 800 and set(hypers) == {'lr'}


# ---- device buffers and bounded series ------------------------------------------------------------------------------

def test_device_buffer_returns_pushed_values_in_order_and_stays_fixed():
    buffer = DeviceBuffer(capacity=8)
    seen = []
    for i in range(100_000):
        buffer.push(torch.tensor(i * 0.5))
        if buffer.full: seen.append(buffer.drain())
    seen.append(buffer.drain())
    assert buffer.values.numel() == 8 and buffer.count == 0
    assert np.array_equal(np.concatenate(seen), np.arange(100_000) * 0.5)


def test_device_buffer_lives_on_the_values_device():
    buffer = DeviceBuffer(4)
    buffer.push(torch.tensor(1., device='meta'))
    assert buffer.values.device.type == 'meta' and buffer.count == 1
    with pytest.raises(ValueError, match='capacity'):
        DeviceBuffer(0)


def reference_minmax(x, y, n_spans):
    "For each span (by a plain loop), the indices of its smallest and largest value."
    edges = np.linspace(x[0], x[-1], n_spans + 1)
    kept = set()
    for i in range(n_spans):
        inside = [j for j in range(len(x)) if edges[i] <= x[j] < edges[i + 1] or (i == n_spans - 1 and x[j] == x[-1])]
        if inside:
            kept.add(min(inside, key=lambda j: (y[j], j)))
            kept.add(max(inside, key=lambda j: (y[j], -j)))
    return kept


@pytest.mark.parametrize('n, n_spans', [(50, 7), (1000, 10), (333, 40)])
def test_downsampling_keeps_min_and_max_of_every_span(n, n_spans):
    rng = np.random.default_rng(n)
    x, y = np.sort(rng.uniform(0, 100, n)), rng.normal(size=n)
    xs, ys = downsample_minmax(x, y, n_spans)
    kept = {int(np.flatnonzero(x == v)[0]) for v in xs}
    ref = reference_minmax(x, y, n_spans)
    assert {float(y[j]) for j in ref} <= set(ys.tolist())  # every span's extremes are there
    assert len(xs) <= 2 * n_spans and np.all(np.diff(xs) > 0) and np.array_equal(y[sorted(kept)], ys)


def test_bounded_series_over_1e5_points_keeps_spikes_and_memory():
    rng = np.random.default_rng(1)
    y = rng.normal(1, 0.1, 100_000)
    spikes = {12_345: 9., 54_321: -7., 99_998: 4.}
    for i, v in spikes.items(): y[i] = v
    series, longest = BoundedSeries(max_points=1000), 0
    for start in range(0, len(y), 250):
        series.extend(np.arange(start, start + 250), y[start:start + 250])
        longest = max(longest, len(series))
    assert longest <= 1000 + 250 and len(series) <= 1000
    for i, v in spikes.items(): assert i in series.x.astype(int) and v in series.y
    assert np.array_equal(y[series.x.astype(int)], series.y)  # only real points, at their own positions


def test_running_smoother_continues_across_ticks():
    values = np.random.default_rng(2).normal(size=101)
    smoother = RunningSmoother(beta=0.9)
    parts = [smoother(values[a:b]) for a, b in [(0, 1), (1, 40), (40, 40), (40, 101)]]
    assert np.allclose(np.concatenate(parts), smooth_values(values, beta=0.9))


# ---- steering a fit from another thread -----------------------------------------------------------------------------

def stop_at(train_iter):
    class StopAt(Callback):
        def before_batch(self):
            if self.training and self.train_iter == train_iter: raise CancelFitException()
    return StopAt()


def test_a_blocking_fit_stopped_from_another_thread_ends_cleanly():
    steering, log = SteeringCallback(), EventLog()
    learn = digits_learner(steering, log)
    stopper = threading.Thread(target=lambda: (wait_until(lambda: learn.train_iter >= 7), steering.controls.stop()))
    stopper.start()
    learn.fit(50)
    stopper.join()
    stopped_at = learn.train_iter
    assert 7 <= stopped_at < 50 * len(DLS.train)
    assert log.events[-3:] == ['after_cancel_fit', 'after_fit', 'cleanup_fit']
    assert len(learn.recorder.losses) == stopped_at and not steering.controls.stop_requested
    # the weights are those of a fit cancelled at the same batch from inside
    same = digits_learner(stop_at(stopped_at))
    same.fit(50)
    for a, b in zip(learn.model.parameters(), same.model.parameters()): assert torch.equal(a, b)


def test_requested_hyper_is_applied_from_the_next_batch_and_held_against_a_schedule():
    steering = SteeringCallback()
    class Schedule(Callback):  # sets the lr before every batch, as a scheduler does (lower order)
        order = 20
        def before_batch(self):
            if self.training: self.opt.set_hyper('lr', 1e-3 * (1 + self.train_iter))
    class Request(Callback):
        def after_batch(self):
            if self.training and self.train_iter == 5: steering.controls.set_hyper('lr', 7e-4)
    learn = digits_learner(steering, Schedule(), Request())
    learn.fit(1)
    lrs = learn.recorder.lrs
    assert lrs[:5] == [1e-3 * (1 + i) for i in range(5)] and set(lrs[5:]) == {7e-4}
    assert steering.changes == [(5, 'lr', 7e-4)]


def test_a_moved_slider_wins_over_one_cycle_in_the_background():
    import teachloop.callback.schedule  # adds Learner.fit_one_cycle
    dashboard = TrainingDashboard()
    class Request(Callback):
        def after_batch(self):
            if self.training and self.train_iter == 8: dashboard.controls.set_hyper('lr', 2e-4)
    learn = digits_learner(dashboard, Request())
    fit_background(learn, 1, fit=learn.fit_one_cycle, lr_max=1e-2).wait(timeout=60)
    lrs = learn.recorder.lrs
    assert len(set(lrs[:8])) == 8 and set(lrs[8:]) == {2e-4}  # the schedule, then the held value
    assert dashboard.hyper_series[('lr', 0)].y.tolist() == lrs and dashboard.changes == [(8, 'lr', 2e-4)]


def test_pause_holds_the_fit_until_resume():
    steering = SteeringCallback()
    learn = digits_learner(steering, default_cbs=False)
    steering.controls.pause()
    handle = fit_background(learn, 1)
    time.sleep(0.3)
    assert learn.train_iter == 0 and not handle.done
    steering.controls.unpause()
    handle.wait(timeout=60)
    assert learn.train_iter == len(DLS.train) and steering.paused_seconds > 0


# ---- background fits ------------------------------------------------------------------------------------------------

class GradModeProbe(Callback):
    def before_batch(self):
        if self.training: self.grad_enabled, self.thread = torch.is_grad_enabled(), threading.current_thread()


def test_background_fit_gives_the_same_weights_as_a_blocking_one():
    probe = GradModeProbe()
    learn = digits_learner(probe)
    handle = fit_background(learn, 2)
    assert handle.wait(timeout=120) is learn and handle.done and handle.error is None
    assert probe.grad_enabled and probe.thread is not threading.main_thread()
    blocking = digits_learner()
    blocking.fit(2)
    for a, b in zip(learn.model.parameters(), blocking.model.parameters()): assert torch.equal(a, b)
    assert learn.recorder.values[-1][1:3] == blocking.recorder.values[-1][1:3]


def test_background_fit_takes_the_callers_grad_mode_and_reraises_errors(capsys):
    learn, probe = digits_learner(), GradModeProbe()
    with torch.no_grad(): handle = fit_background(learn, 1, cbs=probe)
    with pytest.raises(RuntimeError, match='grad'):
        handle.wait(timeout=60)
    assert probe.grad_enabled is False and 'handle.wait()' in capsys.readouterr().err
    learn.fit(1)  # the learner is still usable


def test_background_fit_checks_arguments_and_refuses_a_second_fit():
    learn = digits_learner()
    with pytest.raises(ValueError, match='n_epoch'):
        fit_background(learn, 0)
    handle = fit_background(learn, 30)
    try:
        with pytest.raises(RuntimeError, match='still training'):
            fit_background(learn, 1)
    finally: handle.stop().wait(timeout=60)
    assert learn.train_iter < 30 * len(DLS.train)
    assert learn not in dashboard_controls._running_fits  # nothing kept once done
    with pytest.raises(ValueError, match='steering callbacks'):
        fit_background(learn, 1, cbs=[SteeringCallback(), TrainingDashboard()])


# ---- the dashboard --------------------------------------------------------------------------------------------------

def test_dashboard_series_match_the_recorder(tmp_path):
    learn = digits_learner(metrics=[])
    dashboard = TrainingDashboard(refresh=0., save_path=tmp_path / 'final.png')
    learn.fit(2, cbs=[dashboard])
    assert np.allclose(dashboard.series['loss'].y, learn.recorder.losses, rtol=1e-6)
    assert np.allclose(dashboard.series['valid'].y, [row[2] for row in learn.recorder.values], rtol=1e-5)
    assert dashboard.series['valid'].x.tolist() == [len(DLS.train), 2 * len(DLS.train)]
    assert dashboard.hyper_series[('lr', 0)].y.tolist() == learn.recorder.lrs
    assert dashboard.ticks >= 2 * len(DLS.train) and set(dashboard.ratio_series) == set(dashboard.layer_names)
    stats = effective_lr_stats(learn.opt, learn.model)  # the final tick saw the final optimizer state
    assert dashboard.layer_names == list(stats)
    assert np.allclose(dashboard.effective_lr, torch.stack(list(stats.values())).numpy())
    # one update ratio per tick of the training phase, measured at the step after the tick
    assert all(len(series) >= len(DLS.train) for series in dashboard.ratio_series.values())
    assert (tmp_path / 'final.png').read_bytes()[:4] == b'\x89PNG'


def test_the_figure_names_layers_by_label_and_the_results_by_path():
    learn = digits_learner()
    dashboard = TrainingDashboard(refresh=0.)
    learn.fit(1, cbs=[dashboard])
    snapshot = dashboard.snapshot()  # after the fit too: the labels were found at its start
    labels = ['0.0 Conv2d 1→16', '1.0 Conv2d 16→32', '2.0 Conv2d 32→64', '5 Linear 64→10']
    assert snapshot['layers'] == labels and list(snapshot['ratios']) == labels
    assert dashboard.layer_names == list(dashboard.ratio_series) == ['0.0', '1.0', '2.0', '5']


def test_sharpness_and_layer_panels_show_what_their_callbacks_measured(tmp_path):
    learn = digits_learner()
    sharp, stats = Sharpness(every=7, power_iters=3), LayerStats(every=5)
    dashboard = TrainingDashboard(refresh=0., save_path=tmp_path / 'final.png')
    learn.fit(1, cbs=[dashboard, stats, sharp])
    snapshot = dashboard.snapshot()
    assert snapshot['panels'] == ('sharpness', 'layers') and len(sharp.steps) == len(DLS.train) // 7
    assert [a.tolist() for a in snapshot['sharpness']] == [sharp.steps, sharp.sharpness, sharp.thresholds]
    relus = [name for name, m in learn.model.named_modules() if isinstance(m, nn.ReLU)]
    assert list(snapshot['layer_shares']) == [f'{name} ReLU' for name in relus]
    first = snapshot['layer_shares'][f'{relus[0]} ReLU']
    assert first[1].tolist() == [v for _, v in stats.history('dead')[relus[0]]]
    plot = dashboard.plot  # the figure saved at the end, drawn from the same snapshot
    assert plot.panels == ('sharpness', 'layers') and plot.lines['sharpness'].get_ydata().tolist() == sharp.sharpness
    assert (tmp_path / 'final.png').read_bytes()[:4] == b'\x89PNG'


class TwiceReLU(nn.Module):
    "The digits CNN whose last ReLU runs twice, as torchvision's BasicBlock calls its `relu` before and after a sum."
    def __init__(self):
        super().__init__()
        self.body, self.relu = digits_cnn(), nn.ReLU()
    def forward(self, x): return self.body(x) + self.relu(self.relu(x.flatten(1)[:, :10]) - 0.5)


def test_the_layer_panel_names_each_call_of_a_module_called_twice():
    learn = digits_learner(model_fn=TwiceReLU)
    stats, dashboard = LayerStats(every=5, modules=['relu']), TrainingDashboard(refresh=0.)
    learn.fit(1, cbs=[dashboard, stats])
    shares = dashboard.snapshot()['layer_shares']
    assert list(shares) == ['relu#1 ReLU', 'relu#2 ReLU']
    assert shares['relu#2 ReLU'][1].tolist() == [v for _, v in stats.history('dead')['relu#2']]


def test_effective_lrs_are_kept_over_the_fit_and_bounded(tmp_path):
    learn = digits_learner()
    dashboard = TrainingDashboard(refresh=0., max_points=8, save_path=tmp_path / 'final.png')
    learn.fit(1, cbs=[dashboard])
    history = dashboard.snapshot()['effective_lr_history']
    assert list(history) == [dashboard.layer_labels[name] for name in dashboard.layer_names]
    final = effective_lr_stats(learn.opt, learn.model)
    for name, rows in zip(dashboard.layer_names, history.values()):
        assert 4 <= len(rows) <= 8 and rows[-1][0] == learn.train_iter and (np.diff(rows[:, 0]) > 0).all()
        assert np.allclose(rows[-1][1:], final[name].numpy()[[0, 1, 2]])  # 5%, median, 95% of the last tick
    assert dashboard.plot.panels == () and dashboard.plot.ax_sharpness is None


def test_no_effective_lrs_are_read_when_nobody_will_see_them(monkeypatch):
    calls = []
    monkeypatch.setattr(dash, 'effective_lr_stats', lambda *args: calls.append(1) or {})
    digits_learner().fit(1, cbs=[TrainingDashboard(refresh=0.)])
    assert len(calls) == 1  # only the final tick, for the figure IPython would show


def test_a_live_dashboard_has_saved_its_last_frame_when_the_fit_returns(tmp_path):
    "Live (in a Jupyter kernel) the display thread draws the frames; `save_path` must not wait for `wait_drawn()`."
    pytest.importorskip('ipywidgets')
    path = tmp_path / 'live.png'
    learn = digits_learner(metrics=[])
    dashboard = TrainingDashboard(refresh=0., live=True, save_path=path)
    learn.fit(1, cbs=[dashboard])
    assert path.read_bytes()[:4] == b'\x89PNG' and dashboard.frames >= 1
    path.unlink()
    fit_background(learn, 1, cbs=[dashboard]).wait(timeout=120)
    assert path.read_bytes()[:4] == b'\x89PNG'


def test_dashboard_memory_is_bounded_over_many_batches():
    x, y = regression_2d(n=64)
    batches = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 64, 2)]
    dls = DataLoaders(batches * 40, None)  # 1280 batches per epoch
    learn = Learner(dls, nn.Linear(2, 1), nn.functional.mse_loss, opt_func=SGD, lr=0.05, default_cbs=False,
                    cbs=[DeviceCallback('cpu')])
    dashboard = TrainingDashboard(refresh=1e9, max_points=200, buffer_size=64)
    longest = []
    class Watch(Callback):
        order = 90
        def after_batch(self): longest.append(max(len(s) for s in dashboard.series.values()) + dashboard._losses.count)
    losses = []
    class Keep(Callback):
        def after_batch(self): losses.append(self.loss)
    learn.fit(4, cbs=[dashboard, Watch(), Keep()])
    losses = torch.stack(losses).numpy()
    assert max(longest) <= 200 + 64 and dashboard._losses.values.numel() == 64
    assert dashboard.ticks == math.ceil(len(losses) / 64) + (len(losses) % 64 == 0)
    assert dashboard.series['loss'].y.max() == losses.max() and dashboard.series['loss'].y.min() == losses.min()


DASHBOARD_PARTS = (dash, dashboard_controls, dashboard_buffers, dashboard_plot, dashboard_widget)


def test_no_host_reads_from_the_dashboard_between_ticks(host_reads):
    reads = host_reads(*DASHBOARD_PARTS)
    reads_at_fit_end = []
    class Probe(Callback):
        order = 100
        def after_fit(self): reads_at_fit_end.append(len(reads))
    learn = digits_learner(DeviceCallback('cpu'), default_cbs=False)
    learn.fit(2, cbs=[TrainingDashboard(refresh=1e9), Probe()])
    assert reads_at_fit_end == [0] and reads  # none during the fit, the final tick reads
    reads.clear(); reads_at_fit_end.clear()
    learn.fit(1, cbs=[TrainingDashboard(refresh=0.), Probe()])
    assert reads_at_fit_end[0] > 0  # with a tick per batch the probe does see the reads


def test_live_widget_draws_frames_and_writes_only_into_the_controls():
    pytest.importorskip('ipywidgets')
    learn = digits_learner(opt_func=Adam)
    dashboard = TrainingDashboard(refresh=0., live=True)
    handle = fit_background(learn, 1, cbs=[dashboard])
    widget = dashboard.widget
    assert widget is not None
    handle.wait(timeout=120)
    dashboard.wait_drawn()
    assert dashboard.frames >= 1 and widget.image.value[:4] == b'\x89PNG'
    assert f'<span class="tl-frame">{dashboard.frames}</span>' in widget.status.value
    assert set(widget.sliders) == {'lr', 'mom', 'sqr_mom', 'wd'} and widget.stop_button.disabled
    widget.sliders['lr'].value = 1e-4
    widget.sliders['sqr_mom'].value = 0.95
    assert dashboard.controls.requested_hypers() == ({'lr': 1e-4, 'sqr_mom': 0.95}, 2)
    widget.stop_button.click()
    assert dashboard.controls.stop_requested


def test_an_error_in_the_fit_is_not_hidden_by_a_failing_final_tick(monkeypatch):
    def unreadable(*args, **kwargs): raise RuntimeError("device lost")
    monkeypatch.setattr(dash, 'effective_lr_stats', unreadable)
    class Broken(Callback):
        def after_loss(self):
            if self.train_iter == 3: raise ValueError("the fit's own error")
    learn = digits_learner()
    with pytest.warns(UserWarning, match='device lost'), pytest.raises(ValueError, match="fit's own error"):
        learn.fit(1, cbs=[TrainingDashboard(refresh=1e9), Broken()])
    assert len(learn.recorder.losses) == 3


EXIT_DURING_FIT = """
import time, torch
from torch import nn
from torch.nn import functional as F
from teachloop.dashboard.live import TrainingDashboard, fit_background
from teachloop.data import digits_cnn, digits_dls
from teachloop.learner import Learner
learn = Learner(digits_dls(), digits_cnn(), nn.functional.cross_entropy, default_cbs=False)
handle = fit_background(learn, 1000, cbs=[TrainingDashboard(live=True, refresh=0.25)])  # drawing as the script ends
while learn.train_iter < 5: time.sleep(0.01)
print('leaving during the fit', flush=True)
"""


@pytest.mark.slow
def test_a_script_ending_during_a_background_fit_exits_cleanly():
    done = subprocess.run([sys.executable, '-c', EXIT_DURING_FIT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'leaving during the fit' in done.stdout and 'terminate' not in done.stderr


def test_the_parts_can_be_imported_from_teachloop_dashboard_too():
    for part in DASHBOARD_PARTS[1:]:
        for name in part.__all__: assert getattr(dash, name) is getattr(part, name), name
    assert dash.__all__ == ['TrainingDashboard']  # each name is exported by the module that defines it


def test_dashboard_rejects_bad_settings():
    with pytest.raises(ValueError, match='refresh'): TrainingDashboard(refresh=-1)
    with pytest.raises(ValueError, match='max_points'): BoundedSeries(max_points=2)


# what torch's sync debug mode 'warn' says of each sync (its notice that the mode is a prototype says
# "synchronizing operations" too, and is no sync)
SYNC_WARNING = 'called a synchronizing CUDA operation'


@pytest.mark.cuda
def test_background_fit_uses_the_callers_cuda_device_and_no_sync_between_ticks():
    import warnings
    torch.cuda.set_device(0)
    probe = GradModeProbe()
    class DeviceProbe(Callback):
        def before_batch(self): self.device = torch.cuda.current_device()
    device_probe = DeviceProbe()
    learn = digits_learner(DeviceCallback('cuda'), default_cbs=False)
    fit_background(learn, 1, cbs=[probe, device_probe]).wait(timeout=120)
    assert device_probe.device == 0 and probe.grad_enabled
    syncs = []
    class Probe(Callback):
        order = 100
        def after_fit(self): syncs.append(len([w for w in caught if SYNC_WARNING in str(w.message)]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try:
            learn.fit(2, cbs=[TrainingDashboard(refresh=1e9), Probe()])
            learn.fit(1, cbs=[TrainingDashboard(refresh=0.), Probe()])
        finally: torch.cuda.set_sync_debug_mode('default')
    assert syncs[0] == 0 and syncs[1] > 0


def test_fit_background_returns_a_handle_and_trains_with_any_fit_method():
    from teachloop.callback.schedule import fit_one_cycle  # noqa: F401  adds Learner.fit_one_cycle
    learn = Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, lr=3e-3)
    learn.progress.show_bar = learn.progress.print_rows = False
    handle = fit_background(learn, 1)
    handle.wait()
    assert handle.done and len(learn.recorder.values) == 1
    handle = fit_background(learn, 1, fit=learn.fit_one_cycle, lr_max=1e-2)
    handle.wait()
    assert learn.recorder.hps['lr'][0] == pytest.approx(1e-2 / 25)


def test_batches_cancelled_before_their_loss_are_skipped():
    from teachloop.learner import CancelBatchException
    class SkipEveryThird(Callback):  # cancels before the forward pass, so `learn.loss` is not renewed
        order = 0
        def before_batch(self):
            if self.iter % 3 == 0: raise CancelBatchException()
    train_losses, valid_losses = [], []
    class Keep(Callback):
        def after_loss(self): (train_losses if self.training else valid_losses).append((self.loss, len(self.yb[0])))
    learn = digits_learner(DeviceCallback('cpu'), default_cbs=False)
    learn.fit(1)  # so that `learn.loss` holds the last fit's loss when the next fit's first batch is cancelled
    valid_losses.clear()
    dashboard = TrainingDashboard(refresh=1e9)
    learn.fit(2, cbs=[SkipEveryThird(), Keep(), dashboard])
    assert np.array_equal(dashboard.series['loss'].y, torch.stack([l for l, _ in train_losses]).numpy())
    assert dashboard.samples == sum(size for _, size in train_losses)
    per_epoch = len(valid_losses) // 2
    expected = [sum(float(l) * n for l, n in part) / sum(n for _, n in part)
                for part in (valid_losses[:per_epoch], valid_losses[per_epoch:])]
    assert np.allclose(dashboard.series['valid'].y, expected, rtol=1e-6)


def test_a_slider_request_belongs_to_the_fit_it_was_made_in():
    from teachloop.callback.schedule import fit_one_cycle, lr_find  # noqa: F401  (add the Learner methods)
    steering = SteeringCallback()
    class MoveSliderAt(Callback):
        "The lr slider moved by the user during training step 5 of the fit this callback is part of."
        order = 60
        def before_batch(self):
            if self.training and self.train_iter == 5: steering.controls.set_hyper('lr', 0.123)
    learn = digits_learner(steering)
    learn.fit_one_cycle(1, 1e-2, cbs=[MoveSliderAt()])
    lrs = learn.recorder.hps['lr']
    assert lrs[4] != 0.123 and set(lrs[5:]) == {0.123}  # within its fit the slider wins over the schedule
    finder_lrs = []
    class Keep(Callback):
        def after_batch(self):
            if self.training: finder_lrs.append(self.opt.hypers[0]['lr'])
    learn.add_cbs([Keep()])
    learn.lr_find(num_it=20, show_plot=False)
    assert len(set(finder_lrs)) == 20 and 0.123 not in finder_lrs  # the range test swept its own learning rates
    finder_lrs.clear()
    learn.fit_one_cycle(1, 1e-2)
    assert finder_lrs[0] == pytest.approx(1e-2 / 25) and len(set(finder_lrs)) > 10  # the schedule, not the old slider


def test_a_background_fit_owns_its_learner_from_the_moment_it_is_started():
    release = threading.Event()
    class Hold(Callback):
        def before_fit(self): release.wait(10)
    learn = digits_learner()
    handle = fit_background(learn, 1, cbs=[Hold()])
    try:
        with pytest.raises(RuntimeError, match='another thread'): learn.validate()  # refused even before its first batch
    finally: release.set()
    handle.wait(60)
    assert len(learn.validate()) == 1  # free again once it is over: the validation loss


def test_the_sliders_show_the_values_in_effect_and_steer_only_while_they_can():
    "A slider moved between fits (or during a blocking fit, whose messages arrive after it) is not the next fit's."
    pytest.importorskip('ipywidgets')
    learn = digits_learner(opt_func=Adam)
    dashboard = TrainingDashboard(refresh=1e9, live=True)
    seen = {}
    class Look(Callback):
        order = 80
        def before_batch(self):
            if self.train_iter == 2:
                seen['enabled'] = not dashboard.widget.sliders['lr'].disabled
                seen['shown'] = dashboard.widget.sliders['lr'].value
    fit_background(learn, 1, cbs=[dashboard, Look()]).wait(timeout=120)
    assert seen['enabled'] and all(s.disabled for s in dashboard.widget.sliders.values())
    dashboard.widget.sliders['lr'].value = 0.5  # after the fit: a request no fit will take
    learn.fit(1, cbs=[dashboard, Look()])
    assert not seen['enabled']  # a blocking fit: a moved slider would reach it only after it ended
    assert seen['shown'] == pytest.approx(3e-3) and set(learn.recorder.hps['lr']) == {3e-3}
    assert dashboard.changes == [] and dashboard.controls.requested_hypers()[0] == {}  # showing is not requesting


class MoveSliderAt(Callback):
    "The user moving a slider during a training batch (its request applies from the next one)."
    def __init__(self, controls, at, **hypers): self.controls, self.at, self.hypers = controls, at, hypers
    def after_batch(self):
        if self.training and self.train_iter == self.at:
            for name, value in self.hypers.items(): self.controls.set_hyper(name, value)


def test_after_a_steered_fit_the_next_one_starts_from_the_values_the_sliders_found():
    steering = SteeringCallback()
    learn = digits_learner(steering, opt_func=partial(SGD, mom=0.9), lr=3e-3)
    learn.fit(1, cbs=[MoveSliderAt(steering.controls, 5, lr=0.5, mom=0.5)])
    assert set(learn.recorder.lrs[5:]) == {0.5} and set(learn.recorder.hps['mom'][5:]) == {0.5}  # steered in its fit
    assert learn.opt.hypers[0]['lr'] == 3e-3 and learn.opt.hypers[0]['mom'] == 0.9  # as the fit found them
    learn.fit(1)
    assert set(learn.recorder.lrs) == {3e-3} and set(learn.recorder.hps['mom']) == {0.9}


def test_a_steered_fit_is_drawn_as_it_ran_and_smoothed_as_the_recorder_plots_it():
    """The last effective lrs are read with the slider's rate, before the fit's end puts back the one the slider found;
    the smoothed loss is the line `Recorder.plot_loss` draws (notebook 05), without the lag of a fixed 50-batch window."""
    import matplotlib.pyplot as plt
    learn = digits_learner(lr=3e-3)
    dashboard = TrainingDashboard(refresh=0.)
    learn.fit(2, cbs=[dashboard, MoveSliderAt(dashboard.controls, 5, lr=1e-3)])
    assert set(learn.recorder.lrs[5:]) == {1e-3} and learn.opt.hypers[0]['lr'] == 3e-3  # steered, then put back
    learn.opt.set_hyper('lr', 1e-3)  # the rate of the fit's last steps
    ran = effective_lr_stats(learn.opt, learn.model)
    for name, rows in dashboard.elr_history.items():
        assert rows[-1][0] == learn.train_iter and np.allclose(rows[-1][1:], ran[name].numpy(), rtol=1e-6), name
    ax = learn.recorder.plot_loss()
    drawn = ax.lines[1].get_ydata()
    plt.close(ax.figure)
    assert len(drawn) == len(learn.recorder.losses) == 2 * len(DLS.train)
    assert np.allclose(dashboard.series['smooth'].y, drawn, rtol=1e-6)
    assert dashboard.snapshot()['smooth_window'] == round(len(learn.recorder.losses) / 25)


def test_after_a_steered_scheduled_fit_the_optimizer_holds_what_the_schedule_left():
    import teachloop.callback.schedule  # noqa: F401  (adds Learner.fit_one_cycle)
    plain = digits_learner()
    plain.fit_one_cycle(1, 1e-2)
    dashboard = TrainingDashboard(refresh=1e9)
    steered = digits_learner(dashboard)
    fit_background(steered, 1, fit=steered.fit_one_cycle, lr_max=1e-2,
                   cbs=[MoveSliderAt(dashboard.controls, 8, lr=2e-4)]).wait(timeout=60)
    assert set(steered.recorder.lrs[8:]) == {2e-4}
    assert steered.opt.hypers == plain.opt.hypers  # the schedule's last values, as without the slider


def test_a_fit_that_fails_after_a_slider_moved_leaves_the_values_it_found():
    class Fail(Callback):
        def after_batch(self):
            if self.training and self.train_iter == 9: raise RuntimeError('played failure')
    steering = SteeringCallback()
    learn = digits_learner(steering)
    with pytest.raises(RuntimeError, match='played'): learn.fit(1, cbs=[MoveSliderAt(steering.controls, 3, lr=0.5), Fail()])
    assert learn.recorder.lrs[-1] == 0.5 and learn.opt.hypers[0]['lr'] == 3e-3  # the fit's clean-up put it back


def test_keep_steered_keeps_the_sliders_values_for_the_next_fit():
    steering = SteeringCallback(keep_steered=True)
    learn = digits_learner(steering)
    learn.fit(1, cbs=[MoveSliderAt(steering.controls, 5, lr=0.5)])
    assert learn.opt.hypers[0]['lr'] == 0.5 and steering.steered == {'lr': 0.5}
    learn.fit(1)
    assert set(learn.recorder.lrs) == {0.5}
    with pytest.raises(TypeError, match='keep_steered'): SteeringCallback(keep_steered='yes')


def test_a_resumed_fit_counts_its_remaining_batches_from_where_it_resumed(tmp_path):
    "The time left is estimated over the batches this call will run, not over the whole fit from its first epoch."
    from teachloop.callback.checkpoint import Checkpoint
    from teachloop.learner import Callback
    from teachloop.testing import digits_learner
    class CtrlCInEpoch1(Callback):
        def before_batch(self):
            if self.training and (self.epoch, self.iter) == (1, 3): raise KeyboardInterrupt
    first = digits_learner()
    with pytest.raises(KeyboardInterrupt): first.fit(3, cbs=[Checkpoint(tmp_path), CtrlCInEpoch1()])
    resumed = digits_learner()
    dashboard = TrainingDashboard(live=False)
    resumed.fit(3, cbs=[dashboard], resume=tmp_path / 'interrupted.pt')
    per_epoch = len(resumed.dls.train) + len(resumed.dls.valid)
    assert dashboard.batches_done == dashboard._total == 2 * per_epoch - 3
