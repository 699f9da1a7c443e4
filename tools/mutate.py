"""Mutation testing of teachloop's core modules with cosmic-ray: how many small bugs put into the code do the tests catch?

    python tools/mutate.py [--modules teachloop/inference.py ...] [--sample 40] [--seed 0] [--workers 2]
                           [--cap 60] [--report bench/results/mutation-report.md]

`make mutate` runs it on every module of `MODULES` (it is not part of `make test`). For each module:
1. cosmic-ray lists its mutants, with every operator that needs no arguments (binary, comparison and unary operators
   swapped, numbers changed, True and False swapped, `and` and `or` swapped, `not` added, loops run zero times,
   decorators removed, exceptions replaced), less those in type annotations (never run) and those that are not Python;
2. a fixed random sample of them (`--sample` per module, drawn with `--seed`; `--sample 0`: all) is tried, each in a
   scratch copy of the working tree (the checkout itself is never changed), against the tests of the module's test
   files that ran the mutated function (or class) in one coverage run of those files, where each test is its own
   coverage context (the processes a test starts, torch.distributed's ranks, record under its context too); fastest
   first, at most `--cap` seconds of them as timed in that run, stopping at the first failure. A mutant in code that
   no test runs survives without a run;
3. the report gives each module's score (killed / tried, with its 95% interval: the sample's uncertainty), the
   survivors with their diffs, and how long it all took. A survivor that `EQUIVALENTS` (tools/equivalent_mutants.toml)
   lists, with the reason why no test can tell it from the code, is reported apart and left out of the score.
   cosmic-ray's sessions stay in `.mutation/`, where `cr-report .mutation/<module>.sqlite` reads them (its rate counts
   the mutants left out of the sample as done).
"""
import argparse
import ast
import datetime
import difflib
import importlib
import json
import math
import os
import platform
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import cosmic_ray.plugins
from cosmic_ray.commands import init
from cosmic_ray.mutating import mutate_code, use_mutation
from cosmic_ray.work_db import use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult
from coverage import CoverageData

ROOT = Path(__file__).resolve().parents[1]

# The modules mutated, each with the test files whose tests may kill its mutants. A new module: add its line here.
MODULES = {
    'teachloop/optim/core.py': ['tests/test_optimizer.py', 'tests/test_optimizers.py', 'tests/test_fast_optimizers.py',
                                'tests/test_differential.py', 'tests/test_optimizer_contracts.py'],
    'teachloop/optim/fast.py': ['tests/test_fast_optimizers.py', 'tests/test_optimizer_contracts.py'],
    'teachloop/learner.py': ['tests/test_learner.py', 'tests/test_fit_state.py', 'tests/test_callbacks.py',
                             'tests/test_callback_contracts.py', 'tests/test_sharded_checkpoints.py',
                             'tests/test_distributed.py', 'tests/test_silent_wrongs.py', 'tests/test_checkpoint.py'],
    'teachloop/callback/core.py': ['tests/test_callbacks.py', 'tests/test_learner.py',
                                   'tests/test_callback_contracts.py', 'tests/test_metrics.py',
                                   'tests/test_distributed.py'],
    'teachloop/callback/faults.py': ['tests/test_faults.py', 'tests/test_callback_contracts.py'],
    'teachloop/callback/checkpoint.py': ['tests/test_checkpoint.py', 'tests/test_fit_state.py', 'tests/test_callback_contracts.py',
                                         'tests/test_optimizer_contracts.py', 'tests/test_sharded_checkpoints.py',
                                         'tests/test_distributed.py'],
    'teachloop/callback/nan_capture.py': ['tests/test_nan_capture.py', 'tests/test_callback_contracts.py'],
    'teachloop/inference.py': ['tests/test_inference.py'],
}

UNTESTED = "no test of the module's test files runs this code"
EQUIVALENTS = Path(__file__).with_name('equivalent_mutants.toml')  # survivors that behave as the code does, and why
SESSIONS = ROOT / '.mutation'  # cosmic-ray's session files (ignored by git)
REPORT = ROOT / 'bench' / 'results' / 'mutation-report.md'


