"""eyas-synth validate: check every sample of a synth dataset structurally, with a per-sample report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import DatasetError, check_intact, check_target, open_input
from eyas_common.samples import SAMPLES, bad_line_fix, validate_synth_file


def validate(name: str, *, model: Path | None = None, trust_remote_code: bool = False,
             data_root: Path | None = None) -> dict[str, Any]:
    """{'samples': n, 'bad': [(id, problems)], 'status': ...}; the tokenizer defaults to the dataset's target.

    A dataset the next stage would refuse (partial, edited after it was finished, a malformed manifest) is refused
    here first, by the contract's checks of a finished dataset, so a pass means eyas-extract takes it."""
    ds, manifest = open_input(name, "synth", root=data_root)
    check_intact(ds, manifest)
    model = model or (manifest.get("target") or {}).get("model")
    if not model:
        raise DatasetError(f"{ds.ref}: its manifest names no target model; pass the target's folder with --model")
    tokenizer = load_tokenizer(Path(model), trust_remote_code)
    check_target(ds, manifest, target_fingerprint(tokenizer, Path(model)))
    path = ds.path / SAMPLES
    if not path.exists():
        raise DatasetError(f"{ds.ref}: no {SAMPLES}; make it with eyas-synth run")
    n, bad = validate_synth_file(path, tokenizer, fix=bad_line_fix(ds, manifest))
    return {"samples": n, "bad": bad, "status": manifest.get("status")}
