# `make test` is the project's one test command: it creates or updates .venv, installs
# CPU torch and the package with its test extras, lints, and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
# The CPU build lies on these machines' disk; never let pip pull a CUDA torch here.
TORCH_SPEC ?= torch==2.13.0
# The SGLang release the GPU engine wrapper targets; its wheel is downloaded (not
# installed: its CUDA kernels do not install here) for the source contract test.
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_WHEEL_DIR := $(VENV)/sglang-wheel
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dapo-installed

.PHONY: test test-gpu test-slurm-extended lint install clean demo demo-moe demo-tools

test: $(STAMP)
	$(PY) -m ruff check dapo_megatron tests benchmarks tools examples
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && timeout 300 apt-get install -y -q chromium >/dev/null 2>&1; } || \
	  echo "make test: no Chromium, and it could not be installed here: the report's browser test will skip"
	$(PY) -m pytest -q

# The checks a machine with a GPU runs (all of tests/gpu, ~10 minutes on one H200; each
# skips with its reason where its part is missing: SGLang, Transformer Engine). Run with
# a Python that has torch with CUDA, megatron-core and this package's dependencies.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests/gpu

# The real one-node SLURM tier with the cases kept out of `make test`'s 15 minutes
# (a preemption under proctrack/linuxproc, whose Ray dies with the SIGTERM).
test-slurm-extended: $(STAMP)
	DAPO_TEST_SLURM_EXTENDED=1 $(PY) -m pytest -q tests/slurm

lint: $(STAMP)
	$(PY) -m ruff check dapo_megatron tests benchmarks tools examples
	$(PY) -m ruff format --check dapo_megatron tests benchmarks tools examples

install: $(STAMP)

# The embedded demo: a tiny Qwen2 learns single-digit addition with DAPO on the CPU,
# through the real system (Ray, two Megatron ranks, the transformers engine). Each run
# gets its own folder under runs/demo; `tensorboard --logdir runs/demo` shows them all.
DEMO_RUN ?= runs/demo/run-$(shell date +%Y%m%d-%H%M%S)
demo: $(STAMP)
	$(PY) examples/demo/prepare.py runs/demo
	$(VENV)/bin/dapo-megatron train examples/demo/demo.yaml trainer.output_dir=$(DEMO_RUN)

# The same task on a tiny Qwen3-MoE, its experts split over the two ranks (ep 2).
DEMO_MOE_RUN ?= runs/demo_moe/run-$(shell date +%Y%m%d-%H%M%S)
demo-moe: $(STAMP)
	$(PY) examples/demo/prepare.py runs/demo_moe --model-config examples/demo/model_config_moe.json
	$(VENV)/bin/dapo-megatron train examples/demo/demo_moe.yaml trainer.output_dir=$(DEMO_MOE_RUN)

# Multi-turn: a tiny Qwen2 learns to call a calculator for three-digit multiplication
# (rollout.env=calculator), then the same training without the tool (rollout.env=null;
# no sample is ever right, so dynamic sampling, which would stop at once, is off).
DEMO_TOOLS_RUN ?= runs/demo_tools/run-$(shell date +%Y%m%d-%H%M%S)
demo-tools: $(STAMP)
	$(PY) examples/demo/prepare_tools.py runs/demo_tools
	$(VENV)/bin/dapo-megatron train examples/demo/demo_tools.yaml trainer.output_dir=$(DEMO_TOOLS_RUN)
	$(VENV)/bin/dapo-megatron train examples/demo/demo_tools.yaml trainer.output_dir=$(DEMO_TOOLS_RUN)-without-tool \
		rollout.env=null algorithm.dynamic_sampling=false

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip download -q --no-deps -d $(SGLANG_WHEEL_DIR) "$(SGLANG_SPEC)"
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
