"""Everything teachloop does on a GPU, run once on a CUDA machine, with one report at the end.

1. The `cuda`-marked tests (they skip on machines without a GPU, so this is where they run).
2. Fits under `torch.cuda.set_sync_debug_mode('error')` inside every training and validation batch: any call that
   makes the host wait for the GPU (`.item()`, `float(t)`, `.cpu()`, `if tensor:`) raises there. Between batches
   (epoch ends, display ticks) reading values is allowed, since that is where they are shown.
   - the default Learner (Adam, Recorder, progress bar, accuracy);
   - `MixedPrecision` in float16 (loss scaling) and bfloat16;
   - a background fit with the dashboard (its ticks read values, so ticks run with the check off);
   - `NaNCapture(check_every=4)` (sync-free checking) on a BatchNorm model, with a NaN injected at step 8 (a checked step): the
     capture names the step, the file is written and the weights stay finite.
3. torch.distributed on the GPUs there are: DDP and FSDP2 (`learn.distributed(strategy=...)`) with nccl, one process
   per GPU (a machine of one GPU: a world of one), and two processes sharing GPU 0 through gloo (nccl refuses two
   ranks on one GPU), against one process, on an MLP large enough for its weights and Adam's state to show: the
   losses, the peak GPU memory per rank, samples per second, and the host syncs per training batch.
4. The GPU benchmarks: loop overhead against a hand-written loop, and optimizer steps against torch.optim.

Without a CUDA GPU it says so and exits 0; `--device cpu` runs the fits of (2) on the CPU (no sync check there), so
the script itself is tested on every machine. The report is printed and written to `artifacts/gpu-check.txt`.

    make gpu-check        (or: python bench/gpu_check.py [--quick] [--device cpu])
"""
import argparse
import contextlib
import io
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import teachloop.all  # noqa: E402,F401  (every module: the default callbacks, the fast optimizer steps)
from teachloop.callback.core import MixedPrecision, accuracy  # noqa: E402
from teachloop.data import digits_cnn, digits_dls  # noqa: E402
from teachloop.learner import Callback, Learner  # noqa: E402


DEVICE = torch.device('cuda')


def set_sync_check(mode):
    "torch's sync debug mode ('error' or 'default'), on CUDA only."
    if DEVICE.type == 'cuda': torch.cuda.set_sync_debug_mode(mode)


class SyncGuard(Callback):
    "Make every call that waits for the GPU raise inside batches; allow it between them."
    order = -1000  # first in every event, so the other callbacks' batch handlers run guarded
    def before_batch(self): set_sync_check('error')
    def after_train(self): set_sync_check('default')
    def after_validate(self): set_sync_check('default')
    def cleanup_fit(self): set_sync_check('default')


class Quiet(Callback):
    "Progress bar and rows off, so the report stays readable (their code still runs)."
    order = -999
    def before_fit(self):
        if hasattr(self.learn, 'progress'): self.learn.progress.show_bar = self.learn.progress.print_rows = False


def bn_model():
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 64, 10))


def digits_learner(model=None, cbs=(), **kwargs):
    learn = Learner(digits_dls(bs=64, seed=0), model or digits_cnn(), F.cross_entropy, lr=3e-3,
                    metrics=[accuracy], cbs=list(cbs), **kwargs)
    learn.device.device = DEVICE
    return learn


def last_row(learn):
    names = learn.recorder.metric_names
    return ', '.join(f"{n} {v:.4g}" if isinstance(v, float) else f"{n} {v}" for n, v in zip(names, learn.recorder.values[-1]))


def guarded(): return 'no host sync inside batches' if DEVICE.type == 'cuda' else 'on the CPU (no sync check)'


def check_default_fit():
    learn = digits_learner(cbs=[SyncGuard(), Quiet()])
    learn.fit(2)
    return f"2 epochs, {guarded()}; {last_row(learn)}"


def check_mixed_precision(dtype):
    def run():
        learn = digits_learner(cbs=[SyncGuard(), Quiet(), MixedPrecision(dtype)])
        learn.fit(2)
        return f"2 epochs, {guarded()}; {last_row(learn)}"
    return run


def unguarded(method):
    "Run `method` with the sync check off, then put the check back as it was (a tick or a capture may wait)."
    def run(*args, **kwargs):
        guarded = DEVICE.type == 'cuda' and torch.cuda.get_sync_debug_mode() != 0
        set_sync_check('default')
        try: return method(*args, **kwargs)
        finally:
            if guarded: set_sync_check('error')
    return run


