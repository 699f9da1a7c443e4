# Every target creates or reuses the virtual environment in .venv; the second run skips the install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The registry's CUDA build of torch runs on the CPU too, and it is the one torchvision imports with.
TORCH_SPEC ?= torch==2.14.0 torchvision==0.29.2
STAMP := $(VENV)/.installed
NB_WORKERS ?= 2
# pytest on both cores (pytest-xdist); tests/conftest.py starts the long tests first and keeps the browser tests (and
# the multi-process ones) to one worker at a time.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: demo test test-busy test-quick gpu-check mutate lab export readme clean-venv browser-deps docs

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	@# nbdev-export imports the processor that writes the parameters' comments into the docstrings (tools/)
	$(BIN)/python -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_path("purelib"), "teachloop-tools.pth").write_text(str(pathlib.Path("tools").resolve()) + "\n")'
	touch $(STAMP)

## Train a small CNN on handwritten digits and write a picture of the training.
demo: $(STAMP)
	$(BIN)/teachloop-demo

## All tests, in one run of pytest on both cores: every test (browser tests included); every notebook top to bottom in a
## Jupyter kernel, as the site runs it; the site built from those notebooks (`make docs`) and checked in Chromium; and
## the float32 tests a second time on the CPU's baseline kernels (float32 rounding differs with the vector width: users'
## CPUs are not this one; a float64 comparison, within 1e-10 or so, and two fits equal bit for bit on one machine do
## not depend on it), in a pytest process of their own that one test starts (tests/test_baseline_kernels.py).
test: $(STAMP) browser-deps
	$(PYTEST) --durations=15

## `make test` with two CPU-bound processes running beside it all along (a busy laptop, a shared CI runner); they are
## stopped when it ends, whatever the result (and end by themselves if their shell is killed).
CPU_HOG := $(PYTHON) -c 'import itertools, os; shell = os.getppid(); all(os.getppid() == shell for _ in itertools.count())'
test-busy: $(STAMP) browser-deps
	@$(CPU_HOG) & one=$$!; $(CPU_HOG) & two=$$!; \
	trap 'kill $$one $$two 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	echo "make test-busy: CPU-bound processes $$one and $$two run beside the tests"; \
	$(MAKE) --no-print-directory test

## The quick subset while working: no slow or browser tests, no notebooks.
test-quick: $(STAMP)
	$(PYTEST) -m "not slow and not browser and not notebook"

## On a CUDA machine: the cuda tests, fits with no host sync inside batches, and the GPU benchmarks, in one report.
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py

## Mutation testing of the core modules (tools/mutate.py; not part of `make test`): a seeded sample of each module's
## mutants (cosmic-ray), each run against the tests that run its code, on both cores; the report goes to
## bench/results/mutation-report.md. Options through MUTATE_ARGS, e.g. MUTATE_ARGS="--modules teachloop/inference.py".
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py --workers $(TEST_WORKERS) $(MUTATE_ARGS)

## JupyterLab on the course notebooks.
lab: $(STAMP)
	$(BIN)/jupyter lab nbs/ $$([ "$$(id -u)" = 0 ] && echo --allow-root)

export: $(STAMP)
	$(BIN)/nbdev-export

## README.md is the home page notebook, converted (nbdev's own README step needs Quarto).
readme: $(STAMP)
	$(BIN)/jupyter nbconvert --to markdown nbs/index.ipynb --stdout 2>/dev/null > README.md

## The course as a static site in _site/ (Sphinx, myst-nb): every notebook runs in a kernel, cached, so it runs again
## only when its code, the package or what is installed changed (`make test` has run them all); a cell that raises
## fails the build; every cell runs, as in a student's Run All (a cell that needs a GPU checks for it itself).
## npm fetches the widget manager and MathJax once: the pages need no network.
docs: $(STAMP)
	$(BIN)/python docs/prepare.py
	OMP_NUM_THREADS=1 $(BIN)/sphinx-build -q -T -j $(NB_WORKERS) -b html -c docs -d docs/_build/doctrees docs/_build/src _site

## Chromium for the browser tests (Debian package; Playwright cannot download browsers here).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: browser tests will be skipped"; }

clean-venv:
	rm -rf $(VENV)
