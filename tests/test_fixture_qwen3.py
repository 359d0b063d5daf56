"""The Qwen3-style fixture's tokenizer and chat template (light: no model is trained here; bench/quality.py
builds and serves the whole target): the model, not the prompt, opens `<think>`; thinking off writes an
empty block into the prompt; its training conversations split into prompt and completion exactly."""

from __future__ import annotations

import pytest

from eyas_testing import fixture as base
from eyas_common.chat import ChatTokens, render_prompt
from eyas_testing.fixture_qwen3 import QWEN3_CONFIG, _build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return _build_tokenizer(0, QWEN3_CONFIG["vocab_size"])


def test_the_model_opens_the_thinking_block(tok):
    msgs = [{"role": "user", "content": "Sort the digits 3 1 2"}]
    assert len(tok) == 4000 != base.LLAMA_CONFIG["vocab_size"]
    assert tok.decode(render_prompt(tok, msgs)) == "<|im_start|>user\nSort the digits 3 1 2<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(render_prompt(tok, msgs, thinking=False)).endswith("assistant\n<think>\n\n</think>\n\n")
    ids = ChatTokens.of(tok)
    assert ids.end_of_turn == tok.convert_tokens_to_ids("<|im_end|>") and None not in (ids.think_open, ids.think_close)


def test_training_conversations_split_exactly(tok):
    convs = base._conversations(0)
    for _ in range(50):
        c = next(convs)
        prompt, completion = base._encode(tok, c)
        text = tok.decode(completion)
        if c.thinking:
            assert text.startswith("<think>\n") and "\n</think>\n\n" in text and text.endswith("<|im_end|>\n")
        else:
            assert "<think>" not in text and tok.decode(prompt).endswith("<think>\n\n</think>\n\n")
