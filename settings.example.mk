# Copy to settings.mk (git-ignored) and edit: the Makefile reads it, so `make synth N=10000` needs no other
# argument. The command line and the environment override these (`?=`); `make settings` shows what is in
# force and where each value came from.

# the target: a local copy on every host that runs a stage (its tokenizer is the reference)
MODEL    ?= /models/Kimi-K2.5
# the served target (vLLM or SGLang), one or more URLs, for synth (bench-serve takes its SERVER= from its
# command line only)
SERVER   ?= http://gpu-box-1:8000 http://gpu-box-2:8000
PROMPTS  ?= /data/prompts/prompts.jsonl
NAME     ?= synth_10k

# where images go, and where stages run (HOST= for one stage at a time, HOSTS= for training across hosts)
REGISTRY ?= registry.example.com:5000/eyas
VARIANT  ?= cu128
# RUNNER ?= docker
# HOST   ?= ubuntu@gpu-box-1
# HOSTS  ?= ubuntu@gpu-box-1 ubuntu@gpu-box-2
# SSH_ARGS ?= -i ~/.ssh/gpu_boxes

# the data volume on every host (mounted at /data in the containers)
DATA     ?= /data/eagle3
GPUS     ?= all
# NCCL_P2P_DISABLE ?= 1   # multi-GPU Blackwell workstations that hang on P2P all-reduce
