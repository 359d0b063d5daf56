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


# The template switches for thinking in the wild: Kimi's `thinking`, Qwen3's `enable_thinking`.
SWITCHES = ("thinking", "enable_thinking")
_PROBE = [{"role": "user", "content": "hi"}]


def template_kwargs(thinking: bool | None, switches: tuple[str, ...] = SWITCHES) -> dict[str, bool]:
    """Chat-template switches for thinking, sent to servers and used for local rendering alike; None sends none
    (the template's own default). A template ignores a switch it does not take."""
    return {} if thinking is None else {k: thinking for k in switches}


def template_switches(tokenizer) -> tuple[str, ...]:
    """The thinking switches the chat template takes: those whose on and off render a probe differently."""
    return tuple(k for k in SWITCHES
                 if _render(tokenizer, _PROBE, {k: True}) != _render(tokenizer, _PROBE, {k: False}))


def prompt_opens_thinking(prompt_ids: list[int], tokens: "ChatTokens") -> bool:
    """The generation prompt ends inside an open thinking block: its last wrapper token is `<think>` (Kimi-K2.5's
    `...<think>`, DeepSeek-R1's `...<think>\n`); earlier turns' blocks are closed, and an empty block written for
    thinking off (`<think></think>`, Qwen3's `<think>\n\n</think>\n\n`) ends in `</think>`."""
    if tokens.think_open is None or tokens.think_open not in prompt_ids:
        return False
    last_open = len(prompt_ids) - 1 - prompt_ids[::-1].index(tokens.think_open)
    return tokens.think_close not in prompt_ids[last_open:]


def resolve_thinking(tokenizer, requested: bool | None) -> tuple[bool | None, str]:
    """The thinking switch to send (None: none, the template decides), and the evidence for it, in words.

    A switch is sent only where the template takes one, and by default not even there: the target's own
    default is what it does. Whatever the target then does (the prompt opens the block, the model opens it,
    or it never thinks) is read from each answer's token ids, not guessed from the template.
    """
    tokens = ChatTokens.of(tokenizer)
    if requested and (tokens.think_open is None or tokens.think_close is None):
        raise DatasetError("--thinking: the target's tokenizer has no <think>/</think> tokens, so it never thinks; "
                           "leave --thinking out", code="THINKING_UNSUPPORTED", names="--thinking")
    switches = template_switches(tokenizer)
    value = requested if switches else None
    opens = prompt_opens_thinking(render_prompt(tokenizer, _PROBE, value), tokens)
    if not switches:
        said = "" if requested is None else f"; --{'' if requested else 'no-'}thinking changes nothing"
        why = f"the chat template takes no thinking switch, so none is sent{said}"
    elif requested is None:
        why = f"the chat template takes {'/'.join(switches)}; none sent, so the target's default applies"
    else:
        why = f"{'/'.join(switches)}={str(requested).lower()} sent, as asked"
    where = ("the generation prompt opens a thinking block" if opens else
             "the generation prompt opens no thinking block" if tokens.think_open is not None else
             "the tokenizer has no <think>/</think> tokens")
    return value, f"{why}; {where}"


def _render(tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, bool]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def render_prompt(tokenizer, messages: list[dict[str, Any]], thinking: bool | None = None) -> list[int]:
    """The generation prompt as the target's own chat template renders it (`thinking` None: no switch sent)."""
    return _render(tokenizer, messages, template_kwargs(thinking))


def render_completion(tokenizer, prompt_ids: list[int], reasoning: str | None, content: str,
                      finished: bool = True) -> list[int]:
    """Completion ids for a server that gave text only: [<think>] reasoning </think> content <eot>.

    The wrappers are inserted as token ids, never as text to be re-tokenised, so they cannot be
    lost or merged. `<think>` is added only where the generation prompt does not already end in it
    (Kimi-K2.5 opens the thinking block in the prompt; Qwen3-style models emit it themselves).
    """
    tok = ChatTokens.of(tokenizer)
    ids: list[int] = []
    prompt_open = prompt_opens_thinking(prompt_ids, tok)
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


def split_text(reasoning: str | None, content: str) -> tuple[str | None, str]:
    """A text-only answer's (reasoning, content), with wrappers a server left inside the content (no reasoning
    parser, or one for another family) taken out: `[<think>]reasoning</think>content`."""
    if reasoning or THINK_CLOSE not in content:
        return reasoning, content
    head, _, tail = content.partition(THINK_CLOSE)
    return head.strip().removeprefix(THINK_OPEN).strip(), tail.strip()
