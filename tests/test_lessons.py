"""Lessons first: a lesson notebook shows its idea in short exported cells, and uses no name of the library before the
notebook that explains it (or an earlier one) defines it.

"Under the hood" notebooks (their title says so) and "Under the hood" sections of a lesson (a heading that starts with
those words, up to the next heading of the same or a higher level) hold the engineering and are exempt from the length
rule: a reader who skips them still has the lesson. The appendices (A1-A4) rebuild other libraries' designs.
"""
import ast
import importlib
import pkgutil
import re
from pathlib import Path

import nbformat
import pytest

import teachloop
import teachloop.all  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
MAX_EXPORTED_LINES = 40
COURSE = sorted(p.stem for p in (ROOT / 'nbs').glob('[0-9]*.ipynb'))  # the course's order is the files' order


def notebook(stem): return nbformat.read(ROOT / 'nbs' / f'{stem}.ipynb', as_version=4)


def title(nb): return next(c.source for c in nb.cells if c.cell_type == 'markdown').splitlines()[0]


def lessons(): return [stem for stem in COURSE if not title(notebook(stem)).startswith('# Under the hood')]


def exported_cells(nb):
    return [c for c in nb.cells if c.cell_type == 'code' and re.match(r'#\|\s*export', c.source)]


def lesson_cells(nb):
    "The cells of a notebook outside its \"Under the hood\" sections."
    headings, kept = [], []  # the open headings, as (level, title)
    for c in nb.cells:
        if c.cell_type == 'markdown':
            for m in re.finditer(r'^(#+)\s+(.*)$', c.source, re.MULTILINE):
                level = len(m.group(1))
                headings = [h for h in headings if h[0] < level] + [(level, m.group(2))]
        if not any(t.startswith('Under the hood') for _, t in headings): kept.append(c)
    return kept


def test_under_the_hood_sections_end_at_the_next_heading_of_their_level():
    cells = [nbformat.v4.new_markdown_cell(s) if s.startswith('#') else nbformat.v4.new_code_cell(s)
             for s in ['# A lesson', 'a', '## Under the hood: locks', 'b', '### Why', 'c', '## Next idea', 'd']]
    assert [c.source for c in lesson_cells(nbformat.v4.new_notebook(cells=cells)) if c.cell_type == 'code'] == ['a', 'd']


def test_some_notebooks_are_under_the_hood_and_most_are_lessons():
    assert {'00c_figures', '11a_dashboard_controls', '11d_dashboard_widget'}.isdisjoint(lessons()) and len(lessons()) > 25


@pytest.mark.parametrize('stem', COURSE)
def test_a_lessons_exported_cells_are_short(stem):
    if stem not in lessons(): return
    nb = notebook(stem)
    lesson = {id(c) for c in lesson_cells(nb)}
    long = {c.id for c in exported_cells(nb) if id(c) in lesson and len(c.source.splitlines()) > MAX_EXPORTED_LINES}
    assert not long, (f"exported cells over {MAX_EXPORTED_LINES} lines: show the idea in "
                                                 "the lesson, move the engineering under the hood")


