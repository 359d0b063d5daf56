"""`eyas-serve bench`: held-out prompts replayed at several concurrencies against target + draft (and a
baseline without speculation), the engine's speculative counters differenced around each level.

Order per level: read the draft server's counters, replay on it, read them again; then replay on the
baseline. The two servers never run load at the same time, so each is measured alone on the machine.
An interrupted bench leaves bench/NAME partial (never `complete`): rerun it to measure again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
import httpx

from eyas_common.bench import PLOT, STAGE, check_start, start, write_results
from eyas_common.contract import Dataset, sha256_file
from eyas_common.lock import WriterLock
from eyas_common.procs import run_interruptible, sigterm_as_interrupt
from eyas_common.prompts import load_prompts
from eyas_serve.config import BenchConfig, BenchOptions
from eyas_serve.load import replay, served_model
from eyas_serve.metrics import SpecCounters, detect_engine, read_sglang, read_vllm
from eyas_serve.plot import plot_results
from eyas_serve.report import no_speedup


def say(msg: str) -> None:
    click.echo(f"[eyas-serve] {msg}", err=True)


class Server:
    """One server under test: its URL, engine, served model name and speculative counters."""

    def __init__(self, url: str, engine: str | None):
        self.url = url.rstrip("/")
        with httpx.Client(timeout=30) as c:
            self.engine = engine or detect_engine(c, self.url)
            self.model = served_model(c, self.url)
        self.counters()  # read once now: an --engine the server is not is refused before bench/NAME is written

    def counters(self) -> SpecCounters | float | None:
        """The engine's counters; a server that stopped answering, or has no such page (another engine than
        --engine says), is a ConnectionError naming the URL, never a traceback."""
        page = "/metrics" if self.engine == "vllm" else "/server_info"
        try:
            with httpx.Client(timeout=30) as c:
                return read_vllm(c, self.url) if self.engine == "vllm" else read_sglang(c, self.url)
        except httpx.HTTPStatusError as e:
            raise ConnectionError(f"{self.url}{page}: HTTP {e.response.status_code}; is it a {self.engine} server? "
                                  f"pass the engine it runs with --engine, or leave --engine out to detect it"
                                  ) from None
        except httpx.HTTPError as e:
            raise ConnectionError(f"{self.url}: no answer for {page} ({type(e).__name__}: {e}); is the server "
                                  f"still running (`make serve`)?") from None
        except (ValueError, AttributeError) as e:  # a page that is not Prometheus text / a JSON object
            raise ConnectionError(f"{self.url}{page}: not {self.engine}'s format ({type(e).__name__}: {e}); pass "
                                  f"the engine it runs with --engine, or leave --engine out to detect it") from None


def _spec_block(before: Any, after: Any) -> dict[str, Any] | None:
    if isinstance(after, SpecCounters):
        return (after - before).summary() if isinstance(before, SpecCounters) else after.summary()
    if isinstance(after, float):  # SGLang: a running mean since start-up, no counts
        return {"drafts": None, "draft_tokens": None, "accepted": None, "acceptance_length": after,
                "per_position": None, "tokens_per_step": None, "cumulative_since_start": True}
    return None


def _run_level(server: Server, baseline: Server | None, prompts: list, c: int, cfg: BenchConfig
               ) -> tuple[dict[str, Any], Any]:
    kw = dict(concurrency=c, max_tokens=cfg.max_tokens, temperature=cfg.temperature, timeout_s=cfg.timeout_s)
    before = server.counters()
    draft = run_interruptible(replay(server.url, server.model, prompts, label=f"draft    c={c}", **kw))
    after = server.counters()
    base = run_interruptible(replay(baseline.url, baseline.model, prompts, label=f"baseline c={c}", **kw)) \
        if baseline else None
    spec = _spec_block(before, after)
    speedup = draft["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
    level = {"concurrency": c, "draft": draft, "baseline": base, "spec": spec, "speedup": speedup}
    delta = (after - before) if isinstance(after, SpecCounters) and isinstance(before, SpecCounters) else after
    return level, delta


def check_answered(level: dict[str, Any], server: Server, baseline: Server | None) -> None:
    """Stop at a level where a server answered none of its requests: every request failing the same way is an
    input the server refuses (a --max-tokens beyond its context, a wrong model), or a server that is down, and a
    bench of errors alone is no measurement to keep as complete."""
    for side, s in (("draft", server), ("baseline", baseline)):
        block = level[side]
        if block and block["errors"] and not block["requests"]:
            raise ConnectionError(f"{s.url}: all {block['errors']} requests at {level['concurrency']} in flight "
                                  f"failed, e.g. {block['first_errors'][0]}; fix what the server says (is "
                                  f"--max-tokens within its context?) and rerun")


def _warm(server: Server, prompts: list, cfg: BenchConfig) -> None:
    if cfg.warmup:
        run_interruptible(replay(server.url, server.model, prompts[:cfg.warmup], concurrency=cfg.warmup,
                           max_tokens=min(cfg.max_tokens, 32), temperature=cfg.temperature,
                           timeout_s=cfg.timeout_s, label="warm-up"))


def _say_level(level: dict[str, Any]) -> None:
    d, b, s = level["draft"], level["baseline"], level["spec"]
    msg = f"c={level['concurrency']}: draft {d['tokens_per_s']:.1f} tok/s"
    if b:
        speedup = no_speedup(level) or f"{level['speedup']:.2f}x"
        msg += f", baseline {b['tokens_per_s']:.1f} tok/s, speedup {speedup}"
    if s and s["acceptance_length"] is not None:
        msg += f", acceptance length {s['acceptance_length']:.2f}"
    if s and s.get("tokens_per_step") is not None:
        msg += f", {s['tokens_per_step']:.2f} tokens per target step"
    if d["errors"]:
        msg += f"; {d['errors']} failed requests, e.g. {d['first_errors'][0]}"
    if b and b["errors"]:
        msg += f"; baseline: {b['errors']} failed requests, e.g. {b['first_errors'][0]}"
    say(msg)


def run(options: BenchOptions | None = None, *, data_root: Path | None = None, **fields: Any) -> dict[str, Any]:
    """Measure, write bench/NAME (results.json, bench.png, manifest) and return the results.

    `options` as the CLI builds them, or their fields as keywords (BenchOptions(**fields)).
    """
    o = options if options is not None else BenchOptions(**fields)
    server, baseline, name, draft = o.server, o.baseline, o.name, o.draft
    conversations = load_prompts(o.prompts)  # refuses an unusable file naming its line
    prompts = Path(o.prompts).absolute()  # recorded as a path that reads the same from any working directory
    if baseline is not None and baseline.rstrip("/") == server.rstrip("/"):
        raise click.UsageError(f"--baseline {baseline} is the --server itself: the speedup needs the same target "
                               f"served without a draft, on another port (`eyas-serve launch --model T --port ...`)")
    cfg = BenchConfig(name=name, server=server, prompts=str(prompts), prompts_sha256=sha256_file(prompts),
                      baseline=baseline, draft=draft, concurrency=tuple(o.concurrency), num_prompts=o.num_prompts,
                      max_tokens=o.max_tokens, temperature=o.temperature, timeout_s=o.timeout_s, warmup=o.warmup)
    work = [conversations[i % len(conversations)] for i in range(o.num_prompts or len(conversations))]
    check_start(name, draft=draft, params=cfg.to_dict(), root=data_root)  # the datasets first: no server asked
    target, base = Server(server, o.engine), (Server(baseline, o.engine) if baseline else None)
    # one writer per bench/NAME; SIGTERM (docker stop) stops a run as Ctrl-C does: partial, never results
    with sigterm_as_interrupt(), WriterLock(Dataset.parse(name, "bench", data_root), stage=STAGE):
        out, manifest = start(name, draft=draft, params=cfg.to_dict(), root=data_root)
        t0 = time.monotonic()
        try:
            levels, total = _measure(target, base, work, cfg)
        except KeyboardInterrupt:
            say(f"interrupted: {out.ref} stays partial (not results); rerun to measure again")
            raise
        except ConnectionError as e:  # a server that stopped answering mid-run, or answered nothing at a level
            raise ConnectionError(f"{e}; {out.ref} stays partial (not results)") from None
        results = {"engine": target.engine, "server": target.url, "baseline": base.url if base else None,
                   "model": target.model, "draft": draft, "prompts": str(prompts),
                   "prompts_sha256": cfg.prompts_sha256, "levels": levels,
                   "spec": _spec_block(None, total) if total is not None else None}
        results["spec_tokens"] = len(results["spec"]["per_position"] or []) if results["spec"] else 0
        plot_results(results, out.path / PLOT)
        write_results(out, manifest, results, stats={"wall_s": round(time.monotonic() - t0, 1),
                                                     "requests": sum(lv["draft"]["requests"] for lv in levels)})
    say(f"wrote {out.path}")
    return results


def _measure(target: Server, base: Server | None, work: list, cfg: BenchConfig
             ) -> tuple[list[dict[str, Any]], SpecCounters | None]:
    """Warm both servers, then every concurrency level in turn: the levels' records and the summed counters."""
    for s in filter(None, (target, base)):
        _warm(s, work, cfg)
    if target.counters() is None:
        say(f"{target.url} exposes no speculative-decoding counters (was it started without a draft?): "
            f"acceptance is not reported")
    levels, total = [], None
    for c in cfg.concurrency:
        level, delta = _run_level(target, base, work, c, cfg)
        _say_level(level)
        check_answered(level, target, base)
        levels.append(level)
        total = delta if total is None or not isinstance(delta, SpecCounters) else total + delta
    return levels, total
