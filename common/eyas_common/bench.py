"""The bench dataset `bench/NAME/`: a served draft measured against its target (stage 04 writes it).

Files of a bench dataset:
    results.json   what was measured (below), validated on write and on read
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

from eyas_common.contract import (REMAKE, Dataset, DatasetError, finalize, input_ref, open_input, open_output,
                                  write_json_atomic)

RESULTS, PLOT = "results.json", "bench.png"
STAGE = "04_serve"
_LATENCY_KEYS = ("requests", "errors", "output_tokens", "duration_s", "tokens_per_s", "ttft_ms", "itl_ms")
_SPEC_KEYS = ("drafts", "draft_tokens", "accepted", "acceptance_length", "per_position")


def lineage(draft: Dataset | None, draft_manifest: dict[str, Any] | None) -> list[dict[str, str]]:
    """The draft itself, then what it was made from (its hidden and synth datasets)."""
    if draft is None or draft_manifest is None:
        return []
    return [input_ref(draft)] + [i for i in draft_manifest.get("inputs", []) if isinstance(i, dict)]


def start(name: str, *, draft: str | None, params: dict[str, Any], root: Path | None = None
          ) -> tuple[Dataset, dict[str, Any]]:
    """Open bench/NAME for writing (status partial) with lineage to the draft it measures.

    A complete bench/NAME is refused: a benchmark is a record of one run, rerunning it makes a new one.
    A partial one (an interrupted run) is started again from scratch.
    """
    out = Dataset.parse(name, "bench", root)
    draft_ds, draft_m = open_input(draft, "drafts", root=root) if draft else (None, None)
    manifest = open_output(out, stage=STAGE, params=params, may_change=(), target=(draft_m or {}).get("target"),
                           inputs=lineage(draft_ds, draft_m), resume=False)
    out.path.mkdir(parents=True, exist_ok=True)
    (out.path / RESULTS).unlink(missing_ok=True)  # a partial run's leftovers are not results
    out.write_manifest(manifest)
    return out, manifest


def _check_latency(block: Any, where: str) -> None:
    if not isinstance(block, dict) or any(k not in block for k in _LATENCY_KEYS):
        raise DatasetError(f"{where}: needs {', '.join(_LATENCY_KEYS)}")
    for k in ("ttft_ms", "itl_ms"):
        if not isinstance(block[k], dict) or {"p50", "p90"} - set(block[k]):
            raise DatasetError(f"{where}.{k}: needs p50 and p90")


def _check_spec(block: Any, where: str) -> None:
    if block is None:
        return
    if not isinstance(block, dict) or any(k not in block for k in _SPEC_KEYS):
        raise DatasetError(f"{where}: needs {', '.join(_SPEC_KEYS)} (or null when the server has no spec metrics)")
    for key in ("acceptance_length", "tokens_per_step"):
        if block.get(key) is not None and block[key] < 1:
            raise DatasetError(f"{where}.{key} is {block[key]}; it counts the target's own token, so it is at "
                               f"least 1")


def validate_results(results: Any, where: str = RESULTS) -> None:
    """Refuse a results record that lacks what `report` and the plot read, naming the field."""
    if not isinstance(results, dict) or not isinstance(results.get("levels"), list) or not results["levels"]:
        raise DatasetError(f"{where}: needs a non-empty `levels` list")
    for i, level in enumerate(results["levels"]):
        at = f"{where}: levels[{i}]"
        if not isinstance(level, dict) or not isinstance(level.get("concurrency"), int):
            raise DatasetError(f"{at}: needs an integer `concurrency`")
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


def read_results(ref: str, root: Path | None = None) -> tuple[Dataset, dict[str, Any], dict[str, Any]]:
    """(dataset, manifest, results) of a complete bench dataset; refuses partial or malformed ones."""
    ds, manifest = open_input(ref, "bench", root=root)
    path = ds.path / RESULTS
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{ds.ref}: no {RESULTS}; rerun {REMAKE['bench']}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON ({e}); rerun {REMAKE['bench']}") from None
    validate_results(results, str(path))
    return ds, manifest, results
