"""`eyas-serve compare`: which speculation to deploy, answered on the user's own held-out prompts.

The target is served alone (the baseline, up for the whole run), then each candidate in turn on a second
port: vLLM's n-gram prompt lookup (nothing trained), vLLM's suffix decoding where the engine's interpreter
has it, and each draft named. Every candidate is an ordinary `eyas-serve launch` (what `make serve` runs)
measured by an ordinary `eyas-serve bench` against the baseline (bench/NAME-LABEL, with its lineage), so a
row here is exactly what a user would measure by hand. bench/NAME then holds the table (compare.json, whose
format eyas_common.bench owns), a plot, and the recommendation with the make line that deploys it.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from eyas_common.bench import COMPARE_PLOT, check_start, read_results, start_compare, write_compare
from eyas_common.contract import Dataset, DatasetError, data_root as default_root, sha256_file
from eyas_common.lock import WriterLock
from eyas_serve import bench
from eyas_serve.config import LaunchConfig
from eyas_serve.engines import engine_python
from eyas_serve.launch import check_port_free, plan
from eyas_serve.process import start_server, stop, wait_healthy

SUFFIX_MODULE = "arctic_inference"  # what vLLM's suffix decoding imports
ALONE = "target alone"


@dataclass(frozen=True)
class CompareConfig:
    name: str                              # output dataset bench/NAME (rows: bench/NAME-LABEL)
    model: str                             # target folder (local path)
    prompts: str                           # held-out prompts
    drafts: tuple[str, ...] = ()           # drafts/NAME to compare, each served in turn
    prompt_lookup: bool = True             # vLLM's n-gram prompt lookup (nothing trained)
    suffix: bool = True                    # vLLM's suffix decoding, where the engine's interpreter has it
    concurrency: tuple[int, ...] = (1, 4, 16)
    num_prompts: int = 0                   # requests per level; 0 = every prompt once
    max_tokens: int = 256
    port: int = 8100                       # the baseline's port; candidates use port + 1
    launch: LaunchConfig = field(default_factory=lambda: LaunchConfig(engine="vllm", model=""))


@dataclass(frozen=True)
class Candidate:
    label: str                             # row name and the bench dataset's suffix
    method: str                            # eagle3 / dflash / ngram / suffix
    launch: LaunchConfig
    serve: str                             # the make line that deploys it


def say(msg: str) -> None:
    click.echo(f"[eyas-serve compare] {msg}", err=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def has_suffix_decoding(cfg: CompareConfig) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({SUFFIX_MODULE!r}) is None)"
    return subprocess.run([engine_python(cfg.launch), "-c", probe], capture_output=True).returncode == 0


def candidates(cfg: CompareConfig) -> list[Candidate]:
    """Each way of serving the target to compare, in the order served."""
    base = replace(cfg.launch, model=cfg.model, port=cfg.port + 1)
    make = f"make serve MODEL={cfg.model}"
    out = []
    if cfg.prompt_lookup:
        out.append(Candidate("prompt lookup", "ngram", replace(base, prompt_lookup=True), f"{make} PROMPT_LOOKUP=1"))
    if cfg.suffix and has_suffix_decoding(cfg):
        args = ("--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}')
        out.append(Candidate("suffix decoding", "suffix", replace(base, engine_args=base.engine_args + args),
                             f"{make} ENGINE_ARGS='{' '.join(args[:1])} {args[1]}'"))
    elif cfg.suffix:
        say(f"suffix decoding left out: the engine's interpreter has no {SUFFIX_MODULE} (pip install it there)")
    for draft in cfg.drafts:
        out.append(Candidate(draft, "draft", replace(base, draft=draft), f"{make} DRAFT={draft}"))
    return out


def _bench_name(cfg: CompareConfig, label: str) -> str:
    return f"{cfg.name}-{_slug(label.removeprefix('drafts/'))}"


def _serve(launch: LaunchConfig, log: Path):
    cmd, env = plan(launch)  # the draft checked against the target first, as `eyas-serve launch` does
    check_port_free(launch.host, launch.port)
    server = start_server(cmd, port=launch.port, log_path=log, env=env, host=launch.host)
    try:
        wait_healthy(server, launch.health_timeout_s)
    except (RuntimeError, TimeoutError) as e:
        stop(server)
        raise DatasetError(f"{launch.draft or 'the server'} did not start ({str(e).splitlines()[0]}); see {log}",
                           code="SERVE_START_FAILED", names=str(log)) from None
    return server


def _row(c: Candidate | None, results: dict[str, Any] | None, ref: str | None, cfg: CompareConfig) -> dict:
    """One table row; the target alone makes one step per token and is its own baseline."""
    if c is None:
        return {"label": ALONE, "method": "none", "bench": None, "serve": f"make serve MODEL={cfg.model}",
                "tokens_per_step": 1.0, "acceptance_length": None, "per_position": None,
                "speedup": {str(lv): 1.0 for lv in cfg.concurrency}}
    spec = results.get("spec") or {}
    return {"label": c.label, "method": results.get("method", c.method), "bench": ref, "serve": c.serve,
            "tokens_per_step": spec.get("tokens_per_step"), "acceptance_length": spec.get("acceptance_length"),
            "per_position": spec.get("per_position"),
            "speedup": {str(lv["concurrency"]): lv["speedup"] for lv in results["levels"]}}


def recommend(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The row with the best geometric-mean speedup over the levels; the target alone unless one beats 1."""
    def score(row: dict[str, Any]) -> float:
        vals = [v for v in row["speedup"].values() if v]
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else 0.0
    best = max(rows, key=score)
    s = score(best)
    if best["label"] == ALONE or s <= 1.0:
        return {"label": ALONE, "serve": rows[0]["serve"],
                "why": "no speculation was faster than the target alone at these concurrencies"}
    levels = ", ".join(f"{v:.2f}x at {k}" for k, v in best["speedup"].items() if v)
    return {"label": best["label"], "serve": best["serve"], "why": f"the fastest: {levels} in flight"}


