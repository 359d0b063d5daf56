"""The target's chat format: fingerprints, special tokens, and rendering a sample from text.

Token streams are the ground truth of this pipeline. A server that returns token ids gives them
exactly; where one does not, the conversation is rendered here with the target tokenizer's own chat
template, and the reasoning is put back inside the thinking wrappers (the bug this project was
founded on was joining reasoning and answer text without them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas_common.contract import DatasetError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# End-of-turn candidates, in order of preference (Kimi/ChatML-style first, then the tokenizer's eos).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>")


REMOTE_CODE_HINT = "pass --trust-remote-code (make: TRUST_REMOTE_CODE=1) to run it"


def refuse_remote_code(model: str | Path, error: Exception, trust_remote_code: bool) -> None:
    """One line instead of transformers' traceback when a target ships code that was not opted into."""
    if not trust_remote_code and "trust_remote_code" in str(error):
        raise DatasetError(f"{model} ships its own model/tokenizer code (auto_map); {REMOTE_CODE_HINT}") from None


def ships_tokenizer_code(model: str | Path) -> bool:
    """tokenizer_config.json maps AutoTokenizer to a class in the model folder (Kimi-K2.5's tiktoken one)."""
    path = Path(model) / "tokenizer_config.json"
    try:
        return "AutoTokenizer" in (json.loads(path.read_text()).get("auto_map") or {})
    except (OSError, ValueError):
        return False


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not Path(model).is_dir():  # else transformers reads the path as a hub model id and tries to download it
        raise DatasetError(f"--model {model}: no such folder; pass the local path of the target (a folder with "
                           f"config.json and the tokenizer files). eyas never downloads models")
    if not trust_remote_code and ships_tokenizer_code(model):
        # transformers 5 would quietly build another tokenizer from tiktoken.model (its own converter and
        # split pattern): the ids could differ from the shipped class's with the same fingerprint.
        refuse_remote_code(model, ValueError("trust_remote_code"), trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # a folder that is not a target: transformers' multi-line traceback
        refuse_remote_code(model, e, trust_remote_code)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(" :")
        raise DatasetError(f"--model {model}: no tokenizer loads from this folder (transformers: {why}); pass the "
                           f"local path of the target (a folder with config.json and the tokenizer files)") from None


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def target_fingerprint(tokenizer, model: str | Path) -> dict[str, Any]:
    """What a dataset records about its target, and what consumers compare.

    The tokenizer hash covers the id -> token map (the meaning of every stored id) and the special
    tokens; it is stable across transformers versions, unlike the serialised tokenizer file.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return {
        "model": str(model),
        "vocab_size": len(tokenizer),
        "tokenizer_sha256": _sha([vocab, sorted(tokenizer.all_special_tokens)]),
        "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
    }


@dataclass(frozen=True)
class ChatTokens:
    """Ids of the structural tokens a sample is checked against."""

    think_open: int | None
    think_close: int | None
    end_of_turn: int

    @classmethod
    def of(cls, tokenizer) -> "ChatTokens":
        vocab = tokenizer.get_vocab()
        eot = next((vocab[t] for t in END_OF_TURN if t in vocab), tokenizer.eos_token_id)
        if eot is None:
            raise ValueError("the tokenizer has no end-of-turn token (<|im_end|>, <|eot_id|>, <|end|>) and no eos")
        return cls(vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE), eot)


def template_kwargs(thinking: bool) -> dict[str, bool]:
    """Chat-template switches for thinking, sent to servers and used for local rendering alike."""
    return {"thinking": thinking, "enable_thinking": thinking}


def resolve_thinking(tokenizer, requested: bool | None) -> tuple[bool, str]:
    """The thinking switch to use, and why: `requested` when given, else from the target itself.

    On only where the tokenizer has both wrappers and its chat template takes the switch (a probe
    conversation renders differently with it on and off). A target without `<think>` (SmolLM2) never
    opens a thinking block, so "on" there would only make its plain answers look like reasoning.
    """
    tokens = ChatTokens.of(tokenizer)
    wrapped = tokens.think_open is not None and tokens.think_close is not None
    if requested and not wrapped:  # it would check plain answers as reasoning, and reject every truncated one
        raise DatasetError("--thinking: the target's tokenizer has no <think>/</think> tokens, so it never thinks; "
                           "leave --thinking out (thinking is off for such a target)")
    if requested is not None:
        return requested, "as asked"
    if not wrapped:
        return False, "the tokenizer has no <think>/</think> tokens"
    probe = [{"role": "user", "content": "hi"}]
    if render_prompt(tokenizer, probe, True) == render_prompt(tokenizer, probe, False):
        return False, "the chat template ignores the thinking switch"
    return True, "the tokenizer has <think>/</think> and the chat template takes the switch"


def render_prompt(tokenizer, messages: list[dict[str, Any]], thinking: bool = True) -> list[int]:
    """The generation prompt as the target's own chat template renders it."""
    # `thinking` is Kimi's switch, `enable_thinking` Qwen3's; a template ignores the one it lacks.
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **template_kwargs(thinking))
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def render_completion(tokenizer, prompt_ids: list[int], reasoning: str | None, content: str,
                      finished: bool = True) -> list[int]:
    """Completion ids for a server that gave text only: [<think>] reasoning </think> content <eot>.

    The wrappers are inserted as token ids, never as text to be re-tokenised, so they cannot be
    lost or merged. `<think>` is added only where the generation prompt does not already end in it
    (Kimi-K2.5 opens the thinking block in the prompt; Qwen3-style models emit it themselves).
    """
    tok = ChatTokens.of(tokenizer)
    ids: list[int] = []
    prompt_open = tok.think_open is not None and (
        prompt_ids[-1:] == [tok.think_open])
    if reasoning:
        if tok.think_open is None or tok.think_close is None:
            raise ValueError("the sample has reasoning but the tokenizer has no <think>/</think> tokens")
        if not prompt_open:
            ids.append(tok.think_open)
        ids += tokenizer.encode(reasoning, add_special_tokens=False)
        ids.append(tok.think_close)
    elif prompt_open:
        ids.append(tok.think_close)  # an empty thinking block still has to be closed
    ids += tokenizer.encode(content, add_special_tokens=False)
    if finished:
        ids.append(tok.end_of_turn)
    return ids