@dataclass
class Mutant:
    "One sampled mutant: cosmic-ray's work item, where it is, and the tests chosen for it."
    module: str
    job_id: str
    spec: object  # cosmic-ray's MutationSpec
    scope: str  # the function or class it is in ('' at module level)
    tests: list = field(default_factory=list)  # node ids, fastest first
    capped: bool = False  # some of the tests that run its code were left out (`--cap`)
    result: WorkResult = None
    seconds: float = 0.
    note: str = ''

    @property
    def line(self): return self.spec.start_pos[0]

    @property
    def label(self): return f"{self.spec.operator_name} #{self.spec.occurrence}"

    @property
    def survived(self): return self.result.test_outcome == TestOutcome.SURVIVED

    def changed_lines(self):
        "The lines the mutant takes out and puts in, stripped: what `EQUIVALENTS` matches (line numbers move)."
        diff = self.result.diff.splitlines()
        return ([l[1:].strip() for l in diff if l.startswith('-') and not l.startswith('---')],
                [l[1:].strip() for l in diff if l.startswith('+') and not l.startswith('+++')])


def equivalent_reasons(path=EQUIVALENTS):
    "{(module, lines taken out, lines put in): why the mutant behaves as the code does} from the listed equivalents."
    listed = tomllib.loads(path.read_text())['equivalent'] if path.exists() else []
    return {(e['module'], tuple(e['removed']), tuple(e['added'])): e['reason'] for e in listed}


def equivalence(mutant, reasons):
    "The reason `mutant` is listed as equivalent, or None."
    removed, added = mutant.changed_lines()
    return reasons.get((mutant.module, tuple(removed), tuple(added)))


# ---- the scratch copies and the subprocesses that run pytest in them

