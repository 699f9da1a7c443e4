"The standard callbacks: what the Recorder records."
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn

from teachloop.callbacks import Recorder, hypers_read, smooth_values, smoothing_window
from teachloop.interop import OptimWrapper
from teachloop.optimizer import SGD, Adam
from teachloop.testing import digits_learner, tiny_learner


def fitted(opt_func):
    learn = tiny_learner(Recorder(), opt_func=opt_func)
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



def test_plot_loss_saves_its_figure_and_smooths_by_the_fits_length(tmp_path):
    "A script sees nothing of a pyplot figure: `path` writes it. 69 batches are averaged over 2, not the 50 of beta 0.98."
    learn = digits_learner()
    learn.fit(3)
    ax = learn.recorder.plot_loss(path=tmp_path / 'loss.png')
    assert (tmp_path / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    losses = learn.recorder.losses
    window = smoothing_window(len(losses))
    assert len(losses) == 69 and window == 2
    drawn = ax.get_lines()[1].get_ydata()
    assert list(drawn) == smooth_values(losses, 1 - 1 / window) and '~2 batches' in ax.get_lines()[1].get_label()
    plt.close('all')

@pytest.mark.cuda
@pytest.mark.parametrize('make', [lambda params: torch.optim.Adam(params), lambda params: torch.optim.Adam(params, fused=True),
                                  lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                  lambda params: Adam(params, lr=1e-3), lambda params: Adam(params, lr=1e-3, fast=True)])
def test_state_moved_with_its_model_sits_where_an_optimizer_made_on_the_gpu_keeps_it(make):
    "Each state tensor on the device (and in the dtype) that the same optimizer made on the GPU uses: step counts too."
    from teachloop.callbacks import state_to_params_devices
    def stepped(model):
        opt = make(list(model.parameters()))
        model(torch.ones(3, 2, device=model.weight.device)).sum().backward()
        opt.step()
        return opt
    def placement(opt):
        return [{k: (v.device.type, v.dtype) for k, v in state.items() if torch.is_tensor(v)} for state in opt.state.values()]
    moved = nn.Linear(2, 1)
    opt = stepped(moved)
    moved.cuda()
    state_to_params_devices(opt)
    assert placement(opt) == placement(stepped(nn.Linear(2, 1).cuda()))
    moved(torch.ones(3, 2, device='cuda')).sum().backward()
    opt.step()  # the fused kernels need every tensor on the parameters' device
