import os

import pytest
import torch

# Two cores shared by the test processes: one torch thread each avoids oversubscription.
torch.set_num_threads(int(os.environ.get('OMP_NUM_THREADS', '1')))


def pytest_report_header(config):
    return f"torch {torch.__version__}, CPU kernels: {torch.backends.cpu.get_cpu_capability()}"


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if 'cuda' in item.keywords and not torch.cuda.is_available(): item.add_marker(skip_cuda)
