"""eyas-synth validate: check every sample of a synth dataset structurally, with a per-sample report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import Dataset, DatasetError, check_schema, check_target
from eyas_common.samples import validate_synth_file
from eyas_common.samples import SAMPLES


def validate(name: str, *, model: Path | None = None, trust_remote_code: bool = False,
             data_root: Path | None = None) -> dict[str, Any]:
    """{'samples': n, 'bad': [(id, problems)], 'status': ...}; the tokenizer defaults to the dataset's target."""
    ds = Dataset.parse(name, "synth", data_root)
    manifest = ds.read_manifest()
    check_schema(ds, manifest)
    model = model or Path(manifest["target"]["model"])
    tokenizer = load_tokenizer(model, trust_remote_code)
    check_target(ds, manifest, target_fingerprint(tokenizer, model))
    path = ds.path / SAMPLES
    if not path.exists():
        raise DatasetError(f"{ds.ref}: no {SAMPLES}; make it with eyas-synth run")
    n, bad = validate_synth_file(path, tokenizer)
    return {"samples": n, "bad": bad, "status": manifest.get("status")}
