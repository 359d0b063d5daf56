"""Prompt files: JSONL of OpenAI `messages`, ShareGPT `conversations` or a `prompt` string (vLLM's custom
benchmark dataset), or plain text (one prompt per line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from eyas_common.contract import DatasetError, json_type

# the one description of a prompts file every CLI's --prompts shows
PROMPTS_HELP = ("JSONL (.jsonl) of OpenAI `messages`, ShareGPT `conversations` or a `prompt` string; else plain "
                "text, one prompt per line.")

# The field each record format is known by, and what its value must be.
PROMPT_FIELDS = {"messages": "an array of {role, content} objects (OpenAI)",
                 "conversations": "an array of {from, value} turns (ShareGPT)",
                 "prompt": "a string"}

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant"}


def _from_record(rec: Any, where: str) -> list[dict[str, str]]:
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        msgs = rec["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in msgs):
            raise DatasetError(f"{where}: every entry of `messages` needs string `role` and `content`")
        # an earlier answer's reasoning goes to the template, which decides (most drop it before the last user turn)
        msgs = [{"role": m["role"], "content": m["content"]}
                | {k: m[k] for k in ("reasoning_content", "reasoning") if isinstance(m.get(k), str)} for m in msgs]
    elif isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
        msgs = []
        for turn in rec["conversations"]:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                raise DatasetError(f"{where}: ShareGPT turn {turn!r:.80} needs `from` "
                                   f"({'/'.join(SHAREGPT_ROLES)}) and a string `value`")
            msgs.append({"role": role, "content": turn["value"]})
    elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        msgs = [{"role": "user", "content": rec["prompt"]}]
    else:
        _refuse_record(rec, where)
    # The target answers the last user turn itself: a recorded answer after it is dropped.
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not msgs or msgs[-1]["role"] != "user":
        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in msgs)) or "none"
        raise DatasetError(f"{where}: the conversation has no user turn to answer (its roles: {roles}; a turn to "
                           f"answer has role \"user\", lower case)")
    return msgs


def _refuse_record(rec: Any, where: str) -> NoReturn:
    """Raise what is wrong with a record that is none of the formats: a known field of the wrong type, or none."""
    field = next((k for k in PROMPT_FIELDS if k in rec), None) if isinstance(rec, dict) else None
    if field is not None:
        raise DatasetError(f"{where}: `{field}` must be {PROMPT_FIELDS[field]}, found a JSON "
                           f"{json_type(rec[field])}")
    found = (f"keys {', '.join(map(str, rec))}" if rec else "an empty object") if isinstance(rec, dict) \
        else f"a JSON {json_type(rec)}"
    raise DatasetError(f"{where}: expected an object with `messages` (OpenAI), `conversations` (ShareGPT) or a "
                       f"`prompt` string, found {found}; for plain text, one prompt per line, name the file .txt")


def load_prompts(path: Path) -> list[list[dict[str, str]]]:
    """Conversations ending with a user turn; a malformed record raises naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"prompts file {path} does not exist")
    out = []
    with open(path, "rb") as f:
        jsonl = path.suffix in (".jsonl", ".json")
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line); a prompts file is "
                                   f"JSONL or plain text, UTF-8") from None
            if "\x00" in line:
                raise DatasetError(f"{where}: holds NUL bytes (a binary file?); a prompts file is JSONL or plain "
                                   f"text, UTF-8")
            if not line.strip():
                continue
            if jsonl:
                try:
                    rec = json.loads(line.rstrip("\r\n"))  # with its newline, an unclosed line errs at column 1
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
                out.append(_from_record(rec, where))
            else:
                out.append([{"role": "user", "content": line.rstrip("\r\n")}])
    if not out:
        raise DatasetError(f"prompts file {path} holds no prompts")
    return out
