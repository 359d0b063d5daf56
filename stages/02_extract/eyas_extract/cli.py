"""eyas-extract: the click CLI, a thin layer over eyas_extract.run."""

from __future__ import annotations

import re
from pathlib import Path

import click

from eyas_common.cli_errors import EyasGroup, Finite
from eyas_common.methods import METHODS
from eyas_common.launch import INTERRUPTED
from eyas_extract.config import AUX_DTYPES, BACKENDS, TEACHERS, ExtractOptions

# eyas_extract.run (torch, transformers) is imported by the commands, not here: a Ctrl-C during those seconds of
# imports then ends in the commands' one line, not in a traceback from the middle of an import.

D = ExtractOptions.__dataclass_fields__  # the defaults shown in --help are the options' own


def _layers(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(x) for x in value.replace(" ", "").split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated layer ids, e.g. 2,30,58") from None


# The sizes accelerate takes as text, unit spelled as here: its lower-case `b` would mean bits (80Gb = 10 GB),
# and a bare number, which it refuses as text, would fail only once the target loads.
MEMORY_UNITS = {u.lower(): u for u in ("GiB", "MiB", "KiB", "GB", "MB", "KB")}
MEMORY_SIZE = re.compile(r"(\d+(?:\.\d+)?)(" + "|".join(MEMORY_UNITS) + ")", re.IGNORECASE)


def _max_memory(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, str] | None:
    if not value:
        return None
    budget = {}
    items = value.replace(" ", "").split(",")
    for item in items:
        device, _, size = item.partition("=")
        found = MEMORY_SIZE.fullmatch(size)
        if not (device.isdigit() or device in ("cpu", "disk")) or not found or float(found[1]) <= 0:
            where = f"{item!r} in {value!r}" if len(items) > 1 else repr(value)
            raise click.BadParameter(f"{where}: expected DEVICE=SIZE pairs, DEVICE a GPU index, cpu or disk, SIZE "
                                     f"in GiB, MiB, GB or MB, e.g. 0=80GiB,1=80GiB,cpu=200GiB")
        budget[device] = found[1] + MEMORY_UNITS[found[2].lower()]
    return budget


class DiskSize(click.ParamType):
    """A size in bytes, as eyas_common.hidden spells a disk budget: 50G, 500M, 2T, 1.5GB or a number."""

    name = "SIZE"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        from eyas_common.hidden import parse_size

        try:
            size = parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if size <= 0:
            self.fail(f"{value!r}: a budget must be above 0", param, ctx)
        return size


@click.group(cls=EyasGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main() -> None:
    """Stage 02: synth samples -> the target's EAGLE-3 hidden states in $EYAS_DATA/hidden/NAME."""


@main.command()
@click.option("--synth", required=True, help="Input synth dataset, synth/NAME (complete, or still being written with --follow).")
@click.option("--model", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="Local path of the target the synth dataset was made with (same tokenizer and chat template).")
@click.option("--name", required=True, help="Dataset name: writes $EYAS_DATA/hidden/NAME (resumes it if present).")
@click.option("--backend", type=click.Choice(BACKENDS), default=D["backend"].default,
              help="hf: transformers + forward hooks (any model, CPU too); vllm: vLLM's extract_hidden_states (needs vLLM in this Python).")
@click.option("--layers", callback=_layers, default=None,
              help="Aux layer ids, comma-separated: id k = HF hidden_states[k], the residual stream entering layer k.  [default: from --method]")
@click.option("--method", type=click.Choice(METHODS), default=D["method"].default,
              help="The draft the states are for; it picks the default --layers: eagle3 2,L//2,L-3; dflash five layer "
                   "outputs spread from shallow to deep (aux ids 2 .. L-2), so about 5/3 of eagle3's disk.")
@click.option("--teacher", type=click.Choice(TEACHERS), default=D["teacher"].default,
              help="final: store the final normed hidden state (H values/token); topk: store the target's top-K log-probs.")
@click.option("--topk", type=click.IntRange(min=1), default=D["topk"].default, help="K for --teacher topk: log-probs (float32) and ids (int32) per token.")
@click.option("--aux-dtype", type=click.Choice(AUX_DTYPES), default=D["aux_dtype"].default,
              help="Stored aux dtype; fp8 = float8_e4m3fn + one float32 scale per token and layer. fp32 also stores final in fp32.")
@click.option("--shard", default=D["shard"].default, help="I/N: this host does shards j with j mod N == I (torchrun ranks split it further).")
@click.option("--shard-samples", type=click.IntRange(min=1), default=D["shard_samples"].default,
              help="At most this many samples per shard (the unit of resume).")
@click.option("--shard-mb", type=click.IntRange(min=1), default=D["shard_mb"].default,
              help="At most this many MiB per shard (sets the shard's token budget).")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=D["batch_tokens"].default,
              help="Padded tokens per forward (batch size x longest sample); fixed for a dataset, like the shard options.")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default=D["dtype"].default,
              help="Compute dtype of the target; auto: bf16 on GPU, fp32 on CPU.")
