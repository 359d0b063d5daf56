"""The bench dataset `bench/NAME/`: a served draft measured against its target (stage 04 writes it).

Files of a bench dataset:
    results.json   what was measured (below), validated on write and on read (on read after its bytes are
                   checked against the sha256 the manifest recorded)
    bench.png      acceptance per position; output tokens/s against concurrency with and without the draft
    manifest.json  schema eyas.bench/1; inputs: the draft, then its hidden and synth datasets (lineage);
                   target: the draft's target fingerprint; params: the bench configuration

results.json:
    engine, server, baseline (URL or null), spec_tokens, prompts, prompts_sha256
    levels: one per concurrency, each
        concurrency
        draft / baseline: {requests, errors, output_tokens, duration_s, tokens_per_s,
                           ttft_ms: {p50, p90}, itl_ms: {p50, p90}}   (baseline null without --baseline)
        spec: {drafts, draft_tokens, accepted, acceptance_length, per_position: [...], tokens_per_step}
              or null when the server exposes no speculative counters (never a made-up 1.0);
              acceptance_length counts the steps that carried a draft, tokens_per_step every step of the
              target (null where the engine does not count steps; absent from older results)
        speedup: draft tokens/s over baseline tokens/s, or null
    spec: the same counters summed over every level (the headline acceptance), or null
This module is the only reader and writer of these files; stage 04 and the demo go through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas_common.contract import (Dataset, DatasetError, check_intact, finalize, input_ref, json_type, open_input,
                                  open_output, remake_fix, write_json_atomic)

RESULTS, PLOT = "results.json", "bench.png"
STAGE = "04_serve"
_LATENCY_KEYS = ("requests", "errors", "output_tokens", "duration_s", "tokens_per_s", "ttft_ms", "itl_ms")
_SPEC_KEYS = ("drafts", "draft_tokens", "accepted", "acceptance_length", "per_position")
# The type of each field `report` and the plot read: (kind, null allowed). Checked on write and on read, so a
# hand-edited value is refused naming its field instead of failing inside a format string.
_INT, _NUM, _STR = "an integer", "a number", "a string"
_LATENCY_TYPES = {"requests": (_INT, False), "errors": (_INT, False), "output_tokens": (_INT, False),
                  "duration_s": (_NUM, False), "tokens_per_s": (_NUM, False)}
_PERCENTILE_TYPES = {"p50": (_NUM, True), "p90": (_NUM, True)}  # null: no request finished (or none had 2 tokens)
_SPEC_TYPES = {"drafts": (_INT, True), "draft_tokens": (_INT, True), "accepted": (_INT, True),
               "acceptance_length": (_NUM, True), "tokens_per_step": (_NUM, True)}
_TOP_TYPES = {"engine": (_STR, False), "server": (_STR, False), "prompts": (_STR, False), "baseline": (_STR, True)}


def check_lineage(ds: Dataset, manifest: dict[str, Any]) -> None:
    """Refuse a manifest whose `inputs` or `target` (what `report` prints as the lineage) no eyas stage writes:
    a hand edit would otherwise fail inside the report, or be copied into every bench of that draft."""
    inputs, target = manifest.get("inputs", []), manifest.get("target")
    wrong = [n for n, x in enumerate(inputs) if not isinstance(x, dict) or not isinstance(x.get("ref"), str)] \
        if isinstance(inputs, list) else []
    bad = None
    if not isinstance(inputs, list):
        bad = f"`inputs` is a JSON {json_type(inputs)}, expected an array of {{ref, manifest_sha256}}"
    elif wrong:
        bad = f"`inputs[{wrong[0]}]` is {json.dumps(inputs[wrong[0]])[:60]}, expected an object with a string `ref`"
    elif target is not None and not isinstance(target, dict):
        bad = f"`target` is a JSON {json_type(target)}, expected the target's fingerprint (an object) or null"
    if bad:
        raise DatasetError(f"{ds.ref}: {ds.manifest_path}: {bad}; it was edited; {remake_fix(ds)}")


def lineage(draft: Dataset | None, draft_manifest: dict[str, Any] | None) -> list[dict[str, str]]:
    """The draft itself, then what it was made from (its hidden and synth datasets)."""
    if draft is None or draft_manifest is None:
        return []
    check_lineage(draft, draft_manifest)
    return [input_ref(draft)] + draft_manifest.get("inputs", [])


def start(name: str, *, draft: str | None, params: dict[str, Any], root: Path | None = None
          ) -> tuple[Dataset, dict[str, Any]]:
    """Open bench/NAME for writing (status partial) with lineage to the draft it measures.

    A complete bench/NAME is refused: a benchmark is a record of one run, rerunning it makes a new one.
    A partial one (an interrupted run) is started again from scratch.
    """
    out, manifest = check_start(name, draft=draft, params=params, root=root)
    out.path.mkdir(parents=True, exist_ok=True)
    (out.path / RESULTS).unlink(missing_ok=True)  # a partial run's leftovers are not results
    out.write_manifest(manifest)
    return out, manifest


def check_start(name: str, *, draft: str | None, params: dict[str, Any], root: Path | None = None
                ) -> tuple[Dataset, dict[str, Any]]:
    """start's checks, writing nothing: a bad or complete bench/NAME and a missing, partial or edited draft are
    refused here, which a bench calls before it asks any server (so they are named at once, server up or not)."""
    out = Dataset.parse(name, "bench", root)
    draft_ds, draft_m = open_input(draft, "drafts", root=root) if draft else (None, None)
    manifest = open_output(out, stage=STAGE, params=params, may_change=(), target=(draft_m or {}).get("target"),
                           inputs=lineage(draft_ds, draft_m), resume=False)
    return out, manifest


def _is(value: Any, kind: str, nullable: bool) -> bool:
    if value is None:
        return nullable
    if kind == _STR:
        return isinstance(value, str)
    ok = int if kind == _INT else (int, float)
    return isinstance(value, ok) and not isinstance(value, bool)  # JSON true is no count


def _check_types(block: dict[str, Any], types: dict[str, tuple[str, bool]], prefix: str) -> None:
    for key, (kind, nullable) in types.items():
        if key in block and not _is(block[key], kind, nullable):
            raise DatasetError(f"{prefix}{key} is {block[key]!r}, not {kind}{' or null' if nullable else ''}")


def _check_latency(block: Any, where: str) -> None:
    if not isinstance(block, dict) or any(k not in block for k in _LATENCY_KEYS):
        raise DatasetError(f"{where}: needs {', '.join(_LATENCY_KEYS)}")
    _check_types(block, _LATENCY_TYPES, f"{where}.")
    for k in ("ttft_ms", "itl_ms"):
        if not isinstance(block[k], dict) or {"p50", "p90"} - set(block[k]):
            raise DatasetError(f"{where}.{k}: needs p50 and p90")
        _check_types(block[k], _PERCENTILE_TYPES, f"{where}.{k}.")


def _check_spec(block: Any, where: str) -> None:
    if block is None:
        return
    if not isinstance(block, dict) or any(k not in block for k in _SPEC_KEYS):
        raise DatasetError(f"{where}: needs {', '.join(_SPEC_KEYS)} (or null when the server has no spec metrics)")
    _check_types(block, _SPEC_TYPES, f"{where}.")
    per_position = block["per_position"]  # null for SGLang; an entry is null when no step carried a draft
    if per_position is not None and (not isinstance(per_position, list)
                                     or not all(_is(p, _NUM, True) for p in per_position)):
        raise DatasetError(f"{where}.per_position is {per_position!r}, not a list of numbers (or null)")
    for key in ("acceptance_length", "tokens_per_step"):
        if block.get(key) is not None and block[key] < 1:
            raise DatasetError(f"{where}.{key} is {block[key]}; it counts the target's own token, so it is at "
                               f"least 1")


def validate_results(results: Any, where: str = RESULTS) -> None:
    """Refuse a results record that lacks what `report` and the plot read, or holds it as another type,
    naming the field."""
    if not isinstance(results, dict) or not isinstance(results.get("levels"), list) or not results["levels"]:
        raise DatasetError(f"{where}: needs a non-empty `levels` list")
    if missing := [k for k in ("engine", "server", "prompts") if k not in results]:
        raise DatasetError(f"{where}: needs {', '.join(missing)}")
    _check_types(results, _TOP_TYPES, f"{where}: ")
    for i, level in enumerate(results["levels"]):
        at = f"{where}: levels[{i}]"
        if not isinstance(level, dict) or not _is(level.get("concurrency"), _INT, False):
            raise DatasetError(f"{at}: needs an integer `concurrency`")
        _check_types(level, {"speedup": (_NUM, True)}, f"{at}.")
        _check_latency(level.get("draft"), f"{at}.draft")
        if level.get("baseline") is not None:
            _check_latency(level["baseline"], f"{at}.baseline")
        _check_spec(level.get("spec"), f"{at}.spec")
    _check_spec(results.get("spec"), f"{where}: spec")


def write_results(out: Dataset, manifest: dict[str, Any], results: dict[str, Any], *, stats: dict[str, Any]
                  ) -> dict[str, Any]:
    """Write results.json (the plot, if any, is already in the folder) and mark the dataset complete."""
    validate_results(results)
    write_json_atomic(out.path / RESULTS, results)
    return finalize(out, manifest, stats=stats)


def _read_record(ref: str, root: Path | None, name: str, validate: Any
                 ) -> tuple[Dataset, dict[str, Any], dict[str, Any]]:
    """(dataset, manifest, record NAME) of a complete bench dataset; refuses partial, changed or malformed ones."""
    ds, manifest = open_input(ref, "bench", root=root)
    check_lineage(ds, manifest)
    path = ds.path / name
    check_intact(ds, manifest)  # a record missing, truncated or edited since finalize is not the record
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:  # a manifest that does not list it: another kind of bench record
        raise DatasetError(f"{ds.ref}: no {name}; {remake_fix(ds)}", code="BENCH_MALFORMED", names=ds.ref) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e}); {remake_fix(ds)}") from None
    try:
        validate(record, str(path))
    except DatasetError as e:
        raise DatasetError(f"{e.message}; {remake_fix(ds)}", code=e.code, names=e.names) from None
    return ds, manifest, record


def read_results(ref: str, root: Path | None = None) -> tuple[Dataset, dict[str, Any], dict[str, Any]]:
    """(dataset, manifest, results) of a complete bench dataset; refuses partial, changed or malformed ones."""
    return _read_record(ref, root, RESULTS, validate_results)


# --- a comparison: bench/NAME holding compare.json instead of results.json -------------------------------------
# compare.json:
#     prompts, prompts_sha256, concurrency: [levels]
#     rows: one per way of serving, the target alone first, each
#         label ("target alone", "prompt lookup", "suffix decoding", "drafts/NAME"), method, bench (its own
#         bench/NAME-... dataset, null for the target alone), serve (the make line that deploys it),
#         tokens_per_step, acceptance_length, per_position (nulls where nothing speculates),
#         speedup: {str(level): number or null}
#     recommendation: {label, serve, why}
# inputs (lineage): every row's bench dataset, each of which names its draft and that draft's data.
COMPARE, COMPARE_PLOT = "compare.json", "compare.png"
_ROW_TYPES = {"label": (_STR, False), "method": (_STR, False), "bench": (_STR, True), "serve": (_STR, False),
              "tokens_per_step": (_NUM, True), "acceptance_length": (_NUM, True)}


def validate_compare(compare: Any, where: str = COMPARE) -> None:
    """Refuse a comparison record that lacks what the report and the plot read, naming the field."""
    if not isinstance(compare, dict) or not isinstance(compare.get("rows"), list) or not compare["rows"]:
        raise DatasetError(f"{where}: needs a non-empty `rows` list", code="BENCH_MALFORMED", names=where)
    levels = compare.get("concurrency")
    if not isinstance(levels, list) or not all(_is(c, _INT, False) for c in levels):
        raise DatasetError(f"{where}: needs `concurrency`, a list of integers", code="BENCH_MALFORMED", names=where)
    for i, row in enumerate(compare["rows"]):
        at = f"{where}: rows[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("speedup"), dict):
            raise DatasetError(f"{at}: needs a `speedup` object", code="BENCH_MALFORMED", names=at)
        try:
            _check_types(row, _ROW_TYPES, f"{at}.")
            _check_types(row["speedup"], {str(c): (_NUM, True) for c in levels}, f"{at}.speedup.")
        except DatasetError as e:
            raise DatasetError(e.message, code="BENCH_MALFORMED", names=at) from None
    rec = compare.get("recommendation")
    if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("label", "serve", "why")):
        raise DatasetError(f"{where}: needs `recommendation` with label, serve and why", code="BENCH_MALFORMED",
                           names=where)


def start_compare(name: str, *, benches: list[str], params: dict[str, Any], root: Path | None = None
                  ) -> tuple[Dataset, dict[str, Any]]:
    """Open bench/NAME for a comparison (partial), its inputs the row benches (each complete)."""
    out = Dataset.parse(name, "bench", root)
    inputs = [input_ref(open_input(ref, "bench", root=root)[0]) for ref in benches]
    manifest = open_output(out, stage=STAGE, params=params, may_change=(), target=None, inputs=inputs, resume=False)
    out.path.mkdir(parents=True, exist_ok=True)
    out.write_manifest(manifest)
    return out, manifest


def write_compare(out: Dataset, manifest: dict[str, Any], compare: dict[str, Any], *, stats: dict[str, Any]
                  ) -> dict[str, Any]:
    validate_compare(compare)
    write_json_atomic(out.path / COMPARE, compare)
    return finalize(out, manifest, stats=stats)


def read_compare(ref: str, root: Path | None = None) -> tuple[Dataset, dict[str, Any], dict[str, Any]]:
    """(dataset, manifest, comparison) of a complete comparison; refuses partial, changed or malformed ones."""
    return _read_record(ref, root, COMPARE, validate_compare)


def is_compare(ds: Dataset) -> bool:
    return (ds.path / COMPARE).exists()