def check_dashboard_background():
    from teachloop.dashboard.live import TrainingDashboard, fit_background
    class TickUnguarded(TrainingDashboard):
        tick = unguarded(TrainingDashboard.tick)
    learn = digits_learner(cbs=[Quiet()])
    dashboard = TickUnguarded(refresh=0.25)
    # the sync debug mode is per process: the background thread's batches run guarded by SyncGuard
    handle = fit_background(learn, 2, cbs=[SyncGuard(), dashboard])
    handle.wait(timeout=600)
    return f"2 epochs in a background thread, {len(learn.recorder.values)} epoch rows; {last_row(learn)}"


class NaNGradientAt(Callback):
    "Make one gradient NaN at training step `at`, written by a kernel (`grad[0] = nan` copies from the host: a sync)."
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.train_iter == self.at: next(self.learn.model.parameters()).grad.view(-1)[:1].fill_(math.nan)


def check_nan_capture_sync_free():
    from teachloop.callback.nan_capture import NaNCapture, load_capture
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / 'nan.pt'
        # steps whose check finds nothing never wait; the capture itself reads the gradients and writes a file
        class CaptureUnguarded(NaNCapture):
            _capture_pending = unguarded(NaNCapture._capture_pending)
        capture = CaptureUnguarded(path, check_every=4, sync_free=True)  # CUDA's default for check_every > 1
        learn = digits_learner(bn_model(), cbs=[SyncGuard(), Quiet(), capture, NaNGradientAt(8)])
        learn.fit(1)
        saved = load_capture(path)
        finite = all(bool(torch.isfinite(p).all()) for p in learn.model.parameters())
        assert saved['train_iter'] == 8, f"captured step {saved['train_iter']}, the NaN was made at step 8"
        assert finite, "the weights are not finite after the capture"
        return (f"check_every=4, sync_free, BatchNorm model: NaN at step 8 captured at step {saved['train_iter']}, "
                f"file written ({path.stat().st_size} bytes), weights finite")


def accumulated_float16_fit():
    learn = digits_learner(cbs=[SyncGuard(), Quiet(), MixedPrecision(torch.float16)])
    from teachloop.callback.core import GradientAccumulation
    learn.fit(2, cbs=[GradientAccumulation(128)])  # batches of 64: one step every second batch, sync-free checks
    return f"2 epochs of 2 batches a step, {guarded()}; {last_row(learn)}; steps skipped {learn.mixed_precision.skipped}"


CHECKS = [('default fit under sync debug', check_default_fit),
          ('MixedPrecision(float16) with GradientAccumulation under sync debug', accumulated_float16_fit),
          ('MixedPrecision(float16) under sync debug', check_mixed_precision(torch.float16)),
          ('MixedPrecision(bfloat16) under sync debug', check_mixed_precision(torch.bfloat16)),
          ('dashboard background fit under sync debug', check_dashboard_background),
          ('NaNCapture sync-free on BatchNorm', check_nan_capture_sync_free)]


def run_checks(checks):
    lines, failed = [], 0
    for name, check in checks:
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()): result = check()
            lines.append(f"PASS  {name} ({time.perf_counter() - start:.1f} s): {result}")
        except Exception as e:
            failed += 1
            tb = ''.join(traceback.format_exception(e)[-6:])
            lines.append(f"FAIL  {name}: {type(e).__name__}: {e}\n{tb}")
        finally: set_sync_check('default')
    return lines, failed


def run_command(title, args, timeout):
    start = time.perf_counter()
    try:
        # the repository first, and whatever the caller's path already held (packages carried to a bare machine)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))
        done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, 'PYTHONPATH': path})
        out, rc = (done.stdout + done.stderr).strip(), done.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"timed out after {timeout} s\n{(e.stdout or b'').decode()[-2000:]}", 124
    tail = '\n'.join('    ' + line for line in out.splitlines()[-80:])
    return f"{'PASS' if rc == 0 else 'FAIL'}  {title} (exit {rc}, {time.perf_counter() - start:.0f} s)\n{tail}", rc != 0


# ---- several processes

