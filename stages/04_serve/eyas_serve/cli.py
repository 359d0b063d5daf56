"""eyas-serve: serve a target with its EAGLE-3 draft (vLLM / SGLang), benchmark it, report the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click

from eyas_common.cli_errors import EyasGroup, Finite
from eyas_common.prompts import PROMPTS_HELP
from eyas_serve.config import ENGINES, LaunchConfig

L = LaunchConfig.__dataclass_fields__  # defaults shown in --help come from the config itself


def _url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An http(s)://HOST[:PORT] URL, checked before any request: without it a missing scheme reads as a server
    that does not answer (`is the server running?`), and a malformed port as a traceback."""
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: not a URL ({e}); e.g. http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        hint = f"http://{value}" if "://" not in value and value else "http://127.0.0.1:8000"
        raise click.BadParameter(f"{value!r}: expected an http:// or https:// URL of the server, e.g. {hint}")
    if port == 0:
        raise click.BadParameter(f"{value!r}: port 0 is no server's port; e.g. http://127.0.0.1:8000")
    return value


@click.group(cls=EyasGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main() -> None:
    """Stage 04: target + drafts/NAME on vLLM or SGLang -> bench/NAME (acceptance, tokens/s, speedup)."""


@main.command(context_settings={"show_default": True})
@click.option("--engine", type=click.Choice(ENGINES), default="vllm", help="Serving engine.")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Target folder (local): served, and its tokenizer is checked against the draft's.")
@click.option("--draft", default=None, help="Draft dataset drafts/NAME.  [default: none: serve the baseline]")
@click.option("--spec-tokens", type=click.IntRange(1, 16), default=None, show_default=False,
              help="Draft tokens proposed per verification step.  [default: the draft's own: EAGLE-3 3, DFlash "
                   "its block size - 1; prompt lookup 3]")
@click.option("--prompt-lookup", is_flag=True,
              help="Serve vLLM's n-gram prompt lookup instead of a draft (tokens copied from the request's own "
                   "earlier tokens, 2- to 4-grams, K 3 unless --spec-tokens; nothing trained): the reference a "
                   "trained draft has to beat on `eyas-serve bench`'s tokens per target step. vLLM only.")
@click.option("--tp", type=click.IntRange(1, 1024), default=L["tp"].default, help="Tensor-parallel GPUs.")
@click.option("--host", default=L["host"].default, help="Address to listen on (0.0.0.0 for other hosts).")
@click.option("--port", type=click.IntRange(1, 65535), default=L["port"].default, help="HTTP port.")
@click.option("--health-timeout", "health_timeout_s", type=Finite(min=1),
              default=L["health_timeout_s"].default, help="Seconds to wait for /health before giving up.")
@click.option("--log", default="", show_default=False, type=click.Path(dir_okay=False),
              help="Engine log file.  [default: serve-ENGINE-PORT.log here]")
@click.option("--python", default="", show_default=False, help="Interpreter that has the engine.  [default: vLLM: $EYAS_VLLM_PYTHON, "
              "else ./.venv-vllm, else this one; SGLang: this one]")
@click.option("--nccl-p2p-disable", is_flag=True,
              help="Set NCCL_P2P_DISABLE=1: multi-GPU Blackwell workstations (RTX PRO 6000, 5090) hang in "
                   "peer-to-peer all-reduce without it. Not needed on NVLink servers.")
@click.option("--disable-custom-all-reduce", is_flag=True,
              help="Engine's custom all-reduce kernel off (NCCL only); with --nccl-p2p-disable on the same hosts.")
@click.option("--trust-remote-code", is_flag=True,
              help="Run the model/tokenizer code shipped with the target (Kimi-K2.5); explicit opt-in, passed to the engine.")
@click.option("--print", "print_only", is_flag=True, help="Print the engine command (after the checks); start nothing.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
def launch(print_only: bool, engine_args: tuple[str, ...], **kw) -> None:
    """Start the engine with target + draft and serve until Ctrl-C / SIGTERM; flags after `--` go to the engine.

    \b
    eyas-serve launch --model /models/T --draft drafts/D -- --max-model-len 8192
    eyas-serve launch --model /models/T --prompt-lookup --port 8002   (vLLM's n-gram reference, no draft)
    A draft made for another target (tokenizer or hidden size) is refused before anything starts.
    """
    from eyas_serve.launch import launch as run_launch, print_command

    cfg = LaunchConfig(engine_args=tuple(engine_args), **kw)
    if print_only:
        click.echo(print_command(cfg))
        return
    sys.exit(run_launch(cfg, ready=lambda server: click.echo(server.url)))


def _levels(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers, e.g. 1,4,16") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{value!r}: every level must be >= 1 request in flight")
    return levels


@main.command(context_settings={"show_default": True})
@click.option("--server", required=True, callback=_url,
              help="URL of the server with the draft, e.g. http://127.0.0.1:8000.")
@click.option("--baseline", default=None, callback=_url,
              help="URL of the same target without a draft: speedup is measured against it.  [default: none: no "
                   "speedup]")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Held-out prompts: " + PROMPTS_HELP)
@click.option("--name", required=True, help="Output dataset bench/NAME.")
@click.option("--draft", default=None, help="drafts/NAME the server runs: lineage in the manifest.")
@click.option("--concurrency", default="1,4,16", callback=_levels,
              help="Requests in flight, comma-separated levels, each measured in turn.")
@click.option("--num-prompts", type=click.IntRange(0, 100_000), default=0,
              help="Requests per level (prompts reused in order), at most 100,000; 0 = every prompt once.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, help="Completion budget per request, tokens.")
@click.option("--temperature", type=Finite(min=0), default=0.0,
              help="Sampling temperature; 0 (greedy) makes acceptance a property of the draft alone.")
@click.option("--timeout", "timeout_s", type=Finite(min=1), default=600.0, help="Per-request timeout, seconds.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, help="Unmeasured requests per server first.")
@click.option("--engine", type=click.Choice(ENGINES), default=None, help="Engine of both servers.  [default: detected]")
def bench(**kw) -> None:
    """Replay held-out prompts at each concurrency on the draft server (and the baseline); write bench/NAME."""
    from eyas_serve.bench import run as run_bench
    from eyas_serve.report import table
    from eyas_common.bench import read_results

    try:
        run_bench(**kw)
    except KeyboardInterrupt:
        sys.exit(130)
    except ConnectionError as e:
        raise click.ClickException(str(e)) from None
    _, manifest, results = read_results(kw["name"])
    click.echo(table(results, manifest))


@main.command(context_settings={"show_default": True})
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Target folder (local): served alone, then with each candidate.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Held-out prompts: " + PROMPTS_HELP)
@click.option("--name", required=True, help="Output dataset bench/NAME (each row: bench/NAME-LABEL).")
@click.option("--draft", "drafts", multiple=True, help="drafts/NAME to compare (repeat for several).")
@click.option("--prompt-lookup/--no-prompt-lookup", default=True, help="Compare vLLM's n-gram prompt lookup.")
@click.option("--suffix/--no-suffix", default=True,
              help="Compare vLLM's suffix decoding, where the engine's interpreter has arctic_inference.")
@click.option("--concurrency", default="1,4,16", callback=_levels, help="Requests in flight, comma-separated.")
@click.option("--num-prompts", type=click.IntRange(0, 100_000), default=0,
              help="Requests per level (prompts reused in order); 0 = every prompt once.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, help="Completion budget per request, tokens.")
@click.option("--port", type=click.IntRange(1, 65534), default=8100,
              help="The target alone listens here; each candidate on PORT + 1 in turn.")
@click.option("--python", default="", show_default=False, help="Interpreter that has vLLM.  [default: as launch]")
@click.option("--health-timeout", "health_timeout_s", type=Finite(min=1), default=L["health_timeout_s"].default,
              help="Seconds to wait for each server's /health.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
def compare(engine_args: tuple[str, ...], python: str, health_timeout_s: float, **kw) -> None:
    """Which speculation to deploy: the target alone, prompt lookup, suffix decoding and each draft, measured
    side by side on your held-out prompts; write bench/NAME with the table, a plot and the make line.

    \b
    eyas-serve compare --model /models/T --prompts heldout.jsonl --name cmp --draft drafts/D -- --max-model-len 4096
    """
    from eyas_serve.compare import CompareConfig, run as run_compare
    from eyas_serve.report import compare_table

    launch = LaunchConfig(engine="vllm", model=kw["model"], python=python, health_timeout_s=health_timeout_s,
                          engine_args=tuple(engine_args))
    cfg = CompareConfig(**{**kw, "drafts": tuple(kw["drafts"]), "prompts": str(kw["prompts"])}, launch=launch)
    try:
        click.echo(compare_table(run_compare(cfg)))
    except KeyboardInterrupt:
        sys.exit(130)
    except ConnectionError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print results.json (or compare.json) instead of the table.")
def report(ref: str, as_json: bool) -> None:
    """Print the table of bench dataset REF (bench/NAME or NAME): a bench, or a comparison."""
    from eyas_common.bench import is_compare, read_compare, read_results
    from eyas_common.contract import Dataset
    from eyas_serve.report import compare_table, table

    if ref and is_compare(Dataset.parse(ref.removeprefix("bench/"), "bench")):
        _, _, compare = read_compare(ref)
        click.echo(json.dumps(compare, indent=2) if as_json else compare_table(compare))
        return
    _, manifest, results = read_results(ref)  # a plain NAME is bench/NAME; "" is refused as no name
    click.echo(json.dumps(results, indent=2) if as_json else table(results, manifest))


if __name__ == "__main__":
    main()
