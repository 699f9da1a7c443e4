"""The package as a user installs it: a wheel built from the checkout, installed into a fresh virtual environment,
imports every module and runs the README's first example, with none of the development tools importable.

The fresh environment reaches the runtime dependencies (torch and the rest) of this one through a path file rather
than downloading them again: what it lacks is the checkout, the editable install and, blocked at import, every
package that only `[dev]` or `[vision]` brings.
"""
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# import names of the packages in `[dev]`, `[vision]` and `[tensorboard]` that teachloop's modules might reach for
# (sphinx is left out: scipy, which scikit-learn imports, looks for it and does without)
NOT_INSTALLED = ['nbdev', 'nbconvert', 'ipykernel', 'jupyterlab', 'playwright', 'hypothesis', 'myst_nb', 'jupyter_cache',
                 'schedulefree', 'pytorch_optimizer', 'timm', 'xdist', 'pytest', 'torchvision',
                 'tensorboard']

# `None` in sys.modules makes an import of the name fail as a missing package does (and find_spec answer None)
BLOCKER = 'import sys\nsys.modules.update(dict.fromkeys({names!r}))\n'


def readme_first_example():
    text = (ROOT / 'README.md').read_text()
    return re.search(r'```python\n(.*?)```', text, re.DOTALL).group(1)


def test_extras_name_the_optional_packages():
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    assert not any(d.startswith('torchvision') for d in project['dependencies'])
    assert project['optional-dependencies']['vision'] == ['torchvision>=0.16']


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    "A fresh venv with the wheel installed; returns (python, a work folder outside the checkout)."
    tmp = tmp_path_factory.mktemp('wheel')
    # a PYTHONPATH holding the checkout would make pip find teachloop installed already in the fresh environment
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    # built with the build requirements as installed (checked against pyproject.toml): no download, no network
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '--check-build-dependencies',
                    '-q', '-w', str(tmp), str(ROOT)], check=True, cwd=tmp, env=env)
    wheel, = tmp.glob('teachloop-*.whl')
    env_dir = tmp / 'env'
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / 'bin' / 'python'
    site = Path(subprocess.run([str(python), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / 'runtime_dependencies.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    subprocess.run([sys.executable, '-m', 'pip', '--python', str(python), 'install', '--no-deps', '-q', str(wheel)],
                   check=True, cwd=tmp, env=env)
    work = tmp / 'work'
    work.mkdir()
    return python, work


def run(python, work, code):
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH',)}
    script = BLOCKER.format(names=NOT_INSTALLED) + code
    return subprocess.run([str(python), '-c', script], cwd=work, env={**env, 'MPLBACKEND': 'Agg'},
                          capture_output=True, text=True, timeout=600)


def test_the_installed_wheel_imports_every_module_from_site_packages(installed):
    python, work = installed
    modules = sorted(str(p.relative_to(ROOT).with_suffix('')).replace(os.sep, '.').removesuffix('.__init__')
                     for p in (ROOT / 'teachloop').rglob('*.py'))
    result = run(python, work, f'''
import importlib, pathlib, teachloop
assert 'site-packages' in teachloop.__file__, teachloop.__file__
for name in {modules!r}: importlib.import_module(name)
print(len({modules!r}), (pathlib.Path(teachloop.__file__).parent / 'py.typed').exists())
''')
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(len(modules)), 'True'] and 'teachloop.designs' in modules


def test_the_readmes_first_example_runs_from_the_installed_wheel(installed):
    python, work = installed
    result = run(python, work, readme_first_example() + "\nprint(len(learn.recorder.values))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == '5' and (work / 'loss.png').stat().st_size > 0


def test_mnist_without_torchvision_names_the_extra(installed):
    python, work = installed
    result = run(python, work, "from teachloop.data import mnist_dls\nmnist_dls()\n")
    assert result.returncode != 0 and "pip install 'teachloop[vision]'" in result.stderr


def test_tensorboard_logger_without_tensorboard_names_the_extra(installed):
    python, work = installed
    result = run(python, work, "from teachloop.callback.loggers import TensorBoardLogger\nTensorBoardLogger()\n")
    assert result.returncode != 0 and "pip install 'teachloop[tensorboard]'" in result.stderr


DAY_ONE = '''
import subprocess, sys, torch
from torch.nn import functional as F
from teachloop.all import (AccumMetric, CSVLogger, EarlyStopping, LRSchedulerCallback, Learner, accuracy, digits_cnn,
                           digits_dls, load_learner)
def rmse(pred, targ): return ((pred.float() - targ.float()) ** 2).mean().sqrt().item()
learn = Learner(digits_dls(), digits_cnn(), F.cross_entropy, opt_func=torch.optim.AdamW, lr=3e-3,
                metrics=[accuracy, AccumMetric(rmse, dim_argmax=-1, name='rmse')])
learn.freeze_to(-1); learn.unfreeze()
learn.fit(2, cbs=[CSVLogger('history.csv'), EarlyStopping('valid_loss', patience=3),
                  LRSchedulerCallback(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)])
probs, targets, decoded = learn.get_preds(with_decoded=True)
assert torch.allclose(probs.sum(1), torch.ones(len(probs))) and torch.equal(decoded, probs.argmax(1))
assert len(CSVLogger('history.csv').read_log()) == 2
learn.export('digits.pt2')
check = ("from teachloop.inference import load_learner; import torch; p, _ = load_learner('digits.pt2').get_preds("
         "torch.utils.data.DataLoader(torch.load('x.pt'), batch_size=64)); torch.save(p, 'p.pt')")
x = torch.cat([b[0] for b in learn.dls.valid]); torch.save(x, 'x.pt')
subprocess.run([sys.executable, '-c', check], check=True)
assert torch.equal(torch.load('p.pt'), probs)
print('day one')
'''


def test_the_day_one_features_work_from_the_installed_wheel(installed):
    "A torch optimizer class, freezing, a whole-set metric, a CSV log, early stopping, a torch scheduler, predictions, "
    "and an export loaded in another fresh process: all from the installed package, without the checkout."
    python, work = installed
    result = run(python, work, DAY_ONE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ['day', 'one'] and (work / 'digits.pt2').stat().st_size > 0
