#!/usr/bin/env bash
# Stage 02 GPU check, for a lent GPU machine: throughput and bytes ratios on a 24-layer, H-1024 bf16
# Llama (random init, the fixture's tokenizer), plus the hf-vs-vllm agreement test when vLLM is there.
#
# On the GPU machine:
#   1. install: python3 -m pip install torch transformers tokenizers safetensors tqdm click (CUDA torch);
#      the eyas packages are used straight from this checkout (PYTHONPATH below), nothing else to install
#   2. copy over: this checkout, and the built fixture `.cache/fixtures` (~9 MB) so it is not retrained,
#      e.g. rsync -a --exclude .venv --exclude data ./ gpu-host:eyas/
#   3. run: cd eyas && bash bench/extract_gpu.sh   (about 8 minutes; extra options go to bench/extract.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/common:$PWD/stages/02_extract${PYTHONPATH:+:$PYTHONPATH}" EYAS_CACHE="$PWD/.cache"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__)"
# 2,000 samples of 256..2048 tokens (about 2.3 M tokens), 64k-token batches: long enough to time.
"$PYTHON" bench/extract.py --big --samples 2000 --min-len 256 --max-len 2048 --batch-tokens 65536 \
    --shard-samples 256 --reps 3 "$@"
if "$PYTHON" -c "import vllm" 2>/dev/null; then
    EYAS_VLLM_PYTHON="$(command -v "$PYTHON")" "$PYTHON" -m pytest tests/test_extract.py -q -m vllm -p no:cacheprovider || true
fi
