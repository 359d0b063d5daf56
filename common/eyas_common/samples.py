"""The synth dataset: its file names, the sample record every later stage trains on, its validation,
and the shortfall a dataset may be accepted with.

`synth/NAME/` holds:
    samples.jsonl     the training samples, one per line, appended as they come
    truncated.jsonl   length-truncated samples set aside by --drop-truncated (kept in samples by default)
    rejected.jsonl    answers that failed structural validation, with the problems found
    failures.jsonl    requests that failed after every retry (retried by the next run)
    manifest.json     eyas.synth/1; params = the synth config; stats = counts; `missing` = what is short
A sample id is its index i in [0, n); sample i answers prompt i mod #prompts. A dataset is complete
when every id is answered (kept or set aside) but for two budgets, both recorded in the manifest and
printed by every consumer: ids with no answer (`--allow-missing`, default 0) and answers rejected by
validation (`--allow-rejected`, default 1%). A rejected answer is not asked again: a share above
the budget points at the setup (thinking switch, template, server), which a rerun would not fix.

One JSON object per line of `samples.jsonl`:
    id             int, unique in the dataset (sample i uses prompt i mod #prompts)
    prompt_index   int, line of the prompt in the prompts file
    messages       the conversation sent (OpenAI format), ending with a user turn
    thinking       bool | null, the chat-template thinking switch sent (null: none, the template's default)
    reasoning      str | null, the text inside the thinking block (null: the completion opens none)
    content        str, the answer text after it
                   Both are split at the tokenizer's wrapper ids, whatever the server's reasoning parser did
                   (`from_server_ids`), and only after the server's own text agreed with the ids.
    input_ids      list[int], prompt + completion, exactly as the target saw and produced them
    loss_mask      list[0|1], 1 on the completion only
    finish_reason  "stop" | "length"
    source         "server" (ids from the server) | "rendered" (ids rendered from text here)
    server         str, which server answered (only in samples that came from one)
A record is made by `new_sample` and only there; `write_dataset` writes a complete dataset of them at once
(synth appends them one by one). Stage 02 reads them through `index_samples` and `read_tokens`, which
check the fields it uses (`token_problems`), or while synth still writes them through `SynthTail`
(`eyas-extract run --follow`); `validate_sample` checks everything.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from eyas_common.chat import THINK_CLOSE, THINK_OPEN, ChatTokens, prompt_opens_thinking, render_prompt
from eyas_common.contract import (REMAKE, Dataset, DatasetError, JsonlAppender, JsonlTail, finalize, iter_jsonl,
                                  iter_jsonl_at, json_type, new_manifest, remake_fix)
from eyas_common.lock import holder

SAMPLES, TRUNCATED, REJECTED, FAILURES = "samples.jsonl", "truncated.jsonl", "rejected.jsonl", "failures.jsonl"
ANSWERED = (SAMPLES, TRUNCATED, REJECTED)  # files whose ids count as done: a rerun never asks for them again


def parse_budget(value: str | int | None) -> tuple[int, float]:
    """A budget of samples (`--allow-missing`, `--allow-rejected`): N (samples) or P% (of those asked),
    as (count, percent); one of them is 0."""
    text = str(value if value is not None else 0).strip()
    m = re.fullmatch(r"(\d+)(\.\d+)?(%?)", text)
    if not m or (m.group(2) and not m.group(3)) or (m.group(3) and float(text[:-1]) > 100):
        raise ValueError(f"{text!r}: expected a count of samples (e.g. 5) or a percentage 0-100 (e.g. 0.5%)")
    return (0, float(text[:-1])) if m.group(3) else (int(text), 0.0)


def budget_count(value: str | int | None, asked: int) -> int:
    """How many of `asked` samples a budget VALUE (N or P%) allows."""
    count, pct = parse_budget(value)
    return count if not pct else int(asked * pct / 100)


def shortfall_note(manifest: dict[str, Any]) -> str | None:
    """The line consumers print when a complete synth dataset was accepted short of what was asked."""
    stats, params = manifest.get("stats") or {}, manifest.get("params") or {}
    short, rejected = stats.get("missing") or [], stats.get("rejected") or 0
    if not short and not rejected:
        return None
    parts = []
    if short:
        parts.append(f"{len(short)} missing (--allow-missing {params.get('allow_missing')}; ids {short[:10]}"
                     f"{' ...' if len(short) > 10 else ''})")
    if rejected:
        parts.append(f"{rejected} rejected (--allow-rejected {params.get('allow_rejected', '0')}; in {REJECTED})")
    return f"accepted with {' and '.join(parts)} of {params.get('n')} samples asked"


REQUIRED = {"id": int, "messages": list, "content": str, "input_ids": list, "loss_mask": list,
            "finish_reason": str, "source": str}
TOKEN_FIELDS = {"id": int, "input_ids": list, "loss_mask": list}  # what stage 02 reads of a sample


def new_sample(*, id: int, prompt_index: int, messages: list[dict[str, Any]], thinking: bool,
               reasoning: str | None, content: str, prompt_ids: list[int], completion_ids: list[int],
               finish_reason: str, source: str, server: str | None = None) -> dict[str, Any]:
    """One sample record, as samples.jsonl stores it: input_ids is prompt + completion, and the loss mask
    is 1 on the completion only."""
    sample = {"id": id, "prompt_index": prompt_index, "messages": messages, "thinking": thinking,
              "reasoning": reasoning, "content": content, "input_ids": prompt_ids + completion_ids,
              "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids), "finish_reason": finish_reason,
              "source": source}
    return sample if server is None else sample | {"server": server}


def write_dataset(ds: Dataset, samples: Iterable[dict[str, Any]], *, stage: str, target: dict[str, Any],
                  params: dict[str, Any]) -> Dataset:
    """A complete synth dataset of ready-made samples, written at once (tests, benchmarks): samples.jsonl and
    its manifest. eyas-synth appends its samples as they come instead, to resume."""
    ds.path.mkdir(parents=True, exist_ok=True)
    manifest = new_manifest("synth", stage=stage, target=target, inputs=[], params=params)
    n = 0
    with JsonlAppender(ds.path / SAMPLES) as w:
        for sample in samples:
            w.write(sample)
            n += 1
    finalize(ds, manifest, stats={"samples": n}, records={SAMPLES: n})
    return ds


def token_problems(sample: Any, vocab_size: int | None = None) -> list[str]:
    """What makes a sample's tokens unusable by any stage: id, input_ids or loss_mask missing or mistyped,
    no tokens, a mask of another length or with values other than 0/1, ids outside [0, vocab_size)."""
    if not isinstance(sample, dict):
        return [f"a JSON {type(sample).__name__}, not an object"]
    problems = [f"field {k!r} missing or not {t.__name__}" for k, t in TOKEN_FIELDS.items()
                if not isinstance(sample.get(k), t)]
    if problems:
        return problems
    ids, mask = sample["input_ids"], sample["loss_mask"]
    if not ids:
        return ["input_ids is empty"]
    if len(ids) != len(mask):
        return [f"input_ids has {len(ids)} tokens but loss_mask {len(mask)}"]
    if any(m not in (0, 1) for m in mask):
        return ["loss_mask holds values other than 0/1"]
    if vocab_size is not None and not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        return [f"input_ids outside the target's vocabulary [0, {vocab_size})"]
    return []


@dataclass(frozen=True)
class SampleLine:
    """Where one sample lies in samples.jsonl, and its sizes: what stage 02 plans its shards with."""

    id: int
    n_tokens: int
    n_masked: int
    pos: int  # byte offset of its line


def bad_line_fix(ds: Dataset, manifest: dict[str, Any]) -> str:
    """What to do about an unreadable line of a synth file (malformed JSON, no id): the fix its refusal names."""
    if manifest.get("status") == "complete":
        return f"edited once finished; {remake_fix(ds)}"
    # synth appends whole lines; a kill tears only the last one, which the next run cuts (repair_jsonl)
    return "not a killed run's torn last line: delete that line and rerun (its sample is asked for again)"


CORRUPTED = f"corrupted: `eyas-data verify` it, then remake it with {REMAKE['synth']}"


def sample_line(path: Path, lineno: int, pos: int, rec: Any, *, vocab_size: int, seen: set[int]) -> SampleLine:
    """Where one sample of samples.jsonl lies, once the fields stage 02 uses are checked and its id is new
    (`seen` collects the ids); a bad line is refused naming file, line and the fix."""
    problems = token_problems(rec, vocab_size)
    if not problems and rec["id"] in seen:
        problems = [f"sample id {rec['id']} appears twice"]
    if problems:
        raise DatasetError(f"{path}:{lineno}: {problems[0]}; the synth dataset is invalid: run `eyas-synth "
                           f"validate` on it and remake it with {REMAKE['synth']}", code="BAD_SAMPLE", names=f"{path}:{lineno}")
    seen.add(rec["id"])
    return SampleLine(rec["id"], len(rec["input_ids"]), sum(rec["loss_mask"]), pos)


def index_samples(path: Path, vocab_size: int) -> list[SampleLine]:
    """Read and check every sample of a samples.jsonl once, keeping only where it is (the tokens are read
    again per shard by read_tokens); ascending id. A bad line is refused naming file, line and the fix."""
    seen: set[int] = set()
    refs = [sample_line(path, lineno, pos, rec, vocab_size=vocab_size, seen=seen)
            for lineno, pos, rec in iter_jsonl_at(path, fix=CORRUPTED)]
    if not refs:
        raise DatasetError(f"{path}: no samples; remake the synth dataset with {REMAKE['synth']}", code="NO_SAMPLES", names=str(path))
    return sorted(refs, key=lambda r: r.id)


def read_tokens(path: Path, refs: list[SampleLine]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each indexed sample, read again at its recorded offset."""
    out = []
    with open(path, "rb") as f:
        for r in refs:
            f.seek(r.pos)
            rec = json.loads(f.readline())
            if rec.get("id") != r.id:
                raise DatasetError(f"{path}: changed while being read (sample {r.id} moved); rerun", code="SAMPLES_MOVED", names=str(path))
            out.append((rec["input_ids"], rec["loss_mask"]))
    return out