def defining_notebooks():
    "Each exported name of the library -> the notebook whose cell defines it (read from nbdev's cell markers)."
    marker = re.compile(r'^# %% (?:\.\./)+nbs/([\w-]+)\.ipynb')
    found = {}
    for info in pkgutil.walk_packages(teachloop.__path__, 'teachloop.'):
        module = importlib.import_module(info.name)
        lines = Path(module.__file__).read_text().splitlines()
        marks = [(i + 1, m.group(1)) for i, line in enumerate(lines) if (m := marker.match(line))]
        for node in ast.parse('\n'.join(lines)).body:
            names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                     [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            cells = [stem for line, stem in marks if line <= node.lineno]
            for name in names:
                if cells and name in getattr(module, '__all__', ()): found.setdefault(name, cells[-1])
    return found


def imported_names(nb):
    "The names a notebook's code cells import from teachloop's modules, outside its \"Under the hood\" sections."
    code = '\n'.join(c.source for c in lesson_cells(nb) if c.cell_type == 'code')
    names = set()
    for match in re.finditer(r'^\s*from\s+teachloop[\w.]*\s+import\s+(\([^)]*\)|[^\n]*)', code, re.MULTILINE):
        for part in match.group(1).strip('()').split(','):
            part = part.split('#')[0].strip()
            if part and part != '*': names.add(part.split(' as ')[0].strip())
    return names


def test_no_lesson_uses_a_name_before_the_notebook_that_explains_it():
    where, rank = defining_notebooks(), {stem: i for i, stem in enumerate(COURSE)}
    assert len(where) > 300
    early = {}
    for stem in lessons():
        found = {n for n in imported_names(notebook(stem)) if n in where and rank.get(where[n], -1) > rank[stem]}
        if found: early[stem] = found
    assert not early, early


MIN_EXERCISES, MAX_EXERCISES, MIN_SOLUTIONS = 4, 8, 2


def exercises(nb):
    "The cells of a notebook's \"Exercises\" section (a level-2 heading, up to the next heading of its level or above)."
    inside, cells = False, []
    for c in nb.cells:
        if c.cell_type == 'markdown':
            for m in re.finditer(r'^(#+)\s+(.*)$', c.source, re.MULTILINE):
                if len(m.group(1)) <= 2: inside = m.group(2).strip() == 'Exercises'
        if inside: cells.append(c)
    return cells


def is_solution(cell): return cell.cell_type == 'code' and re.match(r'#\|\s*solution\b', cell.source) is not None


def numbered_items(cells):
    "The numbers of the items in the markdown cells (`1. ...` at the start of a line)."
    return [int(m.group(1)) for c in cells if c.cell_type == 'markdown'
            for m in re.finditer(r'^(\d+)\.\s', c.source, re.MULTILINE)]


def test_exercises_are_read_from_their_section_only():
    cells = [nbformat.v4.new_markdown_cell(s) if not s.startswith('#|') else nbformat.v4.new_code_cell(s)
             for s in ['# A lesson', '1. not an exercise', '## Exercises', '1. first\n2. second', '#| solution\nassert 1',
                       '3. third', '## Under the hood: more', '4. not one either']]
    found = exercises(nbformat.v4.new_notebook(cells=cells))
    assert numbered_items(found) == [1, 2, 3] and [c.source for c in found if is_solution(c)] == ['#| solution\nassert 1']


@pytest.mark.parametrize('stem', COURSE)
def test_every_lesson_ends_with_exercises_whose_solutions_check_their_answers(stem):
    "Questions and experiments numbered 1..n (4 to 8); solutions are code cells marked `#| solution` with an assert."
    if stem not in lessons(): return
    nb = notebook(stem)
    cells = exercises(nb)
    assert cells, f"{stem}: no '## Exercises' section"
    items = numbered_items(cells)
    assert items == list(range(1, len(items) + 1)), f"{stem}: exercises numbered {items}, not 1..n"
    assert MIN_EXERCISES <= len(items) <= MAX_EXERCISES, f"{stem}: {len(items)} exercises"
    solutions = [c for c in cells if is_solution(c)]
    assert len(solutions) >= MIN_SOLUTIONS, f"{stem}: {len(solutions)} solution cells, at least {MIN_SOLUTIONS} wanted"
    unchecked = [c.id for c in solutions if not re.search(r'^\s*assert\b', c.source, re.MULTILINE)]
    assert not unchecked, f"{stem}: solution cells without an assert: {unchecked}"
    stray = [c.id for c in nb.cells if is_solution(c) and c not in cells]
    assert not stray, f"{stem}: solution cells outside the exercises: {stray}"


# Numbers that prose may state as written: settings the reader is asked to use, versions, and arithmetic or math of
# stated settings. Any other number of three significant digits or more in a lesson's prose is a measurement, and comes
# from the cell that computes it (a Markdown output built in the cell).
STATED = {
    '02_momentum': {'0.667', '0.923'},  # convergence rates of the quadratic's analysis, for the stated settings
    '06_schedule': {'11.25'},  # a quarter of the fit's 45 batch intervals
    '07_optimizers': {'0.999', '0.9999', '1.01'},  # settings an exercise asks to try
    '07a_recent_optimizers': {'2.14', '1.26'},  # torch's version; a fixed point of Muon's polynomial
    '10a_sharpness': {'13.3'},  # 2 / 0.15, the stability line of a stated learning rate
    '13b_export': {'2.14'},  # torch's version
}
# Tables of benchmark runs too long for a notebook; the prose names the script that measures them.
BENCHMARK_TABLES = {'12_nan_capture': 'bench/nan_capture_overhead.py', '15_distributed': 'bench/distributed_scaling.py'}


def stated_numbers(nb):
    "The decimals of three or more significant digits in the markdown cells, outside code and math."
    found = []
    for c in nb.cells:
        if c.cell_type != 'markdown': continue
        text = re.sub(r'```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$', '', c.source, flags=re.DOTALL)
        for m in re.finditer(r'(?<![\w.^/-])(\d+\.\d+)(?!\w|\.\d)', text):
            if len(m.group(1).replace('.', '').lstrip('0')) >= 3: found.append(m.group(1))
    return found


def test_stated_numbers_are_found_outside_code_and_math():
    cells = [nbformat.v4.new_markdown_cell('lr 0.1, beta 0.999, `x = 0.123`, $0.456$, and an accuracy of 0.955.')]
    assert stated_numbers(nbformat.v4.new_notebook(cells=cells)) == ['0.999', '0.955']


@pytest.mark.parametrize('stem', COURSE)
def test_numbers_measured_by_a_cell_are_inserted_by_it(stem):
    if stem not in lessons(): return
    nb = notebook(stem)
    if stem in BENCHMARK_TABLES:
        assert any(BENCHMARK_TABLES[stem] in c.source for c in nb.cells if c.cell_type == 'markdown'), stem
        return
    typed = sorted(set(stated_numbers(nb)) - STATED.get(stem, set()))
    assert not typed, (f"{stem}: numbers typed into prose {typed}: build the sentence in the cell that computes them "
                       "(`Markdown(f'...')`), or, for a setting or a version, add them to STATED with the reason")


def test_a_solution_is_closed_in_jupyter_until_opened():
    "After Run All, an exercise's solution cell shows neither its code nor its output until the student opens it."
    open_ = [f"{stem}:{c.id}" for stem in COURSE for c in notebook(stem).cells if is_solution(c) and
             not (c.metadata.get('jupyter', {}).get('source_hidden') and c.metadata['jupyter'].get('outputs_hidden'))]
    assert not open_, (f"solution cells shown open in Jupyter: {open_[:10]}; give them the metadata "
                       "{'jupyter': {'source_hidden': True, 'outputs_hidden': True}}")
