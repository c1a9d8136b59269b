# Two commands for a new user: `make demo` and `make test`. Both install what they need into
# .venv in the checkout. The CPU torch wheel is pinned here (it lies on this project's machines'
# disks); pyproject keeps a wide range so users keep their own CUDA build.
VENV    ?= .venv
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
# GPU machines carry their own torch and take no downloads: test-gpu runs on the system python.
GPU_PY  ?= python3

.PHONY: install test test-gpu demo bench-io clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" tests

test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -m gpu tests

# The main job, small: a GPT whose training state (12.9 MiB) is larger than its device + host
# budgets (4 + 8 MiB), so NVMe holds most of it; ~15 s of training here.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/tierzero train --model tiny --steps 100 --batch 8 --seq 128 \
		--device-budget 4MiB --host-budget 8MiB --nvme-dir runs/demo/nvme --run-dir runs/demo
	@echo "run folder: runs/demo (metrics.jsonl, trace.json, tiers.png, summary.json)"

bench-io: $(STAMP)
	$(VENV)/bin/tierzero bench-io --dir runs/bench-io --size 1GiB

clean:
	rm -rf $(VENV) runs .pytest_cache