class SynthTail:
    """A synth dataset read while eyas-synth may still be writing it (`eyas-extract run --follow`).

    An id is *decided* once it is kept (samples.jsonl), set aside (truncated.jsonl) or rejected
    (rejected.jsonl): no run asks for it again. A failed id (failures.jsonl) is not: the next synth run
    retries it. Once the manifest is complete every id is decided (the missing ones were accepted short).
    `take_ready` hands out, in id order and once each, the samples every smaller id of which is decided:
    the samples a complete dataset would have in that place, whatever is appended later.
    """

    def __init__(self, ds: Dataset, vocab_size: int):
        self.ds, self.vocab_size = ds, vocab_size
        self.tails = {name: JsonlTail(ds.path / name, fix=CORRUPTED) for name in ANSWERED}
        self.seen: set[int] = set()                 # ids of samples.jsonl so far (a repeated one is refused)
        self.present: dict[int, SampleLine] = {}    # samples read and not yet handed out
        self.decided: set[int] = set()              # decided ids at or above `prefix`
        self.prefix = 0                             # every id below it is decided
        self.manifest: dict[str, Any] = {}
        self.writer: dict[str, Any] | None = None   # the lock record of the synth run writing it, if one is

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete"

    @property
    def n_decided(self) -> int:
        return self.prefix + len(self.decided)

    def poll(self) -> None:
        """Read what was appended since the last poll. The writer is asked first, then the manifest, then the
        files: a writer found gone has flushed everything, and synth marks the manifest complete only after
        its last append, so a complete manifest read here comes with every sample."""
        self.writer = holder(self.ds)
        self.manifest = self.ds.read_manifest()
        for name, tail in self.tails.items():
            for lineno, pos, rec in tail.read_new():
                if name == SAMPLES:
                    line = sample_line(tail.path, lineno, pos, rec, vocab_size=self.vocab_size, seen=self.seen)
                    self.present[line.id] = line
                elif not isinstance(rec, dict) or not isinstance(rec.get("id"), int):
                    raise DatasetError(f"{tail.path}:{lineno}: a record without an integer id; {CORRUPTED}", code="BAD_SAMPLE", names=f"{tail.path}:{lineno}")
                sid = rec["id"]
                if sid >= self.prefix:
                    self.decided.add(sid)

    def take_ready(self) -> list[SampleLine]:
        """The samples whose place in id order is now settled, ascending; each is handed out once."""
        ready = []
        while self.prefix in self.decided:
            self.decided.discard(self.prefix)
            if self.prefix in self.present:
                ready.append(self.present.pop(self.prefix))
            self.prefix += 1
        if self.complete:
            ready += [self.present.pop(i) for i in sorted(self.present)]
        return ready


