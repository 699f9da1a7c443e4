"""The callback handlers a fit binds, and those that run on every training batch, with a usual set of callbacks:
mixed precision, gradient accumulation, clipping, NaN capture, checkpoints, early stopping, a CSV log and a schedule.
A handler that is bound but does nothing still costs a call on every batch; the training step's settings run inside
the step instead (notebook 04), so fewer handlers run per batch.

    .venv/bin/python bench/callback_handlers.py
"""
import tempfile
from functools import partial
import torch
from torch.nn import functional as F
import teachloop.all  # noqa: F401  (every module)
from teachloop.callback.core import MixedPrecision, GradientAccumulation, accuracy
from teachloop.callback.faults import GradientClipping
from teachloop.callback.nan_capture import NaNCapture
from teachloop.callback.checkpoint import Checkpoint
from teachloop.callback.tracker import EarlyStopping
from teachloop.callback.loggers import CSVLogger
from teachloop.callback.schedule import ParamScheduler, annealing_cos
from teachloop.data import digits_cnn, digits_dls
from teachloop.learner import Learner
folder = tempfile.mkdtemp()
cbs = [MixedPrecision(), GradientAccumulation(128), GradientClipping(1.), NaNCapture(folder + '/nan.pt'),
       Checkpoint(folder + '/ck'), EarlyStopping('valid_loss', patience=3), CSVLogger(folder + '/log.csv'),
       ParamScheduler({'lr': partial(annealing_cos, 1e-2, 1e-4)})]
learn = Learner(digits_dls(bs=64), digits_cnn(), F.cross_entropy, metrics=[accuracy], cbs=cbs)
learn._refresh_events()
valid, train = learn._event_tables
batch = ('before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch')
bound = sum(len(v) for v in train.values()) + sum(len(valid[e]) for e in valid if e in batch)
bound_unique = len({(id(h.__self__), h.__name__) for t in (train, valid) for v in t.values() for h in v})
per_train_batch = sum(len(train[e]) for e in batch)
print(f"handlers bound (distinct callback methods): {bound_unique}; run per training batch: {per_train_batch}")
print({e: [type(h.__self__).__name__ for h in train[e]] for e in batch})
