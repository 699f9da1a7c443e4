"The project as a whole: generated code in sync, README in sync, the package importable and installable."
import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from teachloop.optim import fast
from teachloop.optim.core import FAST_STEP_PLANNERS, Adam, add_fast_step_planner

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_nbdev_export_leaves_the_library_unchanged(tmp_path):
    for name in ('pyproject.toml', 'README.md'): shutil.copy(ROOT / name, tmp_path / name)
    for name in ('nbs', 'teachloop'):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns('__pycache__', '.ipynb_checkpoints'))
    subprocess.run([BIN / 'nbdev-export'], cwd=tmp_path, check=True, capture_output=True)
    exported = sorted(str(p.relative_to(tmp_path / 'teachloop')) for p in (tmp_path / 'teachloop').rglob('*.py'))
    committed = sorted(str(p.relative_to(ROOT / 'teachloop')) for p in (ROOT / 'teachloop').rglob('*.py'))
    assert exported == committed, "run `make export`: the notebooks export other modules than teachloop/ holds"
    _, mismatch, errors = filecmp.cmpfiles(ROOT / 'teachloop', tmp_path / 'teachloop', committed, shallow=False)
    assert mismatch == [] and errors == [], f"run `make export`: these modules differ from their notebooks: {mismatch}"


def test_readme_is_the_index_notebook():
    out = subprocess.run([BIN / 'jupyter', 'nbconvert', '--to', 'markdown', str(ROOT / 'nbs' / 'index.ipynb'),
                          '--stdout'], capture_output=True, text=True, check=True).stdout
    assert (ROOT / 'README.md').read_text() == out, "run `make readme`: README.md differs from nbs/index.ipynb"


def test_readme_names_every_notebook():
    readme = (ROOT / 'README.md').read_text()
    missing = [p.stem for p in (ROOT / 'nbs').glob('[0-9A-Z]*.ipynb') if f'`{p.stem}`' not in readme]
    assert missing == [], f"the course table in nbs/index.ipynb does not list {missing}"


def test_core_modules_import_without_jupyter_packages():
    code = ("import sys, teachloop.data, teachloop.optim.core, teachloop.learner, teachloop.callback.core, teachloop.lessons.demo;"
            "bad = [m for m in ('ipywidgets', 'IPython', 'ipykernel', 'jupyter_client', 'nbdev') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT)


def test_an_optimizer_imported_from_its_own_module_takes_the_fast_step():
    "`from teachloop.optim.core import Adam` and nothing else: the package's import of teachloop.optim.fast added its planner."
    code = ("import torch; from teachloop.optim.core import Adam, FAST_STEP_PLANNERS;"
            "model = torch.nn.Linear(3, 2); opt = Adam(model.parameters(), lr=1e-3);"
            "model(torch.randn(4, 3)).sum().backward();"
            "print(opt.fast_step_for(list(model.parameters())), [p.__module__ for p in FAST_STEP_PLANNERS])")
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "FastStep([fused_adam_step]) ['teachloop.optim.fast']"


def test_a_planner_added_again_replaces_the_one_of_its_name():
    "A notebook run again (or a student's own `plan_fast_step`) takes the place of the library's, never beside it."
    before = list(FAST_STEP_PLANNERS)
    def plan_fast_step(cbs): return None  # a planner that never has a step: the optimizers run their callbacks
    try:
        add_fast_step_planner(plan_fast_step)
        assert FAST_STEP_PLANNERS == [plan_fast_step]
        model = torch.nn.Linear(3, 2)
        opt = Adam(model.parameters(), lr=1e-3)
        model(torch.randn(4, 3)).sum().backward()
        assert opt.fast_step_for(list(model.parameters())) is None
    finally: FAST_STEP_PLANNERS[:] = before
    assert FAST_STEP_PLANNERS == [fast.plan_fast_step]


@pytest.mark.slow
def test_demo_trains_and_writes_the_picture(tmp_path, capsys):
    from teachloop.lessons.demo import train_digits
    out = tmp_path / 'training.png'
    learn = train_digits(['--epochs', '2', '--out', str(out)])
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    printed = capsys.readouterr().out
    assert 'train_loss' in printed and 'accuracy' in printed and str(out) in printed
    assert len(learn.recorder.values) == 2 and learn.recorder.values[-1][3] > 0.5


def test_gpu_check_runs_its_fits_on_the_cpu():
    "`make gpu-check` only runs on a GPU; its fits run here too, so the script cannot rot between GPU runs."
    done = subprocess.run([sys.executable, str(ROOT / 'bench' / 'gpu_check.py'), '--device', 'cpu'], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count('PASS') == 6 and 'FAIL' not in done.stdout


def test_every_notebook_opens_with_what_it_teaches():
    "A course notebook's first text cell says what the reader will be able to do at its end."
    missing = []
    for path in sorted((ROOT / 'nbs').glob('[0-9A-Z]*.ipynb')):
        first_text = next(cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == 'markdown')
        if 'will be able to' not in first_text.source: missing.append(path.stem)
    assert missing == [], f"say in the first text cell what the reader will be able to do at the end: {missing}"


def test_every_teachloop_module_that_a_notebook_or_script_imports_exists():
    "Checked without running them: the course, the browser tests' notebooks and the benchmarks name modules that exist."
    import importlib.util
    import re
    named = set()
    for path in [*ROOT.glob('nbs/*.ipynb'), *ROOT.glob('tests/browser/*.ipynb'), *ROOT.glob('bench/*.py')]:
        text = (''.join(c.source + '\n' for c in nbformat.read(path, as_version=4).cells if c.cell_type == 'code')
                if path.suffix == '.ipynb' else path.read_text())
        for module in re.findall(r'^\s*(?:from|import)\s+(teachloop(?:\.\w+)*)', text, re.MULTILINE):
            named.add((module, path.name))
    missing = sorted((path, module) for module, path in named if importlib.util.find_spec(module) is None)
    assert len(named) > 100 and missing == []