def completion_start(loss_mask: list[int]) -> int:
    """Index of the first completion token (the mask is 0...0 1...1)."""
    try:
        return loss_mask.index(1)
    except ValueError:
        return len(loss_mask)


def validate_sample(sample: dict[str, Any], tokenizer, tokens: ChatTokens | None = None,
                    check_prompt: bool = True) -> list[str]:
    """Every structural problem of one sample; an empty list means it is sound.

    Checks: the loss mask covers exactly the completion; the prompt ids are the chat template's own
    rendering of `messages`; a thinking block opened in the prompt (or the completion) is closed by
    `</think>` inside the completion; a finished completion ends with the end-of-turn token and has
    no other; the ids between the wrappers decode to the stored reasoning and content.
    """
    problems = [f"field {k!r} missing or not {t.__name__}" for k, t in REQUIRED.items()
                if not isinstance(sample.get(k), t)] or token_problems(sample)
    if problems:
        return problems
    tokens = tokens or ChatTokens.of(tokenizer)
    problems, p = _mask_problems(sample["loss_mask"])
    if p is None:
        return problems
    prompt, completion = sample["input_ids"][:p], sample["input_ids"][p:]
    if check_prompt:
        problems += _prompt_problems(prompt, render_prompt(tokenizer, sample["messages"], sample.get("thinking")))
    finished = sample["finish_reason"] != "length"
    block = _Block.of(prompt, completion, tokens)
    problems += _wrapper_problems(sample, completion, tokens, block, finished)
    if problems:
        return problems
    return _text_problems(sample, completion, tokenizer, block, finished)


