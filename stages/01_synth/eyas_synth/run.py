"""eyas-synth run: prompts -> served target -> token-exact samples in `synth/NAME/`.

Files of a synth dataset:
    samples.jsonl     the training samples (eyas_common.samples), one per line, appended as they come
    truncated.jsonl   length-truncated samples set aside by --drop-truncated (kept by default)
    rejected.jsonl    answers that failed structural validation, with the problems found
    failures.jsonl    requests that failed after every retry (retried by the next run)
    manifest.json     schema eyas.synth/1
A sample id is its index i in [0, n); sample i answers prompt i mod #prompts. A rerun reads the ids
already in samples/truncated/rejected and asks only for the others: never a duplicate, never a gap.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from eyas_common.chat import ChatTokens, load_tokenizer, render_completion, render_prompt, target_fingerprint, template_kwargs
from eyas_common.contract import (Dataset, DatasetError, JsonlAppender, check_schema, check_target, finalize,
                                  iter_jsonl, new_manifest, repair_jsonl, sha256_file)
from eyas_common.samples import validate_sample
from eyas_synth.client import ChatPool, RequestFailed, RetryPolicy
from eyas_common.prompts import load_prompts

SAMPLES, TRUNCATED, REJECTED, FAILURES = "samples.jsonl", "truncated.jsonl", "rejected.jsonl", "failures.jsonl"
# Params that define what a sample is: a resumed run must use the same ones.
FIXED_PARAMS = ("prompts_sha256", "thinking", "temperature", "top_p", "max_tokens", "seed", "drop_truncated")


@dataclass
class SynthConfig:
    prompts: str                  # prompts file (JSONL messages/conversations, or plain text)
    prompts_sha256: str           # its content hash: a resume must read the same prompts
    model: str                    # local path of the target's tokenizer (and weights, for later stages)
    served_model: str             # model name sent to the server
    servers: list[str]            # base URLs of OpenAI-compatible servers
    n: int                        # samples to make (sample i answers prompt i mod #prompts)
    max_tokens: int               # completion budget per sample, tokens
    temperature: float            # sent explicitly: servers otherwise apply generation_config defaults
    top_p: float
    thinking: bool                # chat-template thinking switch
    seed: int                     # per-request seed = seed * 1_000_003 + sample id
    drop_truncated: bool          # length-truncated samples go to truncated.jsonl instead of samples.jsonl
    concurrency: int              # requests in flight, all servers together
    timeout_s: float              # per-request timeout, seconds
    max_attempts: int             # tries per request before it is recorded as failed
    trust_remote_code: bool = False  # the tokenizer's own code (shipped with the target) was run


@dataclass
class Counts:
    samples: int = 0
    rendered: int = 0
    truncated_kept: int = 0
    truncated_dropped: int = 0
    rejected: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    servers: dict[str, int] = field(default_factory=dict)


def to_sample(sid: int, prompt_index: int, messages: list[dict], body: dict[str, Any], server: str,
              cfg: SynthConfig, tokenizer, tokens: ChatTokens, prompt_ids: list[int]) -> tuple[dict, list[str]]:
    """A sample from one server response, and the problems that make it unusable (if any)."""
    choice = body["choices"][0]
    msg = choice.get("message") or {}
    # vLLM renamed reasoning_content to reasoning; both exist in the wild.
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    content = msg.get("content") or ""
    finish = choice.get("finish_reason") or "stop"
    server_prompt, server_completion = body.get("prompt_token_ids"), choice.get("token_ids")
    problems: list[str] = []
    if isinstance(server_prompt, list) and isinstance(server_completion, list) and server_completion:
        source, completion = "server", list(server_completion)
        if list(server_prompt) != prompt_ids:
            problems.append("the server's prompt_token_ids differ from the target tokenizer's rendering: "
                            "the server runs another tokenizer or chat template than --model")
    else:
        source = "rendered"
        completion = render_completion(tokenizer, prompt_ids, reasoning, content, finished=finish != "length")
    sample = {
        "id": sid, "prompt_index": prompt_index, "messages": messages, "thinking": cfg.thinking,
        "reasoning": reasoning, "content": content,
        "input_ids": prompt_ids + completion, "loss_mask": [0] * len(prompt_ids) + [1] * len(completion),
        "finish_reason": finish, "source": source, "server": server,
    }
    if not problems:
        problems = validate_sample(sample, tokenizer, tokens, check_prompt=False)
    return sample, problems


def _scan(ds: Dataset) -> tuple[set[int], Counts]:
    """Ids already answered (kept, set aside or rejected) and the counts of what is there."""
    done: set[int] = set()
    c = Counts()
    for name in (SAMPLES, TRUNCATED, REJECTED):
        path = ds.path / name
        if not path.exists():
            continue
        repair_jsonl(path)  # a run killed mid-line leaves a torn last record
        for _, rec in iter_jsonl(path):
            if rec["id"] in done:
                raise DatasetError(f"{path}: sample id {rec['id']} appears twice; the dataset was edited by hand")
            done.add(rec["id"])
            if name == TRUNCATED:
                c.truncated_dropped += 1
            elif name == REJECTED:
                c.rejected += 1
            else:
                c.samples += 1
                c.rendered += rec["source"] == "rendered"
                c.truncated_kept += rec["finish_reason"] == "length"
                p = rec["loss_mask"].count(0)
                c.prompt_tokens += p
                c.completion_tokens += len(rec["input_ids"]) - p
                c.servers[rec["server"]] = c.servers.get(rec["server"], 0) + 1
    return done, c


def _served_model(server: str) -> str:
    """The model name the server serves (its first /v1/models entry)."""
    base = server.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(f"{base}/v1/models", timeout=30, trust_env=False)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise DatasetError(f"cannot read the served model name from {base}/v1/models ({e}); "
                           f"is the server up? Or pass --served-model") from None


def _open_dataset(ds: Dataset, cfg: SynthConfig, fingerprint: dict) -> dict[str, Any]:
    """The manifest to write into: a new one, or the existing one after checking it matches."""
    if not ds.exists():
        if ds.path.exists() and any(ds.path.iterdir()):
            raise DatasetError(f"{ds.ref}: {ds.path} holds files but no manifest.json; "
                               f"delete it (`eyas-data rm {ds.ref}`) or pick another --name")
        return new_manifest("synth", stage="01_synth", target=fingerprint, inputs=[], params=asdict(cfg))
    manifest = ds.read_manifest()
    check_schema(ds, manifest)
    check_target(ds, manifest, fingerprint)
    old = manifest.get("params", {})
    changed = [f"{k}={old.get(k)!r} (now {getattr(cfg, k)!r})" for k in FIXED_PARAMS if old.get(k) != getattr(cfg, k)]
    if changed:
        raise DatasetError(f"{ds.ref} was made with {', '.join(changed)}; resume it with the same options, "
                           f"or pick another --name")
    manifest["params"] = asdict(cfg)
    manifest["status"] = "partial"
    return manifest


async def _produce(todo: list[int], prompts: list[list[dict]], prompt_ids: dict[int, list[int]],
                   cfg: SynthConfig, ds: Dataset, tokenizer, counts: Counts, bar: tqdm) -> dict[str, int]:
    tokens = ChatTokens.of(tokenizer)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for sid in todo:
        queue.put_nowait(sid)
    retry = RetryPolicy(max_attempts=cfg.max_attempts)
    first_problems: list[str] = []
    with JsonlAppender(ds.path / SAMPLES) as samples, JsonlAppender(ds.path / TRUNCATED) as truncated, \
            JsonlAppender(ds.path / REJECTED, sync_every=1) as rejected, \
            JsonlAppender(ds.path / FAILURES, sync_every=1) as failures:
        async with ChatPool(cfg.servers, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, retry=retry) as pool:

            async def worker() -> None:
                while not queue.empty():
                    sid = queue.get_nowait()
                    pi = sid % len(prompts)
                    payload = {
                        "model": cfg.served_model, "messages": prompts[pi], "max_tokens": cfg.max_tokens,
                        "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed * 1_000_003 + sid,
                        "return_token_ids": True, "chat_template_kwargs": template_kwargs(cfg.thinking),
                    }
                    try:
                        body, server = await pool.chat(payload)
                    except RequestFailed as e:
                        counts.failed += 1
                        failures.write({"id": sid, "attempts": e.attempts, "error": e.last_error})
                        bar.set_postfix_str(_postfix(counts, pool, bar), refresh=False)
                        continue
                    sample, problems = to_sample(sid, pi, prompts[pi], body, server, cfg, tokenizer, tokens, prompt_ids[pi])
                    if problems:
                        counts.rejected += 1
                        rejected.write({"id": sid, "problems": problems, "sample": sample})
                        if not first_problems:
                            first_problems.extend(problems)
                        # Fail fast on a misconfigured server rather than reject a whole run.
                        if counts.rejected >= 16 and counts.samples == 0:
                            raise DatasetError(f"the first {counts.rejected} answers were all rejected; first "
                                               f"problem: {first_problems[0]} (details in {ds.path / REJECTED})")
                        continue
                    truncated_sample = sample["finish_reason"] == "length"
                    if truncated_sample and cfg.drop_truncated:
                        counts.truncated_dropped += 1
                        truncated.write(sample)
                    else:
                        samples.write(sample)
                        counts.samples += 1
                        counts.truncated_kept += truncated_sample
                        counts.rendered += sample["source"] == "rendered"
                        counts.servers[server] = counts.servers.get(server, 0) + 1
                    p = len(prompt_ids[pi])
                    counts.prompt_tokens += p
                    counts.completion_tokens += len(sample["input_ids"]) - p
                    bar.update(1)
                    bar.set_postfix_str(_postfix(counts, pool, bar), refresh=False)

            workers = [asyncio.create_task(worker()) for _ in range(min(cfg.concurrency, len(todo)))]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            return dict(pool.stats)


def _postfix(c: Counts, pool: ChatPool, bar: tqdm) -> str:
    elapsed = max(bar.format_dict["elapsed"], 1e-6)
    return (f"{c.completion_tokens / elapsed:,.0f} tok/s, retries {pool.stats.get('retries', 0)}, "
            f"failed {c.failed}, rejected {c.rejected}")


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def run(*, prompts: Path, name: str, model: Path, servers: list[str], n: int | None = None,
        max_tokens: int = 4096, temperature: float = 0.6, top_p: float = 0.95, thinking: bool = True,
        seed: int = 0, drop_truncated: bool = False, concurrency: int = 128, timeout_s: float = 600.0,
        max_attempts: int = 8, served_model: str | None = None, trust_remote_code: bool = False,
        data_root: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Make (or resume) synth dataset `name`; returns its final stats."""
    if not servers:
        raise DatasetError("no --server given: pass the base URL of a running vLLM or SGLang server")
    conversations = load_prompts(prompts)
    n = len(conversations) if n is None else n
    tokenizer = load_tokenizer(model, trust_remote_code)
    fingerprint = target_fingerprint(tokenizer, model)
    ds = Dataset.parse(name, "synth", data_root)
    cfg = SynthConfig(
        prompts=str(prompts), prompts_sha256=sha256_file(prompts), model=str(model),
        served_model=served_model or _served_model(servers[0]), servers=list(servers), n=n,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, thinking=thinking, seed=seed,
        drop_truncated=drop_truncated, concurrency=concurrency, timeout_s=timeout_s, max_attempts=max_attempts,
        trust_remote_code=trust_remote_code)
    manifest = _open_dataset(ds, cfg, fingerprint)
    ds.path.mkdir(parents=True, exist_ok=True)
    ds.write_manifest(manifest)

    done, counts = _scan(ds)
    extra = sorted(i for i in done if i >= n)
    if extra:
        raise DatasetError(f"{ds.ref} already holds samples with ids up to {extra[-1]}, more than --n {n}; "
                           f"pass --n {extra[-1] + 1} or more")
    todo = [i for i in range(n) if i not in done]
    (ds.path / FAILURES).unlink(missing_ok=True)  # failures of an earlier run are retried now
    # Render each distinct prompt once: it is the cross-check for the server's prompt ids.
    prompt_ids = {pi: render_prompt(tokenizer, conversations[pi], thinking) for pi in {i % len(conversations) for i in todo}}
    print(f"[synth] {ds.ref}: {len(done)} of {n} samples already there, {len(todo)} to make "
          f"from {len(conversations)} prompts on {len(servers)} server(s), {concurrency} in flight", file=sys.stderr)

    t0 = time.monotonic()
    pool_stats: dict[str, int] = {}
    bar = tqdm(total=n, initial=len(done), unit="sample", disable=not progress, dynamic_ncols=True,
               desc=f"synth {ds.name}", smoothing=0.05)
    # SIGTERM (docker stop, kill) is handled like Ctrl-C: stop, flush, keep what is written.
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    tokens_before = counts.completion_tokens
    try:
        if todo:
            pool_stats = asyncio.run(_produce(todo, conversations, prompt_ids, cfg, ds, tokenizer, counts, bar))
    except KeyboardInterrupt:
        bar.close()
        print(f"\n[synth] interrupted: {counts.samples} samples are saved in {ds.path / SAMPLES}; "
              f"rerun the same command to resume", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, old_term)
        bar.close()
    wall = time.monotonic() - t0

    stats = asdict(counts) | {
        "requested": n, "wall_s_last_run": round(wall, 2),
        "samples_per_s_last_run": round(len(todo) / wall, 3) if todo and wall else None,
        "completion_tokens_per_s_last_run": round((counts.completion_tokens - tokens_before) / wall, 1) if wall else None,
        "client": pool_stats,
    }
    records = {SAMPLES: counts.samples, TRUNCATED: counts.truncated_dropped, REJECTED: counts.rejected,
               FAILURES: counts.failed}
    for fname, k in records.items():
        if k == 0 and (ds.path / fname).exists() and (ds.path / fname).stat().st_size == 0:
            (ds.path / fname).unlink()
    finalize(ds, manifest, stats=stats, records={k: v for k, v in records.items() if (ds.path / k).exists()})
    print(f"[synth] {ds.ref} complete: {counts.samples} samples ({counts.rendered} rendered from text, "
          f"{counts.truncated_kept} truncated kept, {counts.truncated_dropped} dropped), {counts.rejected} rejected, "
          f"{counts.failed} failed, {wall:.1f} s", file=sys.stderr)
    if counts.failed:
        print(f"[synth] {counts.failed} requests failed after {max_attempts} attempts ({ds.path / FAILURES}); "
              f"rerun the same command to retry them", file=sys.stderr)
    return stats
