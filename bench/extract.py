"""Stage 02 bench: extraction tokens/s over a bare `model(input_ids)` forward, and bytes per token.

Both are measured in this one process, over the same shards and the same padded batches, alternating
`--reps` times (best of each kept: the machine may be shared). Prints:
  throughput ratio = extraction tokens/s (hooks, encode, shard writes) / bare forward tokens/s   goal >= 0.95
  bytes ratio      = shard bytes per token / (4 * H * 2), the bf16 layout of 3 aux states + final
                     for the default layout, and for --teacher topk --aux-dtype fp8              goal <= 0.5
  disk write       bytes/s of an fsync'd 1 GiB write in the data folder, and the tokens/s ceiling it sets
                   at each layout's bytes per token (where the ratio falls short on a GPU, this says why)
The target is the tiny trained fixture (8 layers, H 128, CPU), or with --big a random-init Llama of
24 layers, H 1024 in bf16 for a GPU (bench/gpu.sh). The synth dataset is made here: fixture
prompts followed by random completion tokens, lengths uniform in [--min-len, --max-len].

    .venv/bin/python bench/extract.py [--samples 96] [--batch-tokens 4096] [--reps 3] [--big]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas_common.chat import ChatTokens, load_tokenizer, render_prompt, target_fingerprint
from eyas_common.contract import Dataset
from eyas_testing.fixture import build_fixture, fixture_prompts
from eyas_common.paths import cache_root
from eyas_common.samples import SAMPLES, index_samples, new_sample, read_tokens, write_dataset
from eyas_extract.batching import make_batches, plan_shards
from eyas_extract.capture import find_parts
from eyas_extract.config import ExtractConfig
from eyas_extract.hf_backend import load_target, pad_batch, pick_device
from eyas_extract.run import run as extract

BIG = {"num_hidden_layers": 24, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
       "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096}


def big_target(fixture: Path) -> Path:
    """A random-init 24-layer H-1024 Llama with the fixture's tokenizer (cached): only its speed matters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    key = hashlib.sha256(json.dumps(BIG, sort_keys=True).encode() + fixture.name.encode()).hexdigest()[:12]
    out = cache_root() / "bench" / f"llama-big-{key}"
    if not out.is_dir():
        tok = load_tokenizer(fixture)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, dtype="bfloat16", **BIG))
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(tmp)
        for f in fixture.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, tmp / f.name)
        tmp.rename(out)
    return out


def make_synth(root: Path, target: Path, n: int, lo: int, hi: int, seed: int = 0) -> str:
    tok = load_tokenizer(target)
    eot = ChatTokens.of(tok).end_of_turn
    rng = random.Random(seed)

    def samples():
        for i, p in enumerate(fixture_prompts(n, seed)):
            prompt = render_prompt(tok, p["messages"])
            k = max(2, rng.randint(lo, hi) - len(prompt))
            completion = [rng.randrange(16, len(tok)) for _ in range(k - 1)] + [eot]
            yield new_sample(id=i, prompt_index=i, messages=p["messages"], thinking=True, reasoning=None, content="",
                             prompt_ids=prompt, completion_ids=completion, finish_reason="stop", source="rendered")

    ds = write_dataset(Dataset.parse("bench", "synth", root), samples(), stage="bench",
                       target=target_fingerprint(tok, target),
                       params={"bench": "fixture prompts + random completions", "n": n, "lengths": [lo, hi]})
    return ds.ref


