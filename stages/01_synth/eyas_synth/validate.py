"""eyas-synth validate: check every sample of a synth dataset structurally, with a per-sample report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import Dataset, DatasetError, check_intact, check_target, iter_jsonl, open_input
from eyas_common.samples import ANSWERED, SAMPLES, bad_line_fix, validate_synth_file


def validate(name: str, *, model: Path | None = None, trust_remote_code: bool = False,
             data_root: Path | None = None) -> dict[str, Any]:
    """{'samples': n, 'bad': [(id, problems)], 'status': ...}; the tokenizer defaults to the dataset's target.

    A dataset the next stage would refuse (partial, edited after it was finished, a malformed manifest) is refused
    here first, by the contract's checks of a finished dataset, so a pass means eyas-extract takes it."""
    ds, manifest = open_input(name, "synth", root=data_root)
    check_intact(ds, manifest)
    if model is None:
        model = (manifest.get("target") or {}).get("model")
        if not model:
            raise DatasetError(f"{ds.ref}: its manifest names no target model; pass the target's folder with --model")
        if not Path(model).is_dir():  # load_tokenizer's refusal would name a --model the user never passed
            raise DatasetError(f"{ds.ref} was made with the target {model}, which is not a folder on this machine; "
                               f"pass the target's folder with --model")
    tokenizer = load_tokenizer(Path(model), trust_remote_code)
    check_target(ds, manifest, target_fingerprint(tokenizer, Path(model)))
    path = ds.path / SAMPLES
    if not path.exists():
        raise DatasetError(f"{ds.ref}: no {SAMPLES}; make it with eyas-synth run")
    fix = bad_line_fix(ds, manifest)
    n, bad = validate_synth_file(path, tokenizer, fix=fix)
    return {"samples": n, "bad": bad + id_problems(ds, manifest, fix), "status": manifest.get("status")}


def id_problems(ds: Dataset, manifest: dict[str, Any], fix: str) -> list[tuple[Any, list[str]]]:
    """[(id, problems)] for ids that make the dataset other than its manifest says: outside [0, n) of the --n asked,
    in two of its files (samples, truncated, rejected), or in none of them yet not listed as missing. Sound samples
    with such ids passed validate: a dataset short of what it claims, or holding samples no run asked for."""
    n = (manifest.get("params") or {}).get("n")
    if type(n) is not int:  # not made by eyas-synth run (a test's or a benchmark's write_dataset)
        return []
    missing = set((manifest.get("stats") or {}).get("missing") or [])
    where: dict[int, str] = {}
    bad: list[tuple[Any, list[str]]] = []
    for fname in ANSWERED:
        path = ds.path / fname
        if not path.exists():
            continue
        for lineno, rec in iter_jsonl(path, fix=fix):
            sid = rec.get("id") if isinstance(rec, dict) else None
            if type(sid) is not int:
                if fname != SAMPLES:  # samples.jsonl's are reported with the sample's other problems
                    bad.append((f"{fname} line {lineno}", ["a record without an integer id"]))
                continue
            if not 0 <= sid < n:
                bad.append((sid, [f"id outside [0, {n}): no run with --n {n} asks for it ({fname} line {lineno})"]))
            elif sid in where and not where[sid] == fname == SAMPLES:  # a duplicate within samples is reported
                bad.append((sid, [f"in {where[sid]} and again in {fname} (line {lineno})"]))
            where.setdefault(sid, fname)
    bad += [(sid, ["no answer (in none of samples, truncated, rejected), and the manifest does not list it as "
                   "missing"]) for sid in range(n) if sid not in where and sid not in missing]
    return bad