def run(cfg: CompareConfig, data_root: Path | None = None) -> dict[str, Any]:
    """Serve and measure every candidate against the target alone; write bench/NAME; return compare.json."""
    cands = candidates(cfg)
    if not cands:
        raise DatasetError("nothing to compare: name a --draft, or leave --prompt-lookup on", code="COMPARE_EMPTY",
                           names="--draft")
    bench_args = dict(prompts=Path(cfg.prompts), concurrency=cfg.concurrency, num_prompts=cfg.num_prompts,
                      max_tokens=cfg.max_tokens, engine=cfg.launch.engine, data_root=data_root)
    params = asdict(cfg) | {"prompts_sha256": sha256_file(Path(cfg.prompts))}
    for c in cands:  # every output and draft checked before any server starts
        check_start(_bench_name(cfg, c.label), draft=c.launch.draft, params={}, root=data_root)
    check_start(cfg.name, draft=None, params=params, root=data_root)
    logs = (data_root or default_root()).absolute() / "logs"  # each engine's log, beside the data it measured
    logs.mkdir(parents=True, exist_ok=True)
    baseline = _serve(replace(cfg.launch, model=cfg.model, port=cfg.port), logs / f"compare-{cfg.name}-base.log")
    refs, rows = [], [_row(None, None, None, cfg)]
    try:
        say(f"target alone ready at {baseline.url}")
        for c in cands:
            name = _bench_name(cfg, c.label)
            say(f"{c.label}: starting it on port {c.launch.port}")
            server = _serve(c.launch, logs / f"compare-{name}.log")
            try:
                results = bench.run(server=server.url, baseline=baseline.url, name=name, draft=c.launch.draft,
                                    **bench_args)
            finally:
                stop(server)
            refs.append(f"bench/{name}")
            rows.append(_row(c, results, refs[-1], cfg))
    finally:
        stop(baseline)
    return _write(cfg, params, refs, rows, data_root)


def _write(cfg: CompareConfig, params: dict[str, Any], refs: list[str], rows: list[dict[str, Any]],
           data_root: Path | None) -> dict[str, Any]:
    from eyas_serve.plot import plot_compare

    first = read_results(refs[0], data_root)[2]
    compare = {"prompts": first["prompts"], "prompts_sha256": first["prompts_sha256"],
               "concurrency": list(cfg.concurrency), "rows": rows, "recommendation": recommend(rows)}
    with WriterLock(Dataset.parse(cfg.name, "bench", data_root), stage="04_serve"):
        out, manifest = start_compare(cfg.name, benches=refs, params=params, root=data_root)
        plot_compare(compare, out.path / COMPARE_PLOT)
        write_compare(out, manifest, compare, stats={"rows": len(rows)})
    say(f"wrote {out.path}")
    return compare