def bare_forward(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device, real_tokens: int) -> float:
    """tokens/s of model(input_ids) over the padded batches (counting the real tokens, as extraction does).

    Pass the decoder stack instead of the CausalLM to time the forward without lm_head.
    """
    with torch.inference_mode():
        model(batches[0][:1, :8].to(device))  # warm-up, as the hf backend does when it loads
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids in batches:
            model(ids.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return real_tokens / (time.perf_counter() - t0)


def disk_write_speed(folder: Path, nbytes: int) -> float:
    """Bytes/s of writing `nbytes` to a new file in `folder` and fsyncing it, as a shard is committed: the
    ceiling of extraction's tokens/s is this over its bytes per token (on a fast GPU the disk, not the
    forward, can be what extraction waits on)."""
    chunk = memoryview(os.urandom(64 << 20))  # incompressible, as hidden states are
    path = folder / "disk-probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for done in range(0, nbytes, len(chunk)):
            f.write(chunk[:min(len(chunk), nbytes - done)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return nbytes / seconds


@dataclass
class Measured:
    """What one bench run measured: the extraction runs' and the bare forwards' tokens/s, and the layouts."""

    cfg: ExtractConfig                      # the default-layout extraction, as its manifest records it
    shards: int
    batches: int
    real: int                               # tokens, without padding
    padded: int                             # tokens, with padding
    bare: list[float] = field(default_factory=list)      # model(input_ids), tokens/s per rep
    body: list[float] = field(default_factory=list)      # the decoder stack alone (no lm_head)
    ext: list[float] = field(default_factory=list)       # extraction, default layout (bf16 aux + final)
    small_tps: list[float] = field(default_factory=list)  # extraction, topk + fp8
    vllm_tps: float | None = None           # the vllm backend, one run, where this Python has vLLM
    bpt: float = 0.0                        # bytes per token, default layout
    bpt_small: float = 0.0                  # bytes per token, topk + fp8
    disk: list[float] = field(default_factory=list)      # bytes/s of an fsync'd write in the data folder


def padded_batches(root: Path, cfg: ExtractConfig) -> tuple[list[list], list[torch.Tensor], int]:
    """The shards and padded batches extraction made from synth/bench, and their real tokens."""
    samples_path = root / "synth" / "bench" / SAMPLES
    plan = plan_shards(index_samples(samples_path, cfg.vocab_size), cfg.shard_samples, cfg.shard_tokens)
    batches = []
    for refs in plan:
        seqs = [s for s, _ in read_tokens(samples_path, refs)]
        for batch in make_batches([len(s) for s in seqs], cfg.batch_tokens):
            batches.append(pad_batch([seqs[k] for k in batch])[0])
    return plan, batches, sum(r.n_tokens for refs in plan for r in refs)


def measure(root: Path, target: Path, device: torch.device, args: argparse.Namespace) -> Measured:
    """Extract `--reps` times in both layouts, alternating with bare forwards over the same padded batches."""
    synth = make_synth(root, target, args.samples, args.min_len, args.max_len)
    common = dict(synth=synth, model=target, data_root=root, batch_tokens=args.batch_tokens,
                  shard_samples=args.shard_samples, device=str(device), progress=False)
    first = extract(name="x0", **common)
    cfg = ExtractConfig(**Dataset.parse("hidden/x0", root=root).read_manifest()["params"])
    plan, batches, real = padded_batches(root, cfg)
    m = Measured(cfg, len(plan), len(batches), real, sum(b.numel() for b in batches), ext=[first["tokens_per_s"]])
    model = load_target(cfg, device)
    decoder = find_parts(model, cfg.num_layers, cfg.hidden_size).base
    for rep in range(args.reps):
        m.bare.append(bare_forward(model, batches, device, real))
        m.body.append(bare_forward(decoder, batches, device, real))
        if rep:
            m.ext.append(extract(name=f"x{rep}", **common)["tokens_per_s"])
        small = extract(name=f"topk-fp8-{rep}", teacher="topk", topk=args.topk, aux_dtype="fp8", **common)
        m.small_tps.append(small["tokens_per_s"])
        m.disk.append(disk_write_speed(root, min(1 << 30, int(small["dataset"]["bytes_per_token"] * real))))
    del model, decoder
    if importlib.util.find_spec("vllm") is not None:  # the vllm backend too, where this Python has it
        if device.type == "cuda":
            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free now
        m.vllm_tps = extract(name="vllm", backend="vllm", **common)["tokens_per_s"]
    m.bpt, m.bpt_small = first["dataset"]["bytes_per_token"], small["dataset"]["bytes_per_token"]
    return m


def report(m: Measured, target: Path, device: torch.device, args: argparse.Namespace) -> None:
    cfg, unit = m.cfg, 4 * m.cfg.hidden_size * 2
    print(f"target: {target.name} ({cfg.num_layers} layers, H {cfg.hidden_size}, V {cfg.vocab_size}), {device}, "
          f"{cfg.dtype}, attn {cfg.attn}, {torch.get_num_threads()} thread(s)")
    print(f"data: {args.samples} samples, {m.real:,} tokens ({1 - m.real / m.padded:.1%} padding) in {m.batches} "
          f"batches of <= {cfg.batch_tokens} tokens, {m.shards} shards; aux layers {cfg.layers}")
    for label, runs in (("bare model(input_ids):", m.bare), ("extraction (bf16):", m.ext),
                        ("extraction (topk+fp8):", m.small_tps), ("decoder only (no head):", m.body)):
        print(f"{label:23s} {max(runs):>10,.0f} tokens/s   (runs: {', '.join(f'{x:,.0f}' for x in runs)})")
    if m.vllm_tps is not None:
        print(f"{'extraction (vllm)':23s} {m.vllm_tps:>10,.0f} tokens/s   (one run; ratio to bare "
              f"{m.vllm_tps / max(m.bare):.3f})")
    print(f"throughput ratio:       {max(m.ext) / max(m.bare):10.3f}          (goal >= 0.95; topk+fp8 "
          f"{max(m.small_tps) / max(m.bare):.3f}; bf16 vs the decoder alone {max(m.ext) / max(m.body):.3f})")
    disk = max(m.disk)
    print(f"disk write (fsync'd):   {disk / 1e9:10.2f} GB/s   = a ceiling of {disk / m.bpt:,.0f} tokens/s bf16 "
          f"(extraction at {max(m.ext) * m.bpt / disk:.0%} of it), {disk / m.bpt_small:,.0f} topk+fp8 "
          f"({max(m.small_tps) * m.bpt_small / disk:.0%})")
    print(f"bytes/token bf16+final: {m.bpt:10,.1f} = {m.bpt / unit:.3f} x 4*H*2 ({unit:,} B)")
    print(f"bytes/token topk{args.topk}+fp8: {m.bpt_small:10,.1f} = {m.bpt_small / unit:.3f} x 4*H*2   (goal <= 0.5)")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--min-len", type=int, default=64, help="shortest sample, tokens")
    ap.add_argument("--max-len", type=int, default=512, help="longest sample, tokens")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per forward")
    ap.add_argument("--shard-samples", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions; the best of each side is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 suits a small shared CPU)")
    ap.add_argument("--topk", type=int, default=8, help="K of the topk+fp8 layout")
    ap.add_argument("--big", action="store_true", help="24 layers, H 1024, bf16: for a GPU (bench/gpu.sh)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    target = build_fixture()
    torch.set_num_threads(args.threads)  # after the fixture, whose build sets its own
    if args.big:
        target = big_target(target)
    device = pick_device(args.device)
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-extract-"))
    try:
        measured = measure(root, target, device, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(measured, target, device, args)


if __name__ == "__main__":
    main()
