# Two user-facing targets: `make demo` and `make test`. Both set up .venv first (idempotent).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# DATA: digits (the default: scikit-learn's real handwritten digits, datasets/digits, with their data
# preset and budget), synthetic (the drawn shapes, datasets/synthetic; PRESET small or tiny), or a
# data folder. The default is the data that shows the gain most clearly in the same time (docs/demo.md).
DATA ?= $(if $(filter small tiny,$(PRESET)),synthetic,digits)
ifeq ($(DATA),digits)
override PRESET := digits
else
PRESET ?= small
endif
DATA_DIR := $(if $(filter synthetic digits,$(DATA)),datasets/$(if $(filter digits,$(PRESET)),digits,synthetic),$(DATA))
SEED ?= 0
RECIPE ?= tiny_simclr

.PHONY: setup demo test test-fast test-sweep test-capabilities lint clean-data

setup: $(STAMP)

# Re-run only when the dependency declarations or the setup scripts change.
$(STAMP): pyproject.toml tools/setup_env.sh tools/install_detectron2_pypi.py
	bash tools/setup_env.sh
	touch $@

# The whole pipeline on data it generates (tools/demo.py): pretrain the tiny RECIPE, then kNN,
# VOC07 SVM, linear probe and FPN fine-tune against a random-init backbone; the digits' report is
# outputs/demo_digits/report.md (DATA=synthetic: outputs/demo/report.md).
demo: setup
	$(PY) tools/demo.py --data $(DATA_DIR) --preset $(PRESET) --seed $(SEED) --recipe $(RECIPE) $(if $(FRESH),--fresh)

# One thread per torch process keeps multi-process tests from oversubscribing the 2 CI cores; two
# pytest-xdist workers use both (TEST_WORKERS=0: one process). With --dist loadfile, tests/conftest.py
# schedules whole modules, the costliest first, and keeps the users of the brief pretraining on one
# worker: module fixtures (the multi-process runs, the detection trainings) are built once.
TEST_WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -m "not sweep" $(PARALLEL)

# The suite without the tests marked `slow` (brief pretraining, detection training, the demo).
test-fast: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -m "not slow and not sweep" $(PARALLEL)

# Every hostile mutant through every command line that reads its kind (tests/test_hostile_files.py);
# `make test` runs a seeded sample of them (HOSTILE_SEED, HOSTILE_SAMPLE choose it).
# Case by case over the workers (not whole modules: nearly all of it is one module).
test-sweep: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -m sweep -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

# The fast suite with PyTorch's other CPU kernels (ATEN_CPU_CAPABILITY): what another x86 CPU would
# run. CI runs CAPABILITIES=default after `make test`; `make test-capabilities` alone runs all three.
CAPABILITIES ?= default avx2 avx512
test-capabilities: setup
	@for c in $(CAPABILITIES); do \
	  echo "==> ATEN_CPU_CAPABILITY=$$c"; \
	  ATEN_CPU_CAPABILITY=$$c OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -m "not slow and not sweep" -q $(PARALLEL) || exit 1; \
	done

# ruff (lint, import order, format) on the whole tree, mypy on the converters, the methods, the losses and the CLI helpers.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean-data:
	rm -rf $(DATA_DIR)
