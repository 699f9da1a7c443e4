"""A pytest plugin for `tools/mutate.py`: each test its own coverage context, the tests' times, and a run order.

Loaded with `-p mutation_contexts` (with `tools/` on the path). Under `coverage run` it switches coverage's context to
the test's node id around each test, so that the coverage data says which tests ran each line; the processes a test
starts (torch.distributed's ranks) take it from `MUTATION_CONTEXT`, set for them. With
`MUTATION_TIMES=<file>` it writes `{node id: [seconds, outcome]}` there at the end; with `MUTATION_TESTS=<file>` (node
ids, one a line) it runs only those of the collected tests, in that order.
"""
import json
import os
from pathlib import Path

import pytest

try: import coverage
except ImportError: coverage = None

_times = {}


def _coverage():
    return coverage.Coverage.current() if coverage is not None else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cov = _coverage()
    if cov is not None:
        cov.switch_context(item.nodeid)
        os.environ['MUTATION_CONTEXT'] = item.nodeid  # the context of the processes it starts (their rc file)
    yield
    if cov is not None:
        cov.switch_context('')
        os.environ.pop('MUTATION_CONTEXT', None)


def pytest_runtest_logreport(report):
    seconds, outcome = _times.get(report.nodeid, (0., 'passed'))
    if report.failed: outcome = 'failed'
    elif report.skipped and outcome == 'passed': outcome = 'skipped'
    _times[report.nodeid] = (seconds + report.duration, outcome)


@pytest.hookimpl(trylast=True)  # after the project's conftest has ordered them
def pytest_collection_modifyitems(config, items):
    listed = os.environ.get('MUTATION_TESTS')
    if not listed: return
    rank = {nodeid: i for i, nodeid in enumerate(Path(listed).read_text().splitlines())}
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in rank])
    items[:] = sorted((item for item in items if item.nodeid in rank), key=lambda item: rank[item.nodeid])


def pytest_sessionfinish(session):
    out = os.environ.get('MUTATION_TIMES')
    if out: Path(out).write_text(json.dumps(_times))
