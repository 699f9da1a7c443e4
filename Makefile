# Every target creates or reuses the virtual environment in .venv; the second run skips the install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The registry's CUDA build of torch runs on the CPU too, and it is the one torchvision imports with.
TORCH_SPEC ?= torch==2.14.0 torchvision==0.29.2
STAMP := $(VENV)/.installed
NBDEV_FLAGS ?=
NB_WORKERS ?= 2

.PHONY: demo test test-quick gpu-check lab export readme clean-venv browser-deps docs

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

## Train a small CNN on handwritten digits and write a picture of the training.
demo: $(STAMP)
	$(BIN)/teachloop-demo

## All tests: pytest (browser tests included), the numeric tests again on the CPU's baseline kernels (float32
## rounding differs with the vector width: users' CPUs are not this one), every notebook top to bottom.
test: $(STAMP) browser-deps
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "numeric and not slow" -p no:cacheprovider
	OMP_NUM_THREADS=1 $(BIN)/nbdev-test --n-workers $(NB_WORKERS) $(if $(NBDEV_FLAGS),--flags "$(NBDEV_FLAGS)")

## The quick subset while working: no slow or browser tests, no notebooks.
test-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow and not browser"

## On a CUDA machine: the cuda tests, fits with no host sync inside batches, and the GPU benchmarks, in one report.
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py

## JupyterLab on the course notebooks.
lab: $(STAMP)
	$(BIN)/jupyter lab nbs/ $$([ "$$(id -u)" = 0 ] && echo --allow-root)

export: $(STAMP)
	$(BIN)/nbdev-export

## README.md is the home page notebook, converted (nbdev's own README step needs Quarto).
readme: $(STAMP)
	$(BIN)/jupyter nbconvert --to markdown nbs/index.ipynb --stdout 2>/dev/null > README.md

## The course as a static site in _site/ (Sphinx, myst-nb): every notebook runs in a kernel, cached, so it runs again
## only when its code or the package changed; a cell that raises fails the build; cells nbdev-test skips are not run.
## npm fetches the widget manager and MathJax once: the pages need no network.
docs: $(STAMP)
	$(BIN)/python docs/prepare.py
	OMP_NUM_THREADS=1 $(BIN)/sphinx-build -q -T -j $(NB_WORKERS) -b html -c docs -d docs/_build/doctrees docs/_build/src _site

## Chromium for the browser tests (Debian package; Playwright cannot download browsers here).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: browser tests will be skipped"; }

clean-venv:
	rm -rf $(VENV)
