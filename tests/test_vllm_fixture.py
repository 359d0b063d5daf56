"""The fixture served by a real vLLM (CPU) with the kimi_k2 reasoning parser: the response facts
that synth relies on (token ids, where the reasoning goes), checked against HF."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas_testing import fixture as fx
from eyas_testing.servers import VllmServer, start_vllm, stop, wait_healthy


@pytest.fixture(scope="module")
def tok(fixture_target: Path):
    return AutoTokenizer.from_pretrained(fixture_target)


def chat(server: VllmServer, messages: list[dict], **extra) -> dict:
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 200, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra}, timeout=300)
    r.raise_for_status()
    return r.json()


@pytest.mark.vllm
def test_token_ids_and_reasoning_split(vllm_server: VllmServer, fixture_target: Path, tok) -> None:
    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(fixture_target).eval()
    unthink = tok.convert_tokens_to_ids(fx.UNTHINK)
    split = 0
    # The tiny model sometimes never closes its thinking block (its float arithmetic, and so its answers,
    # differ between CPUs); those answers still check the ids, and enough others check the split.
    for prompt in fx.fixture_prompts(5, seed=21):
        msgs = prompt["messages"]
        resp = chat(vllm_server, msgs)
        expected_prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert resp["prompt_token_ids"] == expected_prompt
        choice = resp["choices"][0]
        ids = choice["token_ids"]
        assert choice["finish_reason"] == "stop"
        assert ids[-1] == tok.eos_token_id  # the end-of-turn token is in the ids, not in the text
        assert resp["usage"]["completion_tokens"] == len(ids)
        # Greedy vLLM fp32 follows HF fp32 token for token on this fixture.
        with torch.no_grad():
            out = hf.generate(torch.tensor([expected_prompt]), max_new_tokens=200, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert out[0, len(expected_prompt):].tolist() == ids
        msg = choice["message"]
        reasoning = msg.get("reasoning") or msg.get("reasoning_content")
        if unthink not in ids:
            continue
        cut = ids.index(unthink)
        assert reasoning == tok.decode(ids[:cut])
        assert msg["content"] == tok.decode(ids[cut + 1 : -1])
        split += 1
    assert split >= 3, f"only {split} of 5 answers closed their thinking block"


@pytest.mark.vllm
def test_thinking_off_is_all_content(vllm_server: VllmServer, tok) -> None:
    msgs = fx.fixture_prompts(1, seed=22)[0]["messages"]
    resp = chat(vllm_server, msgs, chat_template_kwargs={"thinking": False})
    assert resp["prompt_token_ids"] == tok.apply_chat_template(
        msgs, add_generation_prompt=True, thinking=False, tokenize=True, return_dict=False
    )
    assert tok.convert_ids_to_tokens(resp["prompt_token_ids"][-2:]) == [fx.THINK, fx.UNTHINK]
    choice = resp["choices"][0]
    msg = choice["message"]
    assert not (msg.get("reasoning") or msg.get("reasoning_content"))
    assert msg["content"] == tok.decode(choice["token_ids"][:-1])
    assert choice["token_ids"][-1] == tok.eos_token_id


def test_dead_server_reports_its_log(tmp_path: Path) -> None:
    # An interpreter without vLLM: the server dies at once, and the error carries the reason.
    server = start_vllm(tmp_path, log_path=tmp_path / "server.log", python=Path(sys.executable))
    try:
        with pytest.raises(RuntimeError, match="No module named 'vllm'"):
            wait_healthy(server, timeout_s=60)
    finally:
        stop(server)
    assert server.proc.returncode not in (None, 0)
