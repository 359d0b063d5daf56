"""Datasets made from a fixture target for tests and benchmarks, without a server: synth datasets of its
greedy transformers answers, and hidden datasets made from them by the real stage 02 (hf backend, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eyas_common.chat import ChatTokens, load_tokenizer, render_completion, render_prompt, target_fingerprint
from eyas_common.contract import Dataset
from eyas_common.samples import new_sample, write_dataset
from eyas_extract.run import run as extract
from eyas_testing.fixture import fixture_prompts


@torch.no_grad()
def generate_samples(model_dir: Path, n: int, seed: int, split: str = "train", max_new_tokens: int = 256,
                     batch: int = 32, prompts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Synth-format samples: a ChatML target's greedy answers (HF, fp32) to `prompts` (default: `n` fixture
    prompts). A target without a `</think>` token answers without thinking."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    thinking = "</think>" in tok.get_vocab()
    pad = eot if tok.pad_token_id is None else tok.pad_token_id
    prompts = fixture_prompts(n, seed, split) if prompts is None else prompts[:n]
    out = []
    for i0 in range(0, n, batch):
        chunk = prompts[i0:i0 + batch]
        ids = [render_prompt(tok, p["messages"]) for p in chunk]
        width = max(map(len, ids))
        # Left padding so that every row generates from its own last prompt token.
        x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        att = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        gen = model.generate(x, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eot, pad_token_id=pad)[:, width:].tolist()
        for j, (p, prompt, completion) in enumerate(zip(chunk, ids, gen)):
            finished = eot in completion
            completion = completion[:completion.index(eot) + 1] if finished else completion
            text = tok.decode(completion, skip_special_tokens=False)
            reasoning, _, content = text.partition("</think>") if thinking else ("", "", text)
            out.append(new_sample(id=i0 + j, prompt_index=i0 + j, messages=p["messages"], thinking=thinking,
                                  reasoning=reasoning, content=content.replace("<|im_end|>", ""), prompt_ids=prompt,
                                  completion_ids=completion, finish_reason="stop" if finished else "length",
                                  source="server"))
    return out


def write_synth(root: Path, name: str, samples: list[dict[str, Any]], model_dir: Path) -> Dataset:
    return write_dataset(Dataset.parse(name, "synth", root), samples, stage="test",
                         target=target_fingerprint(load_tokenizer(model_dir), model_dir),
                         params={"temperature": 0.0, "generator": "hf-greedy"})


def extract_hidden(root: Path, name: str, synth: Dataset, model_dir: Path, *, teacher: str = "final", topk: int = 8,
                   aux_dtype: str = "bf16", per_shard: int = 64) -> Dataset:
    """The hidden dataset made by the real stage 02 (hf backend, CPU) from `synth`."""
    extract(synth=synth.ref, model=model_dir, name=name, teacher=teacher, topk=topk, aux_dtype=aux_dtype,
            shard_samples=per_shard, data_root=root, progress=False)
    return Dataset.parse(name, "hidden", root)


def build_datasets(root: Path, model_dir: Path, n: int, seed: int = 0, **extract: Any) -> Dataset:
    """synth/fixture_N + hidden/fixture_N under `root`, made once (reused when already complete)."""
    name = f"fixture_{n}_{seed}" + "".join(f"_{v}" for v in extract.values())
    hidden = Dataset.parse(name, "hidden", root)
    if hidden.exists() and hidden.read_manifest()["status"] == "complete":
        return hidden
    synth = Dataset.parse(f"fixture_{n}_{seed}", "synth", root)
    if not (synth.exists() and synth.read_manifest()["status"] == "complete"):
        synth = write_synth(root, synth.name, generate_samples(model_dir, n, seed), model_dir)
    return extract_hidden(root, name, synth, model_dir, **extract)


def make_synth(root: Path, target: Path, name: str = "fx", n: int = 12, seed: int = 5, max_new_tokens: int = 40
               ) -> Dataset:
    """A complete synth dataset from HF greedy answers of the fixture, rendered as eyas-synth renders text."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(target)
    chat = ChatTokens.of(tok)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    convs = [p["messages"] for p in fixture_prompts(n, seed)]
    prompts = [render_prompt(tok, m) for m in convs]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=(ids != tok.pad_token_id).long(), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=chat.end_of_turn, pad_token_id=tok.pad_token_id)
    samples = []
    for i, (conv, prompt) in enumerate(zip(convs, prompts, strict=True)):
        gen = out[i, width:].tolist()
        ended = chat.end_of_turn in gen
        gen = gen[: gen.index(chat.end_of_turn)] if ended else gen
        close = gen.index(chat.think_close) if chat.think_close in gen else len(gen)
        reasoning, content = tok.decode(gen[:close]), tok.decode(gen[close + 1:])
        samples.append(new_sample(id=i, prompt_index=i, messages=conv, thinking=True, reasoning=reasoning,
                                  content=content, prompt_ids=prompt,
                                  completion_ids=render_completion(tok, prompt, reasoning, content, finished=ended),
                                  finish_reason="stop" if ended else "length", source="rendered"))
    ds = Dataset.parse(name, "synth", root)
    if ds.path.exists():
        raise FileExistsError(f"{ds.path} exists: make_synth writes a new dataset")
    return write_dataset(ds, samples, stage="01_synth", target=target_fingerprint(tok, target),
                         params={"made_by": "eyas_testing.datasets: HF greedy, rendered"})