def _mask_problems(mask: list[int]) -> tuple[list[str], int | None]:
    """Problems of the loss mask's shape, and where the completion starts (None: nothing more can be checked)."""
    p = completion_start(mask)
    if p == len(mask):
        return ["loss_mask is all zero: no completion to train on"], None
    problems = []
    if p == 0:
        problems.append("loss_mask covers the prompt start: no prompt tokens")
    if any(m == 0 for m in mask[p:]):
        problems.append("loss_mask is not one span at the end: the completion has unmasked holes")
    return problems, p


def _prompt_problems(prompt: list[int], expected: list[int]) -> list[str]:
    if prompt == expected:
        return []
    at = next((i for i, (a, b) in enumerate(zip(prompt, expected)) if a != b), min(len(prompt), len(expected)))
    return [f"prompt ids differ from the chat template's rendering of messages at token {at} "
            f"({len(prompt)} vs {len(expected)} tokens)"]


@dataclass(frozen=True)
class _Block:
    """Where a completion's thinking block is, in completion positions."""

    opened: bool        # opened by <think> at the end of the prompt or at the start of the completion
    body_start: int     # first position after an opening <think> in the completion (0 if none there)
    closes: list[int]   # positions of </think>

    @classmethod
    def of(cls, prompt: list[int], completion: list[int], tokens: ChatTokens) -> "_Block":
        in_prompt = prompt_opens_thinking(prompt, tokens)
        in_completion = tokens.think_open is not None and completion[:1] == [tokens.think_open]
        closes = [i for i, t in enumerate(completion) if t == tokens.think_close] if tokens.think_close is not None else []
        return cls(in_prompt or in_completion, int(in_completion), closes)

    def spans(self, completion: list[int], finished: bool) -> tuple[list[int], list[int]]:
        """The reasoning ids (inside the block) and the content ids (after it), end-of-turn left out."""
        end = len(completion) - 1 if finished else len(completion)
        if self.closes:
            return completion[self.body_start:self.closes[0]], completion[self.closes[0] + 1:end]
        if self.opened:  # cut by length inside the reasoning (an unclosed finished block is refused)
            return completion[self.body_start:end], []
        return [], completion[:end]


def from_server_ids(prompt: list[int], completion: list[int], text: tuple[str | None, str], tokenizer,
                    tokens: ChatTokens, finished: bool) -> tuple[str | None, str, list[str]]:
    """(reasoning, content) of a completion the server gave as ids, split at the wrapper ids, and what makes it
    unusable: the server's own text (`text`: its reasoning and content, however its parser split them, or left
    the wrappers in the content) must say what the ids say, up to whitespace and the wrappers themselves."""
    block = _Block.of(prompt, completion, tokens)
    r_ids, c_ids = block.spans(completion, finished)
    reasoning = tokenizer.decode(r_ids, skip_special_tokens=False).strip() if block.opened else None
    content = tokenizer.decode(c_ids, skip_special_tokens=False).strip()
    said = _squash("".join(t or "" for t in text), finished)
    ids = _squash(tokenizer.decode(completion[:-1] if finished else completion, skip_special_tokens=True), finished)
    if said != ids:
        at = next((i for i, (a, b) in enumerate(zip(said, ids)) if a != b), min(len(said), len(ids)))
        return reasoning, content, [f"the server's text disagrees with its token ids at character {at}: text "
                                    f"{said[at:at + 30]!r}, ids {ids[at:at + 30]!r}"]
    # Agreeing, the ids are the answer however the parser split it: reasoning where the ids open no block (a
    # deepseek_r1 parser on a completion with no </think>) is the parser's opinion, and the ids keep it content.
    return reasoning, content, []


