# Two commands for a new user: `make demo` and `make test`. Both install what they need into
# .venv in the checkout. The CPU torch wheel is pinned here (it lies on this project's machines'
# disks); pyproject keeps a wide range so users keep their own CUDA build.
VENV    ?= .venv
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
# GPU machines carry their own torch and take no downloads: test-gpu runs on the system python.
GPU_PY  ?= python3
# The optional extras' tests (TRL, diffusers) run in `make test` too. timm needs torchvision, whose
# PyPI wheels for Linux are CUDA builds that the CPU torch cannot load: name an index holding the
# torchvision of this torch to add the `vision` extra (timm's tests), e.g.
# `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`; without one they are skipped.
TORCH_INDEX ?=
COMMA   := ,
EXTRAS  := test,hf,trl,diffusion$(if $(TORCH_INDEX),$(COMMA)vision)

# The extras install against a constraint on the torch just installed, so none of them replaces it.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip freeze | grep -i '^torch==' > $(VENV)/torch-pin.txt
	$(PY) -m pip install -q -c $(VENV)/torch-pin.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		-e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

# The parity-critical tests run a second time on the asynchronous stand-in for the GPU's copy
# streams (copies land later, poisoned until then and when freed, checked: see
# tierzero/placement/storage/stand_in.py), under a seed of random copy delays: what a GPU would
# reorder is exercised on every machine. One seed keeps `make test` within 15 minutes on 2 cores;
# `make test-async DELAY_SEEDS="1 2 3"` runs more.
ASYNC_TESTS := tests/runtime/test_parity.py tests/runtime/test_split.py tests/runtime/test_zero_stages.py \
	tests/runtime/test_step_queue.py tests/runtime/test_activations.py tests/runtime/test_accumulate.py::test_gpt \
	tests/runtime/test_gather_agreement.py \
	tests/checkpoint/test_checkpoint.py tests/checkpoint/test_checkpoint_ranks.py \
	tests/checkpoint/test_checkpoint_kill.py::test_sigterm_saves_at_the_step_boundary_and_resume_is_exact \
	tests/placement/test_cow_home.py tests/hf/test_hf_trainer.py tests/formats/test_weights.py
DELAY_SEEDS ?= 1

# Two pytest workers (pytest-xdist), a test file each at a time: most tests wait on subprocesses,
# files and ranks' collectives as much as they compute, so two keep a 2-core machine busy. Each
# worker's torch takes one thread (two workers of two threads would spin against each other);
# a test compares tierzero with plain PyTorch in its own process, at the same thread count.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: install test test-async test-gpu demo bench-io clean

test: $(STAMP)
	$(PYTEST) --durations=20 -m "not gpu" tests
	$(MAKE) --no-print-directory test-async

test-async: $(STAMP)
	for seed in $(DELAY_SEEDS); do \
		TIERZERO_STREAMS=async TIERZERO_POISON=1 TIERZERO_DELAY_SEED=$$seed \
			$(PYTEST) -m "not gpu" $(ASYNC_TESTS) || exit 1; \
	done

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
