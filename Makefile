# megalite: make install | pretrain | test | test-gpu | test-multinode | fuzz | chaos | bench | lint | clean
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# make test runs its files on TEST_WORKERS pytest-xdist workers (a file's tests stay on one
# worker, with its module fixtures and rank pools): much of the suite waits on process
# starts, rendezvous and timeouts, so two workers on two cores finish in about 0.8x the time
TEST_WORKERS ?= 2
PYTEST_ARGS ?= -q -m "not slow and not gpu and not multinode" --durations=15 \
	-n $(TEST_WORKERS) --dist loadfile

.PHONY: install pretrain test test-gpu test-multinode test-all fuzz chaos bench lint clean

install: $(STAMP)

# Re-runs only when setup.py changes; the torch check guards against a CUDA build sneaking in.
$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), f'torch {v} installed; megalite pins 2.13.0'; print('torch', v)"
	touch $(STAMP)

# Train, then plot the run and print sampled continuations of a KJV prompt.
PRETRAIN_OUT ?= runs/pretrain_tiny_cpu
pretrain: install
	OUT=$(PRETRAIN_OUT) bash scripts/pretrain_tiny_cpu.sh
	$(PY) tools/plot_run.py $(PRETRAIN_OUT) --output $(PRETRAIN_OUT)/run.png
	$(PY) tools/generate.py --load $(PRETRAIN_OUT)/checkpoints --prompt "And God said" \
		--num-samples 3 --max-new-tokens 40 --temperature 0.8 --top-p 0.9 --seed 1

test: install
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The tests that need CUDA (pytest marker `gpu`, in tests/gpu): bf16 on CUDA against CPU fp32,
# attention backends against local, exact resume and async save on CUDA, --compile against
# eager. Without a GPU each is skipped with the reason (-rs prints it).
test-gpu: install
	$(PY) -m pytest -q -rs -m gpu --durations=15 tests

# The launch script across emulated hosts (tests/multinode: network namespaces joined by a
# bridge; needs root and iproute2, skipped with the reason elsewhere): the curve across
# hosts, a lost node replaced (also rank 0's, with the rendezvous on a third host), an
# elastic job shrinking to the node left, the loopback host name. `make test` runs the
# short part (the curve, the loopback case). Timings: runs/multinode_timings.json.
test-multinode: install
	$(PY) -m pytest -q -s -rs --durations=10 tests/multinode

test-all: install
	$(PY) -m pytest -q tests

# The layout fuzzer (tests/fuzz): N random layouts against the single-process run, seeds
# MEGALITE_FUZZ_BASE .. +N-1 (printed; default: from the clock). MEGALITE_FUZZ_SEED=s
# reruns exactly the draw of seed s.
N ?= 20
fuzz: install
	@base=$${MEGALITE_FUZZ_BASE:-$$(date +%s)}; \
	if [ -n "$$MEGALITE_FUZZ_SEED" ]; then echo "fuzz: the draw of seed $$MEGALITE_FUZZ_SEED"; \
	else echo "fuzz: $(N) draws, seeds $$base..$$((base + $(N) - 1)) (MEGALITE_FUZZ_BASE=$$base)"; fi; \
	MEGALITE_FUZZ_BASE=$$base MEGALITE_FUZZ_N=$(N) $(PY) -m pytest -v -s \
		--durations=5 tests/fuzz/test_layout_fuzz.py

# Fault injection (tools/chaos.py): KILLS random SIGKILLs of torchrun workers during a run;
# the restarted job must finish on the undisturbed run's curve, bit for bit.
KILLS ?= 10
chaos: install
	$(PY) tools/chaos.py --kills $(KILLS) $(if $(SEED),--seed $(SEED))

bench: install
	$(PY) tools/benchmark.py all

lint: install
	$(PY) -m ruff check megalite tests tools pretrain

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache data/cache runs checkpoints
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