def wide_mlp(width=1024, depth=4):
    "An MLP of `depth` layers of `width` x `width`: 4 M weights, whose Adam state (two more copies) shows in memory."
    from torch import nn
    layers = []
    for _ in range(depth): layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def wide_dls(per_rank_bs, width=1024, n=4096):
    from torch.utils.data import DataLoader, TensorDataset
    from teachloop.data import DataLoaders
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n + 512, width, generator=generator)
    y = x[:, :10].argmax(1)  # a rule the MLP learns within the two epochs
    train = DataLoader(TensorDataset(x[:n], y[:n]), batch_size=per_rank_bs, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    return DataLoaders(train, DataLoader(TensorDataset(x[n:], y[n:]), batch_size=512))


class SamplerEpoch(Callback):
    "Give the training sampler the epoch, as `learn.distributed` does: a new order of the samples each epoch."
    def before_train(self): self.learn.dls.train.sampler.set_epoch(self.learn.epoch)


def rank_fit(strategy, global_bs=256, n_epoch=2, count_syncs=True):
    "In a rank: the wide MLP fitted with Adam inside `learn.distributed(strategy=...)`; its numbers for the report."
    import warnings
    from teachloop.callback.distributed import gathered
    from teachloop.core import process_count
    from teachloop.callback.distributed import shard_dls
    torch.manual_seed(0)
    dls = wide_dls(global_bs // process_count())
    # the reference, alone, draws its samples in the order the ranks share out (a DistributedSampler of one, told
    # each epoch as the data-parallel callback tells it)
    learn = Learner(dls if strategy else shard_dls(dls, 0, 1), wide_mlp(), F.cross_entropy, lr=1e-3,
                    cbs=[Quiet()] + ([] if strategy else [SamplerEpoch()]))
    torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter('always')
        # each call of the Python thread that makes the host wait for the GPU warns (the backward's threads print theirs)
        if count_syncs: torch.cuda.set_sync_debug_mode('warn')
        # the reference is one process with no data-parallel wrapper at all
        with (learn.distributed(strategy=strategy) if strategy else contextlib.nullcontext()):
            torch.cuda.synchronize()
            start = time.perf_counter()
            learn.fit(n_epoch)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        torch.cuda.set_sync_debug_mode('default')
    n_syncs = sum('synchronizing' in str(w.message).lower() for w in syncs)
    weights = [gathered(p.detach()).cpu() for p in learn.model.parameters()]
    return {'peak_gib': torch.cuda.max_memory_allocated() / 2**30, 'seconds': seconds,
            'samples_per_s': n_epoch * len(learn.dls.train.dataset) / seconds, 'syncs_per_batch': n_syncs / learn.train_iter,
            'valid_loss': learn.recorder.values[-1][2], 'weights': weights}


def distributed_report():
    "DDP and FSDP2 on this machine's GPUs (nccl) and two ranks on GPU 0 (gloo), against one process: a table."
    from teachloop.callback.distributed import run_ranks
    n_gpus = torch.cuda.device_count()
    runs = [('one process', 1, 'nccl', None), ('one process again (run-to-run spread)', 1, 'nccl', None)]
    runs += [(f'DDP, nccl, {n_gpus} rank(s)', n_gpus, 'nccl', 'ddp'), (f'FSDP2, nccl, {n_gpus} rank(s)', n_gpus, 'nccl', 'fsdp'),
             ('DDP, gloo, 2 ranks on GPU 0', 2, 'gloo', 'ddp'), ('FSDP2, gloo, 2 ranks on GPU 0', 2, 'gloo', 'fsdp')]
    lines, failed, reference = [], 0, None
    for title, world, backend, strategy in runs:
        start = time.perf_counter()
        try:
            ranks = run_ranks(rank_fit, strategy, world_size=world, backend=backend, timeout=300, start_method='spawn')
        except Exception as e:
            failed += 1
            lines.append(f"FAIL  {title}: {type(e).__name__}: {str(e)[-1500:]}")
            try:  # the same run without the sync debug mode: does the failure come from it?
                ranks = run_ranks(rank_fit, strategy, 256, 2, False, world_size=world, backend=backend, timeout=300,
                                  start_method='spawn')
                title += ', again without the sync debug mode'
            except Exception as e:
                lines.append(f"FAIL  {title}, again without the sync debug mode: {type(e).__name__}: {str(e)[-300:]}")
                continue
        reference = reference or ranks[0]
        gap = max((a.double() - b.double()).abs().max().item() for a, b in zip(ranks[0]['weights'], reference['weights']))
        memory = ', '.join(f"{r['peak_gib']:.3f}" for r in ranks)
        lines.append(f"PASS  {title} ({time.perf_counter() - start:.0f} s): valid loss {ranks[0]['valid_loss']:.4f}, "
                     f"peak GPU memory per rank {memory} GiB, {ranks[0]['samples_per_s']:.0f} samples/s, "
                     f"host syncs per training batch (Python thread) {ranks[0]['syncs_per_batch']:.2f}, "
                     # float32: Adam turns the collectives' other order of sums into gaps of 1e-2 after 64 steps; the
                     # same runs in float64 agree to 1e-16 (and the optimizer contracts check every optimizer so)
                     f"weights vs one process max |diff| {gap:.2e}")
    return lines, failed


def sharded_resume(folder):
    "In a rank: the wide MLP under FSDP2 for two epochs, each rank writing its shards; a new learner resumed from epoch 1's."
    from teachloop.callback.checkpoint import Checkpoint
    from teachloop.callback.distributed import gathered
    from teachloop.core import process_count
    def fitted(**kwargs):
        torch.manual_seed(0)
        learn = Learner(wide_dls(256 // process_count()), wide_mlp(), F.cross_entropy, lr=1e-3,
                        cbs=[Quiet(), Checkpoint(Path(folder) / ('resumed' if kwargs else 'straight'), sharded=True)])
        with learn.distributed(strategy='fsdp'): learn.fit(2, **kwargs)
        return [gathered(p.detach()).cpu() for p in learn.model.parameters()]
    straight = fitted()
    return straight, fitted(resume=Path(folder) / 'straight' / 'epoch-001')


def sharded_checkpoint_report():
    "FSDP2 with nccl: a fit resumed from a sharded checkpoint (torch.distributed.checkpoint) against the fit never stopped."
    from teachloop.callback.distributed import run_ranks
    n_gpus, start = torch.cuda.device_count(), time.perf_counter()
    title = f'FSDP2, nccl, {n_gpus} rank(s): resumed from a sharded checkpoint (each rank writes its shards)'
    try:
        with tempfile.TemporaryDirectory() as folder:
            ranks = run_ranks(sharded_resume, folder, world_size=n_gpus, backend='nccl', timeout=300, start_method='spawn')
    except Exception as e: return [f"FAIL  {title}: {type(e).__name__}: {str(e)[-1500:]}"], 1
    straight, resumed = ranks[0]
    gap = max((a.double() - b.double()).abs().max().item() for a, b in zip(straight, resumed))
    verdict = 'PASS' if gap == 0 else 'FAIL'
    return [f"{verdict}  {title} ({time.perf_counter() - start:.0f} s): weights vs the fit never stopped max |diff| {gap:.2e}"], int(gap != 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='fewer benchmark rounds')
    parser.add_argument('--device', default='cuda', choices=['cuda', 'cpu'],
                        help='cpu: run the fits only, on the CPU, to test this script')
    parser.add_argument('--out', default=str(ROOT / 'artifacts' / 'gpu-check.txt'))
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == 'cpu':
        lines, failed = run_checks(CHECKS)
        print('\n'.join(lines))
        return 1 if failed else 0
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU on this machine (torch {torch.__version__}); nothing to check")
        return 0
    props = torch.cuda.get_device_properties(0)
    report = [f"teachloop gpu-check: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
              f"{props.major}.{props.minor}, {torch.cuda.device_count()} GPU(s), torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}"]
    # the files with cuda-marked tests only: the others may import what a GPU machine lacks (Jupyter, browsers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    def add(lines, n_failed):
        "Each part goes into the report file as it ends, so a run cut short still leaves what it measured."
        nonlocal failed
        report.extend(lines)
        failed += n_failed
        out.write_text('\n'.join(report) + '\n')
        print('\n'.join(lines), flush=True)
    failed = 0
    add([], 0)
    files = sorted(str(p) for p in (ROOT / 'tests').glob('test_*.py') if 'mark.cuda' in p.read_text())
    line, bad = run_command('cuda-marked tests', ['-m', 'pytest', '-m', 'cuda', '-q', '-p', 'no:cacheprovider', *files], 900)
    add([line], bad)
    add(*run_checks(CHECKS))
    add(*distributed_report())
    add(*sharded_checkpoint_report())
    runs = ['--runs', '3'] if args.quick else []
    for title, bench_args in [('loop overhead (Learner / hand-written loop)', ['bench/loop_overhead.py', *runs]),
                              ('optimizer step (teachloop / torch.optim)',
                               ['bench/optimizer_step.py', *(['--rounds', '3'] if args.quick else [])])]:
        line, bad = run_command(title, bench_args, 900)
        add([line], bad)
    add([f"{failed} failed"], 0)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
