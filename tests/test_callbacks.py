"The standard callbacks: what the Recorder records."
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from teachloop.callbacks import Recorder, hypers_read
from teachloop.data import DataLoaders, regression_2d
from teachloop.interop import OptimWrapper
from teachloop.learner import Learner
from teachloop.optimizer import SGD, Adam


def fitted(opt_func):
    torch.manual_seed(0)
    x, y = regression_2d(n=24)
    dls = DataLoaders([(x[:8], y[:8]), (x[8:16], y[8:16])], [(x[16:], y[16:])])
    learn = Learner(dls, nn.Linear(2, 1), F.mse_loss, opt_func=opt_func, lr=0.1, default_cbs=False, cbs=[Recorder()])
    learn.fit(1)
    return learn


@pytest.mark.parametrize('opt_func, recorded', [
    (SGD, {'lr', 'wd'}),  # `mom` is an argument of SGD, but without momentum no callback reads it
    (lambda params, lr: SGD(params, lr=lr, mom=0.9), {'lr', 'mom', 'wd'}),
    (Adam, {'lr', 'mom', 'sqr_mom', 'eps', 'wd'}),
])
def test_recorder_records_only_the_hypers_the_optimizer_reads(opt_func, recorded):
    learn = fitted(opt_func)
    assert set(learn.recorder.hps) == recorded == hypers_read(learn.opt)
    assert all(len(values) == 2 for values in learn.recorder.hps.values())
    axs = learn.recorder.plot_sched()
    assert [ax.get_title() for ax in axs.flat] == ['lr', 'mom'][:1 + ('mom' in recorded)]
    plt.close('all')


def test_recorder_records_every_hyper_of_a_torch_optimizer():
    learn = fitted(lambda params, lr: OptimWrapper(params, opt=torch.optim.SGD, lr=lr))
    assert 'mom' in learn.recorder.hps and learn.recorder.hps['lr'] == [0.1, 0.1]
