"""The float32 tests a second time, on the CPU's baseline kernels.

float32 rounding depends on the CPU's vector width (AVX2, AVX-512, NEON): a user's CPU is not this one. The tests that
compare float32 results with a reference within a derived tolerance (marked `float32`) run again here on the kernels
every CPU has (`ATEN_CPU_CAPABILITY=default`), in a pytest process of their own: torch reads the variable once, when it
loads. A float64 comparison (within 1e-10 or so) and two fits equal bit for bit on one machine do not depend on the
kernels, so they run once.

It is one test of `make test`'s single pytest run, started early (tests/conftest.py): its process takes one core
while the other tests share the rest, instead of a second pytest run after the first.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKS = 'float32 and not slow'


def float32_files(items):
    """The test files of the collected `items` that hold float32 tests; every test file when none was collected (this
    test run alone): the run below selects the tests by their mark."""
    files = sorted({str(item.path.relative_to(ROOT)) for item in items if item.get_closest_marker('float32')})
    return files or sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'tests').glob('test_*.py'))


def counts(summary):
    "Outcome -> number, from pytest's last line ('3 passed, 1 skipped, 2 deselected in 4.20s')."
    return {word: int(n) for n, word in re.findall(r'(\d+) (\w+)', summary)}


@pytest.mark.slow
@pytest.mark.rerun
@pytest.mark.timeout(3600)
def test_the_float32_tests_pass_on_the_cpus_baseline_kernels(request):
    items = request.session.items
    expected = sum(1 for item in items if item.get_closest_marker('float32') and not item.get_closest_marker('slow'))
    env = os.environ | {'ATEN_CPU_CAPABILITY': 'default', 'OMP_NUM_THREADS': '1'}
    run = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'no:xdist', '-p', 'no:cacheprovider', '-rfE',
                          '-m', MARKS, *float32_files(items)], cwd=ROOT, env=env, capture_output=True, text=True)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"the float32 tests on the baseline kernels:\n{output[-12000:]}"
    assert 'CPU kernels: DEFAULT' in output  # conftest's report header: torch took the variable
    ran = counts(output.strip().splitlines()[-1])
    if expected:  # every float32 test this session collected ran there (a file left out would leave the count short)
        assert ran.get('passed', 0) + ran.get('skipped', 0) >= expected, ran
    else: assert ran.get('passed', 0) > 0, ran
