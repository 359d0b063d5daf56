"""A draft folder's model card: `drafts/NAME/README.md`, as the Hugging Face Hub shows it, so the exported
folder can be published as it is. Written by the export from the draft's manifest (target, data, recipe,
lineage, what training measured) and config.json; nothing in it is read back by eyas.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas_common.contract import atomic_output
from eyas_common.drafts import draft_method, read_config, served_spec_tokens

CARD_FILE = "README.md"


def _front_matter(manifest: dict[str, Any], method: str) -> list[str]:
    target = (manifest.get("target") or {}).get("model", "?")
    return ["---", f"base_model: {Path(str(target)).name}", "library_name: vllm", "tags:",
            "- speculative-decoding", f"- {method}", "- eyas", "---", ""]


def _measured(stats: dict[str, Any]) -> list[str]:
    """What training measured on its held-out samples: the acceptance it predicts at each draft length."""
    predicted = stats.get("predicted_acceptance") or {}
    if not predicted:
        return ["No validation samples were held out: nothing was measured during training.", ""]
    rows = [f"| {k} | {v:.2f} |" for k, v in sorted(predicted.items(), key=lambda kv: int(kv[0]))]
    return ["Acceptance length predicted by training's validation replay (held-out samples, greedy):", "",
            "| draft tokens | acceptance length |", "|---|---|", *rows, "",
            "Measure it served with `eyas-serve compare` (or `make compare`) on your own prompts.", ""]


def model_card(manifest: dict[str, Any], config: dict[str, Any], name: str, *, method: str, spec_tokens: int) -> str:
    """The card's text: `method` and `spec_tokens` as the draft is served (eyas_common.drafts)."""
    target = manifest.get("target") or {}
    params, stats = manifest.get("params") or {}, manifest.get("stats") or {}
    lineage = [i.get("ref", "?") for i in manifest.get("inputs") or []]
    producer = manifest.get("producer") or {}
    recipe = {k: params[k] for k in sorted(params) if not isinstance(params[k], (dict, list)) and k not in
              ("model", "hidden", "name")}
    lines = _front_matter(manifest, method) + [
        f"# {name}: a speculative-decoding draft for {Path(str(target.get('model', '?'))).name}", "",
        f"Trained by eyas from the target's own answers. Architecture `{(config.get('architectures') or ['?'])[0]}`, "
        f"hidden size {config.get('hidden_size')}, a {config.get('draft_vocab_size', config.get('vocab_size'))}-token "
        f"draft vocabulary, aux layers {config.get('eagle_aux_hidden_state_layer_ids', '-')}.", "",
        "## Serve it", "", "```bash",
        f"vllm serve TARGET --speculative-config '{{\"method\": \"{method}\", \"model\": \"DRAFT\", "
        f"\"num_speculative_tokens\": {spec_tokens}}}'", "```", "",
        "## Target", "", f"- model: `{target.get('model')}`", f"- tokenizer sha256: `{target.get('tokenizer_sha256')}`",
        f"- chat template sha256: `{target.get('chat_template_sha256')}`", "",
        "## Data and lineage", "", *(f"- `{ref}`" for ref in lineage), "",
        f"Steps {stats.get('steps')}, training {stats.get('train_s')} s, draft vocabulary coverage "
        f"{stats.get('vocab_coverage')}.", "",
        "## Measured", "", *_measured(stats),
        "## Recipe", "", "```json", json.dumps(recipe, indent=1, sort_keys=True), "```", "",
        f"Made by {producer.get('stage', 'eyas')} {producer.get('version', '')} "
        f"({producer.get('image') or producer.get('git') or 'no version'}).", ""]
    return "\n".join(lines)


def write_model_card(folder: Path, manifest: dict[str, Any], name: str) -> Path:
    """README.md in the draft folder, beside its config.json (read for the architecture and sizes)."""
    path = folder / CARD_FILE
    with atomic_output(path) as tmp:
        tmp.write_text(model_card(manifest, read_config(folder), name, method=draft_method(folder),
                                  spec_tokens=served_spec_tokens(folder)))
    return path
