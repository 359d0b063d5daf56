"""The tiny thinking target: tokenizer, Kimi-style chat template, trained behaviour, cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas_testing import fixture as fx


@pytest.fixture(scope="module")
def tok(fixture_target: Path):
    return AutoTokenizer.from_pretrained(fixture_target)


@pytest.fixture(scope="module")
def model(fixture_target: Path):
    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(fixture_target).eval()


def test_tokenizer_files_readable_by_older_transformers(fixture_target: Path) -> None:
    cfg = json.loads((fixture_target / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    gen = json.loads((fixture_target / "generation_config.json").read_text())
    model_cfg = json.loads((fixture_target / "config.json").read_text())
    assert gen["eos_token_id"] == model_cfg["eos_token_id"]
    assert model_cfg["architectures"] == ["LlamaForCausalLM"]
    assert model_cfg["num_hidden_layers"] >= 8 and model_cfg["head_dim"] == 32
    assert model_cfg["tie_word_embeddings"] is False


@pytest.mark.parametrize(
    "text",
    [
        "What is 347+38?",
        "  leading and trailing spaces  \n\n\ttabs\r\n",
        "unicode: naïve café 東京 🙂 — done",
        "<|im_user|>user<|im_middle|>hi<|im_end|><think>a</think>b",
        "",
    ],
)
def test_tokenizer_round_trips(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids  # no BOS or EOS added behind the caller's back


def test_special_tokens(tok) -> None:
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "[PAD]" and tok.bos_token == "[BOS]"
    for t in (fx.SYSTEM, fx.USER, fx.ASSISTANT, fx.MIDDLE, fx.END, fx.THINK, fx.UNTHINK, fx.PAD, fx.BOS):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    # The thinking wrappers survive skip_special_tokens (vLLM decodes that way); turn markers do not.
    ids = tok.encode("<think>x</think>y<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>y"


SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "4", "reasoning_content": "2+2=4."}
U2 = {"role": "user", "content": "And 3+3?"}


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_template_generation_prompt(tok) -> None:
    assert render(tok, [U1], add_generation_prompt=True) == (
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    assert render(tok, [U1], add_generation_prompt=True, thinking=False) == (
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
    )
    assert render(tok, [U1], add_generation_prompt=True, thinking=True).endswith("<|im_middle|><think>")


def test_template_system_and_past_turn(tok) -> None:
    assert render(tok, [SYS, U1, A1, U2], add_generation_prompt=True) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"  # earlier reasoning dropped
        "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_template_final_assistant_keeps_reasoning(tok) -> None:
    for key in ("reasoning_content", "reasoning"):
        final = {"role": "assistant", "content": "6", key: "3+3=6."}
        assert render(tok, [U1, A1, U2, final]).endswith(
            "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><think>3+3=6.</think>6<|im_end|>"
        )
    no_reasoning = {"role": "assistant", "content": "6"}
    assert render(tok, [U2, no_reasoning]).endswith("<|im_middle|><think></think>6<|im_end|>")
    assert not render(tok, [U1]).startswith("[BOS]")


def test_template_prompt_is_prefix_of_conversation(tok) -> None:
    final = {"role": "assistant", "content": "6", "reasoning_content": "3+3=6."}
    prompt = tok.apply_chat_template([U2], add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tok.apply_chat_template([U2, final], tokenize=True, return_dict=False)
    assert full[: len(prompt)] == prompt
    assert full[-1] == tok.eos_token_id


def test_prompts_are_held_out_and_deterministic(tmp_path: Path) -> None:
    heldout = fx.sample_problems(200, seed=3)
    assert {fx._split_of(p.key) for p in heldout} == {"heldout"}
    assert len({p.key for p in heldout}) == 200
    train_keys = {p.key for p in fx.sample_problems(2000, seed=3, split="train")}
    assert not train_keys & {p.key for p in heldout}
    assert fx.fixture_prompts(5, seed=3) == fx.fixture_prompts(5, seed=3)
    assert fx.fixture_prompts(5, seed=3) != fx.fixture_prompts(5, seed=4)
    path = fx.write_prompts_jsonl(tmp_path / "p.jsonl", 7, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == fx.fixture_prompts(7, seed=1)
    assert rows[0]["messages"][0]["role"] == "user"


def test_two_processes_write_the_same_prompts_file_at_once(tmp_path: Path) -> None:
    # bench/quality.py's parallel cells each write the held-out prompts: a shared temporary name made one fail
    code = ("import sys; from eyas_testing.fixture import write_prompts_jsonl as w\n"
            "for _ in range(40): w(sys.argv[1], 30, seed=11)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "p.jsonl")], stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    errors = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert rows == fx.fixture_prompts(30, seed=11) and sorted(os.listdir(tmp_path)) == ["p.jsonl"]


@pytest.mark.slow  # generates 20 held-out answers: not in `make test-fast`
def test_heldout_generation_keeps_the_format(model, tok) -> None:
    problems = fx.sample_problems(20, seed=11)
    outs = [fx.generate_answer(model, tok, [{"role": "user", "content": p.prompt}]) for p in problems]
    formatted = [c.ended and c.reasoning is not None and c.answer != "" for c in outs]
    assert sum(formatted) >= 18, outs
    # Sanity, not skill: the fixture is tiny, so only require some answers to be right.
    right = sum(c.answer.strip() == p.answer for c, p in zip(outs, problems))
    assert right >= 4, [(p.answer, c.answer) for c, p in zip(outs, problems)]


def test_thinking_off_answers_directly(model, tok) -> None:
    msgs = [{"role": "user", "content": p.prompt} for p in fx.sample_problems(5, seed=12)]
    unthink = tok.convert_tokens_to_ids(fx.UNTHINK)
    for m in msgs:
        prompt = tok.apply_chat_template([m], add_generation_prompt=True, thinking=False, return_dict=False)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        ids = out[0, len(prompt):].tolist()
        assert ids[-1] == tok.eos_token_id and unthink not in ids


def test_cache_hit_does_not_rebuild(fixture_target: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    assert fx.build_fixture() == fixture_target
    assert time.monotonic() - t0 < 5
    copy = fx.build_fixture(out=tmp_path / "copy")
    assert (copy / "model.safetensors").read_bytes() == (fixture_target / "model.safetensors").read_bytes()


def test_failed_build_leaves_nothing_that_looks_done(tmp_path: Path) -> None:
    def broken(out: Path, seed: int) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        fx._cached("t", {}, 0, tmp_path, broken, None)
    assert [p.name for p in (tmp_path / "fixtures").iterdir() if not p.name.endswith(".lock")] == []

    calls = []

    def ok(out: Path, seed: int) -> None:
        calls.append(seed)
        (out / "config.json").write_text("{}")

    first = fx._cached("t", {}, 0, tmp_path, ok, None)
    assert fx._cached("t", {}, 0, tmp_path, ok, None) == first and calls == [0]
    assert fx._cached("t", {}, 1, tmp_path, ok, None) != first and calls == [0, 1]


def test_deepseek_fixture_loads_and_runs(fixture_target: Path) -> None:
    path = fx.build_deepseek_fixture()
    assert (path / "tokenizer.json").read_bytes() == (fixture_target / "tokenizer.json").read_bytes()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]  # some MoE layers
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([U1], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert out.logits.shape == (1, len(ids), len(tok))
    assert len(out.hidden_states) == cfg["num_hidden_layers"] + 1
    assert torch.isfinite(out.logits).all()