def _squash(text: str, finished: bool) -> str:
    """Text as compared between a server and its ids: no whitespace (parsers strip and re-join it), no wrappers
    (a parser removes them, no parser keeps them), and for a cut answer no trailing half character."""
    text = "".join(text.replace(THINK_OPEN, "").replace(THINK_CLOSE, "").split())
    return text if finished else text.rstrip("\ufffd")


def _wrapper_problems(sample: dict[str, Any], completion: list[int], tokens: ChatTokens, block: _Block,
                      finished: bool) -> list[str]:
    """End-of-turn and thinking-wrapper placement."""
    problems = []
    eot = tokens.end_of_turn
    if finished and completion[-1] != eot:
        problems.append(f"finish_reason {sample['finish_reason']!r} but the stream does not end with the "
                        f"end-of-turn token {eot}")
    if eot in completion[:-1]:
        problems.append("end-of-turn token inside the completion before its end")
    reasoning = sample.get("reasoning") or ""
    if tokens.think_open is not None and tokens.think_open in completion[block.body_start:]:
        problems.append("a <think> token inside the completion")
    if len(block.closes) > 1:
        problems.append(f"{len(block.closes)} </think> tokens in the completion")
    if reasoning.strip() and not block.opened:
        problems.append("reasoning present but no <think> opens it (neither at the end of the prompt "
                        "nor at the start of the completion)")
    if (reasoning.strip() or block.opened) and not block.closes and finished:
        problems.append("thinking block opened (or reasoning present) but no </think> before the end of turn: "
                        "the model never closed it, or reasoning and answer were joined without the thinking wrappers")
    return problems


def _text_problems(sample: dict[str, Any], completion: list[int], tokenizer, block: _Block,
                   finished: bool) -> list[str]:
    """The ids between the wrappers decode to the stored reasoning and content.

    A completion is reasoning only inside a thinking block that was opened; without one (a target with
    no <think>, or thinking off) every token is the answer, whether it finished or was cut by length.
    """
    problems = []
    reasoning = sample.get("reasoning") or ""
    r_ids, c_ids = block.spans(completion, finished)
    got_r = tokenizer.decode(r_ids, skip_special_tokens=False).strip()
    got_c = tokenizer.decode(c_ids, skip_special_tokens=False).strip()
    stored_c = sample["content"].strip()
    if not finished:  # a cut can split a multi-byte character: ids decode it to U+FFFD, servers hold it back
        got_c, stored_c = got_c.rstrip("\ufffd").rstrip(), stored_c.rstrip("\ufffd").rstrip()
    if got_r != reasoning.strip():
        problems.append(f"reasoning ids decode to {got_r[:60]!r}, stored reasoning is {reasoning.strip()[:60]!r}")
    if (block.closes or finished or not block.opened) and got_c != stored_c:
        problems.append(f"content ids decode to {got_c[:60]!r}, stored content is {stored_c[:60]!r}")
    return problems


def validate_synth_file(path, tokenizer, check_prompt: bool = True, fix: str = ""
                        ) -> tuple[int, list[tuple[Any, list[str]]]]:
    """Validate every sample of a samples.jsonl: (samples read, [(sample id, problems), ...]); a line that is not
    JSON is refused naming file, line and `fix` (bad_line_fix)."""
    tokens = ChatTokens.of(tokenizer)
    seen: set[Any] = set()
    bad: list[tuple[Any, list[str]]] = []
    n = 0
    for lineno, sample in iter_jsonl(path, fix=fix):
        n += 1
        if not isinstance(sample, dict):
            bad.append((f"line {lineno}", [f"a JSON {json_type(sample)}, not a sample object"]))
            continue
        sid = sample["id"] if isinstance(sample.get("id"), int) else f"line {lineno}"  # its problems say why
        problems = validate_sample(sample, tokenizer, tokens, check_prompt)
        if sid in seen:
            problems.append("duplicate sample id")
        seen.add(sid)
        if problems:
            bad.append((sid, problems))
    return n, bad