def copy_tree(into):
    "Copy the working tree (tracked files and untracked ones that git does not ignore) into `into`."
    listed = subprocess.run(['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split('\0')
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def pytest_env(copy, **extra):
    "The environment of a pytest run in `copy`: its package and this plugin first on the path, one thread, no .pyc."
    env = {k: v for k, v in os.environ.items() if not k.startswith(('COVERAGE_', 'MUTATION_', 'PYTEST_'))}
    return {**env, 'PYTHONPATH': os.pathsep.join([str(copy), str(copy / 'tools')]), 'OMP_NUM_THREADS': '1',
            'PYTHONDONTWRITEBYTECODE': '1', **extra}


def one_at_a_time_each(holders, items, function):
    "`function(holder, item)` for every item, each of `holders` (copies, runners) busy with one at a time; as they end."
    free = queue.Queue()
    for holder in holders: free.put(holder)
    def call(item):
        holder = free.get()
        try: return function(holder, item)
        finally: free.put(holder)
    with ThreadPoolExecutor(len(holders)) as pool:
        yield from (future.result() for future in as_completed([pool.submit(call, item) for item in items]))


PYTEST_ARGS = ['-q', '-p', 'no:cacheprovider', '-p', 'mutation_contexts', '-n', '0']


def coverage_run(copy, test_file):
    "Run `test_file` in `copy` under coverage, every Python subprocess and process too, each test in its own context."
    rc = copy / '.mutation-rc'
    # a process that a test starts (run_ranks's ranks) records under that test's node id, its static context
    rc.write_text(f"[run]\nsource = {copy / 'teachloop'}\nparallel = true\npatch = subprocess\n"
                  f"concurrency = thread,multiprocessing\ncontext = ${{MUTATION_CONTEXT}}\n"
                  f"data_file = {copy / '.mutation-coverage'}\n")
    times = copy / f".mutation-times-{Path(test_file).stem}.json"
    subprocess.run([sys.executable, '-m', 'coverage', 'run', '--rcfile', str(rc), '-m', 'pytest', *PYTEST_ARGS,
                    test_file], cwd=copy, env=pytest_env(copy, MUTATION_TIMES=str(times)), capture_output=True)


# ---- a server per copy that runs pytest in forked children: the libraries every run imports, imported once

def library_modules(copy):
    "The modules, not teachloop's, that importing the whole package imports (torch, matplotlib, ...)."
    listing = ("import sys, json; before = set(sys.modules); import teachloop.all, pytest; "
               "print(json.dumps(sorted(m for m in set(sys.modules) - before "
               "if not m.startswith(('teachloop', '__')))))")
    return json.loads(subprocess.run([sys.executable, '-c', listing], cwd=copy, env=pytest_env(copy), check=True,
                                     capture_output=True, text=True).stdout)


def serve():
    "Import the libraries named on the first line of stdin; then for each request line run pytest in a forked child."
    for name in json.loads(sys.stdin.readline()):
        try: importlib.import_module(name)
        except Exception: pass  # a module that only imports as part of its package's own import order
    for line in sys.stdin:
        request = json.loads(line)
        child = os.fork()
        if child == 0: _run_child(request)
        print(json.dumps({'code': _wait(child, request['timeout'])}), flush=True)


def _run_child(request):
    os.setsid()  # its own process group, killed whole on a timeout
    output = os.open(request['output'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ.update(request['env'])
    code = 3
    try:
        import pytest
        code = int(pytest.main(request['args']))
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(child, timeout):
    "The exit code of `child` (negative: a signal), or None when it ran past `timeout` and was killed."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done: return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.killpg(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return None


class Runner:
    "A scratch copy of the working tree and its pytest server."
    def __init__(self, copy, modules):
        self.copy = copy
        self.server = subprocess.Popen([sys.executable, __file__, '--serve'], cwd=copy, env=pytest_env(copy),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.server.stdin.write(json.dumps(modules) + '\n')

    def pytest(self, args, env, timeout):
        "Run pytest in the copy: (exit code, or None when it timed out; the output's tail)."
        output = self.copy / '.mutation-output'
        request = {'args': PYTEST_ARGS + list(args), 'env': env, 'timeout': timeout, 'output': str(output)}
        self.server.stdin.write(json.dumps(request) + '\n')
        self.server.stdin.flush()
        code = json.loads(self.server.stdout.readline())['code']
        return code, output.read_text(errors='replace')[-3000:]

    def close(self):
        self.server.stdin.close()
        self.server.wait()


# ---- which tests run which lines: one coverage run, each test its own context

def baseline(copies, test_files):
    "Run each of `test_files` under coverage in a free copy: ({module: {line: contexts}}, {node id: (seconds, outcome)})."
    for _ in one_at_a_time_each(copies, test_files, coverage_run): pass
    times, lines = {}, defaultdict(lambda: defaultdict(set))
    for copy in copies:
        for found in copy.glob('.mutation-times-*.json'): times.update(json.loads(found.read_text()))
        for data_file in copy.glob('.mutation-coverage.*'):
            data = CoverageData(basename=str(data_file))
            data.read()
            for measured in data.measured_files():
                module = Path(measured).relative_to(copy).as_posix()
                for line, contexts in (data.contexts_by_lineno(measured) or {}).items(): lines[module][line].update(contexts)
    return lines, times


def scopes(source):
    "(name, first line with decorators, first line of the body, last line) of every function and class, in any order."
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((node.name, first, node.body[0].lineno, node.end_lineno))
    return found


def innermost(found, line):
    "The innermost of the `scopes` that holds `line`, or None at module level."
    holding = [s for s in found if s[1] <= line <= s[3]]
    return min(holding, key=lambda s: s[3] - s[1]) if holding else None


def choose_tests(mutant, scope, lines, module_tests, times, cap):
    "The tests for `mutant`: those that ran its function or class, fastest first, up to `cap` seconds of them."
    if scope is None: ran = set(module_tests)  # module level: what it defines may be used anywhere
    else:
        _, first, body, last = scope
        contexts = set().union(*(lines.get(line, ()) for line in range(first, last + 1)))
        ran = contexts & set(module_tests)
        body_ran_untimed = any('' in lines.get(line, ()) for line in range(body, last + 1))
        if not ran and body_ran_untimed: ran = set(module_tests)  # run outside any test: at import, or in a subprocess
    ordered = sorted(ran, key=lambda t: times[t][0])
    total, chosen = 0., []
    for test in ordered:
        if chosen and total + times[test][0] > cap: break
        chosen.append(test)
        total += times[test][0]
    mutant.tests, mutant.capped = chosen, len(chosen) < len(ordered)


# ---- the mutants: listed and sampled by cosmic-ray's session, tried one by one

def annotation_spans(source):
    "((line, column), (end line, end column)) of every type annotation: never run (`from __future__ import annotations`)."
    spans = []
    for node in ast.walk(ast.parse(source)):
        annotations = []
        if isinstance(node, ast.arg): annotations = [node.annotation]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)): annotations = [node.returns]
        elif isinstance(node, ast.AnnAssign): annotations = [node.annotation]
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in annotations if a is not None]
    return spans


def is_python(source, spec):
    "Whether the mutant `spec` of `source` compiles (cosmic-ray swaps the `**` of `{**d}` and `f(**kw)` too)."
    operator = cosmic_ray.plugins.get_operator(spec.operator_name)(**spec.operator_args)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', SyntaxWarning)  # `x is 1`: Python, and a mutant to try
        try: compile(mutate_code(source, operator, spec.occurrence) or '', str(spec.module_path), 'exec')
        except SyntaxError: return False
    return True


def sample_mutants(module, size, seed):
    "A new cosmic-ray session for `module`: the sample of its mutants, and their numbers (all, in annotations, not Python)."
    SESSIONS.mkdir(exist_ok=True)
    source = (ROOT / module).read_text()
    spans = annotation_spans(source)
    def in_annotation(w): return any(a <= tuple(w.mutations[0].start_pos) < b for a, b in spans)
    with use_db(str(SESSIONS / f"{module.replace('/', '.')}.sqlite")) as db:
        init(module_paths=[Path(module)], work_db=db, operator_cfgs={})  # operators needing arguments are left out
        items = sorted(db.work_items, key=lambda w: (w.mutations[0].operator_name, w.mutations[0].occurrence))
        candidates = [w for w in items if not in_annotation(w)]
        annotated = len(items) - len(candidates)
        if 0 < size < len(candidates): candidates = random.Random(f"{seed}:{module}").sample(candidates, len(candidates))
        chosen, invalid = [], 0
        for w in candidates:  # in the drawn order, until the sample is full
            if 0 < size <= len(chosen): break
            if is_python(source, w.mutations[0]): chosen.append(w)
            else: invalid += 1
        skipped = {w.job_id for w in items} - {w.job_id for w in chosen}
        db.set_multiple_results(skipped, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    counts = {'mutants': len(items), 'annotations': annotated, 'invalid': invalid}
    return [Mutant(module, w.job_id, w.mutations[0], '') for w in chosen], counts


def plan(modules, args, lines, times):
    "The sampled mutants of every module, each with its tests; and the numbers of mutants of each module."
    totals, mutants = {}, []
    for module in modules:
        sampled, totals[module] = sample_mutants(module, args.sample, args.seed)
        module_tests = [t for t, (_, result) in times.items()
                        if result == 'passed' and t.split('::')[0] in MODULES[module]]
        found = scopes((ROOT / module).read_text())
        for mutant in sampled:
            scope = innermost(found, mutant.line)
            mutant.scope = scope[0] if scope else ''
            choose_tests(mutant, scope, lines.get(module, {}), module_tests, times, args.cap)
        mutants += sampled
    return totals, mutants


def record(mutant):
    "Write the mutant's result into its module's cosmic-ray session."
    with use_db(str(SESSIONS / f"{mutant.module.replace('/', '.')}.sqlite")) as db:
        db.set_result(mutant.job_id, mutant.result)


def diff_of(original, mutated, module):
    "The mutant as a unified diff of `module`."
    return ''.join(difflib.unified_diff(original.splitlines(keepends=True), mutated.splitlines(keepends=True),
                                        f'a/{module}', f'b/{module}', n=1))


def outcome(code):
    "cosmic-ray's outcome for pytest's exit code (None: timed out)."
    if code == 0: return TestOutcome.SURVIVED
    # a test failed (1), the import or pytest itself broke (2, 3), it crashed (< 0) or ran past its time (None)
    if code is None or code < 0 or code in (1, 2, 3): return TestOutcome.KILLED
    return TestOutcome.INCOMPETENT  # 4, 5: the selection itself was wrong (no such test, none collected)


def try_mutant(mutant, runner, times):
    "Apply `mutant` in the runner's copy, run its tests there, put the code back; fills in its result."
    copy = runner.copy
    operator = cosmic_ray.plugins.get_operator(mutant.spec.operator_name)(**mutant.spec.operator_args)
    with use_mutation(copy / mutant.spec.module_path, operator, mutant.spec.occurrence) as (original, mutated):
        if mutated is None:
            mutant.result = WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
            return mutant
        if mutant.tests: code, output = run_tests(mutant, runner, times)
        else: code, output, mutant.note = 0, '', UNTESTED
    mutant.result = WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome(code), output=output,
                               diff=diff_of(original, mutated, mutant.module))
    return mutant


def run_tests(mutant, runner, times):
    "Run the mutant's tests in the runner's copy, where it is applied, up to the first failure: (exit code, output)."
    listed = runner.copy / '.mutation-tests'
    listed.write_text('\n'.join(mutant.tests))
    files = sorted({t.split('::')[0] for t in mutant.tests})
    timeout = 60 + 3 * sum(times[t][0] for t in mutant.tests)  # slack: two workers share the cores
    start = time.monotonic()
    code, output = runner.pytest(['-x', *files], {'MUTATION_TESTS': str(listed)}, timeout)
    mutant.seconds = time.monotonic() - start
    if code is None: mutant.note = f'timed out after {timeout:.0f} s'
    return code, output


def run_all(mutants, runners, times):
    "Try every mutant, each runner on one at a time; the costliest first, so that the runners end together."
    order = sorted(mutants, key=lambda m: -sum(times[t][0] for t in m.tests))
    def attempt(runner, mutant): return try_mutant(mutant, runner, times)
    for done, mutant in enumerate(one_at_a_time_each(runners, order, attempt), 1):
        record(mutant)
        status = mutant.result.test_outcome or mutant.result.worker_outcome
        print(f"[{done}/{len(order)}] {mutant.module}:{mutant.line} {mutant.label}: {status.value}"
              f"{f' ({mutant.note})' if mutant.note else ''}, {len(mutant.tests)} tests, {mutant.seconds:.1f} s",
              flush=True)


# ---- the report

def wilson(killed, n, z=1.96):
    "The 95% interval of a proportion measured as `killed` of `n` (Wilson's)."
    if n == 0: return (math.nan, math.nan)
    p = killed / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return ((centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n))


def module_row(module, counts, mutants, reasons):
    "The report's line of one module."
    tried = [m for m in mutants if m.result.worker_outcome == WorkerOutcome.NORMAL]
    killed = [m for m in tried if m.result.test_outcome == TestOutcome.KILLED]
    equivalent = [m for m in tried if m.survived and equivalence(m, reasons)]
    survived = [m for m in tried if m.survived and m not in equivalent]
    untested = [m for m in survived if m.note == UNTESTED]
    timeouts = [m for m in killed if m.note.startswith('timed out')]
    incompetent = [m for m in tried if m.result.test_outcome == TestOutcome.INCOMPETENT]
    scored = len(killed) + len(survived)
    low, high = wilson(len(killed), scored)
    score = f"{len(killed) / scored:.0%}" if scored else '-'
    return (f"| `{module}` | {counts['mutants']} | {counts['annotations']} | {counts['invalid']} | {len(tried)} "
            f"| {len(killed)} | {len(survived) - len(untested)} | {len(untested)} | {len(equivalent)} | {len(timeouts)} "
            f"| {len(incompetent)} "
            f"| **{score}** | {low:.0%}-{high:.0%} | {sum(m.seconds for m in mutants) / 60:.1f} min |")


def survivor_entry(mutant, reason=None):
    "Where a surviving mutant is, what it ran, its diff, and why it is equivalent where it is listed so."
    how = mutant.note or (f"survived {len(mutant.tests)} tests" + (' (capped)' if mutant.capped else '')
                          + f" in {mutant.seconds:.1f} s")
    scope = f" in `{mutant.scope}`" if mutant.scope else ' at module level'
    why = f"\n\n  Equivalent: {reason}" if reason else ''
    return f"- line {mutant.line}{scope}, {mutant.label}: {how}{why}\n\n```diff\n{mutant.result.diff.rstrip()}\n```\n"


def write_report(path, args, totals, mutants, failing, durations):
    "The Markdown report: the run, each module's score, the survivors, the equivalent mutants found."
    reasons = equivalent_reasons()
    by_module = defaultdict(list)
    for m in mutants: by_module[m.module].append(m)
    run = [m for m in mutants if m.tests]
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    per_mutant = [m.seconds for m in run]
    lines = [
        "# Mutation testing of the core modules",
        "",
        f"`python tools/mutate.py {' '.join(sys.argv[1:])}` (`make mutate`), {datetime.date.today()}, commit {commit}"
        f"{' with uncommitted changes' if dirty else ''}; cosmic-ray {version('cosmic-ray')}, coverage "
        f"{version('coverage')}, torch {version('torch')}, Python {platform.python_version()}, {args.workers} "
        f"worker(s) on {os.cpu_count()} CPU(s).",
        "",
        f"Sample: {'every mutant' if args.sample <= 0 else f'{args.sample} mutants per module, drawn with seed {args.seed}'}"
        f"; each mutant ran against the tests of its module's test files that ran its function or class (at most "
        f"{args.cap:.0f} s of them as timed in the coverage run), fastest first, up to the first failure. The score is "
        "killed / (killed + survived), where the survivors listed as equivalent in tools/equivalent_mutants.toml (each "
        "with its reason, below) are left out; the interval is the 95% interval of the sample's score (Wilson).",
        "",
        "| module | mutants | in annotations (left out) | not Python (drawn, left out) | tried | killed | survived "
        "| no test runs it (survived) | equivalent (left out) | timeouts (killed) | incompetent | score | 95% interval "
        "| time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(module_row(module, totals[module], by_module[module], reasons) for module in totals),
        "",
        f"Duration: {durations['all'] / 60:.1f} min in all: the coverage run {durations['baseline'] / 60:.1f} min, the "
        f"mutants {durations['mutants'] / 60:.1f} min ({len(run)} run, "
        f"{statistics.mean(per_mutant) if per_mutant else 0:.1f} s each on average, median "
        f"{statistics.median(per_mutant) if per_mutant else 0:.1f} s, on {args.workers} worker(s)).",
        "",
    ]
    if failing: lines += ["Tests that failed without any mutant (left out of every selection): "
                          + ', '.join(f"`{t}`" for t in sorted(failing)), ""]
    lines += ["## Survivors", ""]
    for module in totals:
        survivors = sorted((m for m in by_module[module] if m.survived and not equivalence(m, reasons)),
                           key=lambda m: m.line)
        lines += [f"### `{module}` ({len(survivors)})", "", *(survivor_entry(m) for m in survivors)]
    lines += ["## Equivalent mutants (left out of the scores)", ""]
    for module in totals:
        equivalent = sorted((m for m in by_module[module] if m.survived and equivalence(m, reasons)),
                            key=lambda m: m.line)
        if equivalent: lines += [f"### `{module}` ({len(equivalent)})", "",
                                 *(survivor_entry(m, equivalence(m, reasons)) for m in equivalent)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('\n'.join(lines) + '\n')


# ---- the whole run

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--modules', nargs='+', default=list(MODULES), help='modules of MODULES to mutate (all)')
    parser.add_argument('--sample', type=int, default=40, help='mutants tried per module, 0 for all (40)')
    parser.add_argument('--seed', type=int, default=0, help="the sample's seed (0)")
    parser.add_argument('--workers', type=int, default=2, help='mutants tried at once, each in its own copy (2)')
    parser.add_argument('--cap', type=float, default=60., help="seconds of a mutant's tests, as timed (60)")
    parser.add_argument('--report', type=Path, default=REPORT, help='the Markdown report to write')
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown: parser.error(f"not in MODULES: {unknown}; add them there with their test files")
    modules = [m for m in args.modules if (ROOT / m).exists()]
    for m in sorted(set(args.modules) - set(modules)): print(f"{m} does not exist: left out")
    os.chdir(ROOT)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix='teachloop-mutation-') as scratch:
        copies = [copy_tree(Path(scratch) / f'copy{i}') for i in range(args.workers)]
        test_files = sorted({f for m in modules for f in MODULES[m]}, key=lambda f: -(ROOT / f).stat().st_size)
        print(f"coverage run of {len(test_files)} test files on {len(copies)} worker(s) ...", flush=True)
        lines, times = baseline(copies, test_files)
        baseline_seconds = time.monotonic() - start
        totals, mutants = plan(modules, args, lines, times)
        print(f"coverage run: {baseline_seconds:.0f} s; {len(mutants)} mutants to try", flush=True)
        libraries = library_modules(copies[0])
        runners = [Runner(copy, libraries) for copy in copies]
        try: run_all(mutants, runners, times)
        finally:
            for runner in runners: runner.close()
    durations = {'all': time.monotonic() - start, 'baseline': baseline_seconds}
    durations['mutants'] = durations['all'] - baseline_seconds
    failing = {t for t, (_, result) in times.items() if result == 'failed'}
    write_report(args.report, args, totals, mutants, failing, durations)
    print(f"report: {args.report} ({durations['all'] / 60:.1f} min)")


if __name__ == '__main__':
    if sys.argv[1:] == ['--serve']: serve()
    else: main()