@click.option("--device", default=D["device"].default, help="hf backend: cpu, cuda, cuda:1, ...; auto: cuda if present (cuda:LOCAL_RANK under torchrun).")
@click.option("--attn", type=click.Choice(["auto", "flash_attention_2", "sdpa", "eager"]), default=D["attn"].default,
              help="hf backend attention; auto: flash_attention_2 when flash-attn is installed on GPU, else sdpa.")
@click.option("--device-map", default=None, show_default=False,
              help="hf backend: transformers device_map (e.g. auto) for a target larger than one GPU.  [default: none "
                   "when a copy fits one device, else a device map over every GPU]")
@click.option("--trust-remote-code", is_flag=True, help="Run modelling/tokenizer code shipped with the target (explicit opt-in).")
@click.option("--allow-code-change", is_flag=True,
              help="Resume a dataset started by another eyas version (git sha / image tag); recorded in the manifest.")
@click.option("--max-memory", callback=_max_memory, default=None,
              help="With a device_map: budget per device (GPU index, cpu or disk; GiB, MiB, GB or MB), e.g. "
                   "0=80GiB,1=80GiB,cpu=200GiB.  [default: the planner's, 90% of each]")
@click.option("--devices", default=None,
              help="Plan for this machine instead of the detected one: NxSIZE (8x96GB) or cpu:SIZE (with --dry-run).")
@click.option("--dry-run", is_flag=True,
              help="Print the placement plan, the disk bill and the estimated time, then stop (nothing loaded).")
@click.option("--follow", is_flag=True,
              help="Take a synth dataset still being written: extract each shard as soon as every id up to it is "
                   "decided (kept, set aside or rejected), list it in the partial manifest, end when synth is complete. "
                   "Exits 1 when synth stops partial. One worker: no --shard, no torchrun.")
@click.option("--poll-seconds", type=Finite(min=0, min_open=True), default=D["poll_seconds"].default,
              help="With --follow: seconds between two reads of the synth dataset's files.")
@click.option("--disk-budget", type=DiskSize(), default=None,
              help="With --follow: before each shard, wait while the shards not yet consumed by training "
                   "(eyas-train run --follow --consume) and the next one would exceed SIZE (50G, 500M, 2T: "
                   "decimal units; 40GiB: binary; or bytes).  [default: no limit]")
@click.option("--consumer-grace", type=Finite(min=0), default=D["consumer_grace"].default, show_default=True,
              help="With --disk-budget: seconds to wait with no training run holding the consumer lock "
                   "(eyas-train run --consume) before stopping with [NO_CONSUMER]; a rerun resumes.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run(quiet: bool, **kwargs) -> None:
    """Run the target over every sample; store aux states and the teacher signal in safetensors shards.

    Prints the disk bill first and refuses when the volume cannot hold it. Rerun the same command to
    resume: finished shards are kept, a killed shard is redone. With --follow the shards are the same,
    byte for byte, as a run over the finished synth dataset makes.
    """
    try:
        from eyas_extract.run import run as run_extract

        run_extract(ExtractOptions(**kwargs), progress=not quiet)
    except KeyboardInterrupt:  # before the extraction started (which says what it kept itself)
        _interrupted("the shards already made are kept; rerun the same command to resume")


def _interrupted(what: str) -> None:
    click.echo(f"[extract] interrupted: {what}", err=True)
    raise SystemExit(INTERRUPTED)


@main.command("finalize")
@click.argument("name")
def finalize_cmd(name: str) -> None:
    """Mark hidden/NAME complete once every --shard part has written its shards (merges their stats)."""
    try:
        from eyas_extract.run import finalize_dataset

        finalize_dataset(name)
    except KeyboardInterrupt:  # the manifest is replaced atomically: it is as it was, or complete
        _interrupted(f"rerun `eyas-extract finalize {name}`")


if __name__ == "__main__":
    main()
