# Two entry points (see README): `make run` sets everything up and runs the main job; `make test`
# runs the tests. Both create .venv, install torch and build the extension on first use.
#
# Which kernels get built: CUDA kernels can only run where a GPU is, and compiling them for four
# architectures takes minutes on a small machine, so without a visible GPU the build is CPU-only
# unless FORCE_CUDA=1 (what CI sets, so that a CUDA compile error fails CI). `pip install .`
# itself builds the CUDA kernels whenever nvcc and a CUDA build of torch are present.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
NPROC ?= 2
OUT ?=

GPU_VISIBLE := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(FORCE_CUDA)$(GPU_VISIBLE),)
BUILD_KIND := cpu
BUILD_ENV := USE_CUDA=0
else
BUILD_KIND := cuda
BUILD_ENV := FORCE_CUDA=1
endif
BUILT := $(VENV)/.built-$(BUILD_KIND)
SOURCES := setup.py build_support.py $(shell find csrc -type f 2>/dev/null)

.PHONY: setup build run test test-matrix clean

setup: $(VENV)/.deps-installed build

$(VENV)/.deps-installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

build: $(BUILT)

$(BUILT): $(VENV)/.deps-installed $(SOURCES)
	rm -f $(VENV)/.built-*
	$(BUILD_ENV) $(PY) -m pip install --no-build-isolation --no-deps -v -e . > $(VENV)/build.log 2>&1 \
		|| (tail -n 60 $(VENV)/build.log; exit 1)
	grep -h -m1 -o "clipshard: building.*" $(VENV)/build.log || true
	$(PY) -c "import clipshard"
	touch $@

run: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) examples/train_clip.py $(if $(OUT),--out $(OUT),)

test: setup
	$(PY) -m pytest -q tests

# The integration tests against the oldest supported transformers (4.50) and open_clip (2.26) and
# against transformers 4.57, each in a small venv under .venv-matrix that reuses .venv's torch
# (.ci/test_matrix.sh; docs/transformers.md, docs/open_clip.md). `make test` runs the default versions.
test-matrix: setup
	PY=$(PY) bash .ci/test_matrix.sh

clean:
	rm -rf build *.egg-info clipshard/*.so $(VENV)/.built-* .venv-matrix
