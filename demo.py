"""make demo: the pipeline end to end on the tiny fixture target, on CPU, with real vLLM.

fixture target -> vLLM server -> 01 synth -> validate -> 02 extract -> 03 train -> eval in vLLM.
Data goes to $EYAS_DATA (make demo sets ./data/demo); rerunning resumes every stage.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from eyas_common.fixture import build_fixture, write_prompts_jsonl
from eyas_common.servers import running_vllm
from eyas_synth.run import run as synth
from eyas_synth.validate import validate
from eyas_extract.run import run as extract
from eyas_train.eval import evaluate
from eyas_train.train import run as train

ROOT = Path(__file__).parent
N_SAMPLES = int(os.environ.get("DEMO_N", "256"))


def step(msg: str) -> None:
    print(f"\n=== {msg}", file=sys.stderr, flush=True)


def main() -> None:
    t0 = time.monotonic()
    data = Path(os.environ.get("EYAS_DATA", ROOT / "data" / "demo"))
    data.mkdir(parents=True, exist_ok=True)

    step("fixture: tiny thinking target (cached after the first build)")
    target = build_fixture()
    prompts = write_prompts_jsonl(data / "prompts.jsonl", N_SAMPLES, seed=0, split="train")

    step("vLLM: serving the target on 127.0.0.1 (start-up takes a minute or two on CPU)")
    with running_vllm(target, log_path=data / "vllm.log", timeout_s=600,
                      extra_args=["--reasoning-parser", "kimi_k2"]) as server:
        step(f"01 synth: {N_SAMPLES} samples")
        synth(prompts=prompts, name="demo", model=target, servers=[server.url], n=N_SAMPLES,
              max_tokens=256, temperature=0.0, concurrency=32)

    step("01 validate")
    report = validate("demo", model=target)
    print(f"{report['samples']} samples, {len(report['bad'])} unsound", file=sys.stderr)
    if report["bad"]:
        raise SystemExit(f"validation failed: {report['bad'][:3]}")

    step("02 extract: aux hidden states (layers 2, L//2, L-3) + final state, hf backend")
    extract(synth="synth/demo", model=target, name="demo")

    step("03 train: EAGLE-3 draft with 7 TTT steps, the default recipe resolved from the data (minutes on CPU)")
    draft = train(hidden="hidden/demo", model=target, name="demo", log_every=100, ckpt_every=500)

    step("03 eval: chain speculative decoding, greedy verification, 3 draft tokens, 10 held-out prompts")
    heldout = write_prompts_jsonl(data / "heldout.jsonl", 10, seed=11)
    report = evaluate(draft="drafts/demo", model=target, prompts=heldout, spec_tokens=3)
    print(f"acceptance length {report['acceptance_length']:.2f}; draft in {draft} (vLLM: --speculative-config "
          f"'{{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}}')",
          file=sys.stderr)

    step(f"done in {time.monotonic() - t0:.0f} s; datasets under {data} (eyas-data list)")


if __name__ == "__main__":
    main()
