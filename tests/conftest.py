import os
import signal
import sys

import pytest
import torch

# Two cores shared by the test processes: one torch thread each avoids oversubscription.
torch.set_num_threads(int(os.environ.get('OMP_NUM_THREADS', '1')))


def pytest_report_header(config):
    return f"torch {torch.__version__}, CPU kernels: {torch.backends.cpu.get_cpu_capability()}"


# Tests that share something beyond their process, each group run by one test worker at a time (`--dist loadgroup`):
# a browser test drives a Jupyter server, its kernel and Chromium (two at once would only slow each other down); a
# distributed test (test_distributed.py, or marked `ranks`) starts processes that take both cores; the installed
# wheel's tests share one wheel, built once (setuptools builds in the checkout's build/: two builds at once collide).
XDIST_GROUPS = {'browser': lambda item: marked(item, 'browser') and not marked(item, 'site'),
                'ranks': lambda item: marked(item, 'ranks') or item.path.name == 'test_distributed.py',
                'wheel': lambda item: item.path.name == 'test_package.py'}


def marked(item, name): return item.get_closest_marker(name) is not None


def start_order(item, notebooks_run=True):
    """Where `item` goes in the run: the long ones first, so that the short tests fill both workers at the end. Every
    notebook; the float32 tests again on the baseline kernels (a pytest of its own, test_baseline_kernels.py); the
    site's check once the notebooks it shows have been handed out (in a run without them, first: it is the longest);
    the browser tests; the slow tests; the rest."""
    if marked(item, 'site'): return 2 if notebooks_run else -1
    for order, name in ((0, 'notebook'), (1, 'rerun'), (3, 'browser'), (4, 'slow')):
        if marked(item, name): return order
    return 5


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    # before the other plugins (pytest-xdist reads the groups)
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if 'cuda' in item.keywords and not torch.cuda.is_available(): item.add_marker(skip_cuda)
        for group, member in XDIST_GROUPS.items():
            if member(item): item.add_marker(pytest.mark.xdist_group(group))
    yield
    # after them (`-m` has deselected what does not run)
    notebooks_run = any(marked(item, 'notebook') for item in items)
    items[:] = sorted(items, key=lambda item: start_order(item, notebooks_run))  # stable: in file order within each kind


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist (`-p no:xdist`) has no such hook
def pytest_xdist_node_collection_finished(node, ids):
    """In the controller of `--dist loadgroup`: stop before any test runs if a worker's tests came without their groups.

    A worker names a grouped test's group in its node id (`...@ranks`); a pytest whose node ids pytest-xdist cannot
    change (9.2 with xdist 3.8: pytest-xdist#1386) loses every group silently, and tests that must not overlap (two
    browsers, two multi-process fits, two wheel builds in one folder) would run at once. Every test of
    test_distributed.py and test_package.py is grouped, by file (`XDIST_GROUPS`): a run that collects either (both
    passes of `make test` do) is checked; one that collects neither is not. It reads the group where pytest-xdist 3.8
    writes it (pyproject.toml pins the pair)."""
    if node.config.getoption('dist', 'no') != 'loadgroup': return
    lost = [i for i in ids if i.split('::')[0].rsplit('/', 1)[-1] in ('test_distributed.py', 'test_package.py')
            and '@' not in i]
    if lost:
        pytest.exit(f"pytest-xdist's --dist loadgroup lost the test groups ({lost[0]} has none): pytest "
                    f"{pytest.__version__} keeps node ids that pytest-xdist cannot mark; install the pytest that "
                    "pyproject.toml names (`make test` does)", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """Tests without the `cuda` marker run on the CPU, on a GPU machine too.

    They compare bit for bit with a CPU reference or with a second fit (exact resume, replay, parity in float64);
    a GPU's kernels give other roundings and are not deterministic (atomic adds in convolution backward), so they
    could not. What runs on the GPU is tested by the `cuda` tests and `make gpu-check`. `CUDA_VISIBLE_DEVICES` hides
    the GPU from subprocesses; this process may have started CUDA already, so `is_available` answers False too.
    A notebook runs as `make docs` runs it, with the GPU when there is one: its outputs are the site's.
    """
    if 'cuda' in request.keywords or 'notebook' in request.keywords: return
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)



@pytest.fixture(autouse=True)
def ctrl_c_raises_keyboard_interrupt():
    """Each test starts with Python's own Ctrl-C handler, as in a terminal or a notebook.

    A run started in the background of a non-interactive shell inherits SIGINT ignored, and the learner rightly keeps
    an ignored Ctrl-C ignored; the tests of what a Ctrl-C does need the handler a user has.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# Tensor methods that make the host wait for the device (a GPU): what a callback must not call between ticks.
SYNC_METHODS = ('item', 'cpu', 'tolist', 'numpy', '__float__', '__bool__', '__int__')


@pytest.fixture
def host_reads(monkeypatch):
    "`watch(*modules)` -> a list that collects the name of every host-syncing tensor call made from those modules."
    def watch(*modules):
        reads, files = [], {module.__file__ for module in modules}
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            def counted(self, *args, _original=original, _name=name, **kwargs):
                if sys._getframe(1).f_code.co_filename in files: reads.append(_name)
                return _original(self, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)
        return reads
    return watch
