"""`eyas-train export`: a draft's checkpoint written out again as config.json + model.safetensors, into the draft
or into a new complete snapshot, by the method that trained it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.checkpoint import read_text_config
from eyas_common.contract import REMAKE, Dataset, DatasetError, check_target, finalize, input_ref, new_manifest, \
    open_input
from eyas_common.drafts import read_checkpoint, readable_checkpoint, target_mismatch
from eyas_common.lock import WriterLock
from eyas_common.model_card import write_model_card
from eyas_train.checkpoints import checkpoints
from eyas_train.methods import REGISTRY
from eyas_train.state import say


def export_checkpoint(name: str, *, step: int | None = None, out: str | None = None, model: str | Path | None = None,
                      data_root: Path | None = None) -> Path:
    """Export checkpoint `step` (default: the newest) of drafts/NAME into NAME, or into a new drafts/OUT.

    Into NAME, the dataset becomes complete only when the checkpoint is the run's last step (an earlier
    step is written but the status stays partial); drafts/OUT is a complete snapshot with its own lineage.
    A failed export into OUT removes the folder it made, so the same command can be run again. `model`: the
    target's folder where it is now (default: where it was when the draft was trained).
    """
    src, m = open_input(name, "drafts", allow_partial=True, root=data_root)  # an unknown schema is refused
    found = {int(p.stem.removeprefix("step-")): p for p in checkpoints(src.path)}
    chosen = max(found) if step is None and found else step
    if chosen not in found:
        raise DatasetError(f"{src.ref}: no checkpoint at step {chosen}; have {sorted(found) or 'none'}")
    target = _export_target(src, m, model)
    dest = src if out is None else Dataset.parse(out, "drafts", data_root)
    with WriterLock(dest, stage="03_train export"):
        if dest != src and (dest.path.exists() or dest.path.is_symlink()):
            raise DatasetError(f"--out {dest.ref}: {dest.path} already exists; export never overwrites a dataset: "
                               f"pick another --out, or delete it first with `eyas-data rm {dest.ref}`")
        try:
            return _export(src, m, dest, chosen, _export_checkpoint(found, chosen), target)
        except BaseException:
            if dest != src:  # it did not exist before (above), so all of it is this export's own
                shutil.rmtree(dest.path, ignore_errors=True)
            raise


def _export_checkpoint(found: dict[int, Path], chosen: int) -> dict[str, Any]:
    """Checkpoint `chosen` of `found` (step -> path); an unreadable one is refused naming a readable step."""
    try:
        return read_checkpoint(found[chosen])
    except DatasetError as e:
        good = readable_checkpoint([found[k] for k in sorted(found) if k != chosen])
        step = {path: k for k, path in found.items()}.get(good)
        instead = (f"export --step {step}, the newest readable checkpoint, instead (and delete the damaged one)"
                   if good else f"no other checkpoint is readable: delete it and retrain with {REMAKE['drafts']}")
        raise DatasetError(f"{e.message}; {instead}") from None


def _export_target(src: Dataset, m: dict[str, Any], model: str | Path | None) -> dict[str, Any]:
    """The (text) config of the target the draft was trained for, which export writes token ids and dtype from:
    from `model` (checked against the draft's target), else from where the target was at training time."""
    trained = m["params"]["config"]["model"]
    try:
        target = read_text_config(model or trained)
    except (OSError, ValueError) as e:  # moved or deleted since; a malformed config.json
        fix = "pass --model with the target's folder where it is now" if model is None else \
            f"pass the target {src.ref} was trained for (at {trained} then)"
        raise DatasetError(f"{src.ref} was trained for the target at {trained}: {e}; {fix}") from None
    if model is not None:
        check_target(src, m, target_fingerprint(load_tokenizer(model), model))
        differ = target_mismatch(target, m["params"]["draft"])
        if differ:
            raise DatasetError(f"--model {model} is not the target {src.ref} was trained for: its config.json has "
                               f"{', '.join(differ)}; pass that target (at {trained} then)")
    return target


def _export(src: Dataset, m: dict[str, Any], dest: Dataset, chosen: int, ckpt: dict[str, Any],
            target: dict[str, Any]) -> Path:
    p = m["params"]
    state = {k.removeprefix("draft."): v for k, v in ckpt["model"].items()}
    REGISTRY[p["config"].get("method", "eagle3")].reexport(dest.path, state, p, target)
    stats = {**m.get("stats", {}), "exported_step": chosen}
    if dest == src:
        write_model_card(dest.path, {**m, "stats": stats}, dest.name)
        if chosen == p["total_steps"] or m.get("status") == "complete":  # a complete one's files are hashed again
            finalize(src, m, stats=stats)
        else:
            m["stats"] = stats
            src.write_manifest(m)
            say(f"exported step {chosen} of {p['total_steps']} into {src.ref}; it stays partial "
                       f"(training unfinished): use --out NAME for a complete snapshot")
    else:
        snap = new_manifest("drafts", stage="03_train", target=m.get("target"),
                            inputs=[input_ref(src)] + m.get("inputs", []), params={**p, "exported_from": src.ref})
        dest.path.mkdir(parents=True, exist_ok=True)
        write_model_card(dest.path, {**snap, "stats": stats}, dest.name)
        finalize(dest, snap, stats=stats)
    return dest.path
