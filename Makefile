# Two entry points (see README): `make run` sets everything up and runs the main job; `make test`
# runs the tests. Both create .venv, install torch and build the extension on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
NPROC ?= 2
OUT ?=

SOURCES := setup.py $(shell find csrc -type f 2>/dev/null)

.PHONY: setup build run test bench clean

setup: $(VENV)/.deps-installed build

$(VENV)/.deps-installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel
	$(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -r requirements-dev.txt
	touch $@

build: $(VENV)/.built

$(VENV)/.built: $(VENV)/.deps-installed $(SOURCES)
	$(PY) -m pip install --no-build-isolation --no-deps -v -e . > $(VENV)/build.log 2>&1 \
		|| (tail -n 60 $(VENV)/build.log; exit 1)
	grep -h -m1 -o "clipshard: building.*" $(VENV)/build.log || true
	$(PY) -c "import clipshard"
	touch $@

run: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) examples/train_clip.py $(if $(OUT),--out $(OUT),)

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf build *.egg-info clipshard/*.so $(VENV)/.built
