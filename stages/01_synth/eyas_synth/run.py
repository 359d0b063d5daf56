"""eyas-synth run: prompts -> served target -> token-exact samples in `synth/NAME/`.

The files of a synth dataset and the sample record are owned by eyas_common.samples. A sample id is
its index i in [0, n); sample i answers prompt i mod #prompts. A rerun reads the ids already in
samples/truncated/rejected and asks only for the others: never a duplicate, never a gap. A run
holds the dataset's writer lock; it ends `complete` only when every id is answered (or the shortfall
is within --allow-missing) and the rejected answers are within --allow-rejected; otherwise it exits
non-zero naming the failed ids or the first rejection, the dataset partial.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from eyas_common.chat import (THINK_CLOSE, THINK_OPEN, ChatTokens, load_tokenizer, prompt_opens_thinking, render_completion, render_prompt,
                              resolve_thinking, split_text, target_fingerprint, template_kwargs, template_switches)
from eyas_common.contract import (Dataset, DatasetError, JsonlAppender, finalize, iter_jsonl, json_type, open_output,
                                  sha256_file)
from eyas_common.launch import INTERRUPTED
from eyas_common.lock import WriterLock
from eyas_common.procs import run_interruptible, sigterm_as_interrupt
from eyas_common.prompts import load_prompts
from eyas_common.samples import (ANSWERED, FAILURES, REJECTED, SAMPLES, TRUNCATED, bad_line_fix, budget_count,
                                 from_server_ids, new_sample, validate_sample)
from eyas_synth.config import MAY_CHANGE, SynthConfig, SynthOptions, check_server_url
from eyas_synth.client import ChatPool, Failure, RequestFailed, RetryPolicy, ServersDown, report_silence

# When this many first answers all failed the same way (and none worked), the run stops at once.
FIRST_FAILURES = 8
# What the first answers did is printed once this many came; if all of them were rejected, the run stops.
FIRST_ANSWERS = 8
# Seconds without any answer (or a quarter of --timeout, if less) before the run says so and asks the
# servers whether they are still up; then again at twice the silence, four times, ...
SILENCE_S = 60.0


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


@dataclass
class Evidence:
    """What the first answers showed about the target and the server: the run's account of its thinking."""

    seen: list[tuple[str, str, bool]] = field(default_factory=list)  # (block, server split, kept) per answer

    def add(self, body: dict[str, Any], sample: dict[str, Any], problems: list[str], tokens: ChatTokens,
            prompt: list[int], first: int) -> bool:
        """Note one answer, while fewer than `first` are noted; True once the `first`-th is (time to say so)."""
        if len(self.seen) >= first:
            return False
        msg = (body.get("choices") or [{}])[0].get("message") or {}
        text = msg.get("content") if isinstance(msg.get("content"), str) else ""
        completion = sample["input_ids"][len(prompt):]
        block = ("opened by the prompt" if prompt_opens_thinking(prompt, tokens) else
                 "opened by the model" if tokens.think_open is not None and tokens.think_open in completion[:1] else
                 "none")
        split = ("a reasoning field" if msg.get("reasoning") or msg.get("reasoning_content") else
                 "wrappers left in content" if THINK_CLOSE in text or THINK_OPEN in text else "content only")
        self.seen.append((block, split, not problems))
        return len(self.seen) == first

    def line(self) -> str:
        def tally(i: int) -> str:
            counts: dict[str, int] = {}
            for row in self.seen:
                counts[row[i]] = counts.get(row[i], 0) + 1
            return ", ".join(f"{k} {v}" for k, v in counts.items())
        kept = sum(r[2] for r in self.seen)
        return (f"first {len(self.seen)} answers: thinking block: {tally(0)}; the server's text: {tally(1)}; "
                f"{kept} token-exact and kept, {len(self.seen) - kept} rejected")


@dataclass
class RunState:
    """One synth run: what it asks, where it writes, what it has seen so far."""

    cfg: SynthConfig
    ds: Dataset
    manifest: dict[str, Any]
    tokenizer: Any
    conversations: list[list[dict]]
    done: set[int]                                   # ids already answered before this run
    todo: list[int]                                  # ids this run asks for
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)   # prompt index -> rendered ids
    counts: Counts = field(default_factory=Counts)
    failed: dict[int, str] = field(default_factory=dict)            # id -> last error, this run
    switches: tuple[str, ...] = ()                   # the thinking switches the chat template takes
    evidence: Evidence = field(default_factory=lambda: Evidence())  # what the first answers did
    first_errors: list[tuple[str, str]] = field(default_factory=list)  # (kind, error) while nothing worked
    outage_first: Failure | None = None              # the first failure of this run's first outage
    last_failure: Failure | None = None              # the last request that failed for good
    pool_stats: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> ChatTokens:
        return ChatTokens.of(self.tokenizer)

    def max_tokens(self, pi: int) -> int:
        """--max-tokens, fitted so that prompt + completion stays within the server's context."""
        if self.cfg.max_model_len is None:
            return self.cfg.max_tokens
        return min(self.cfg.max_tokens, self.cfg.max_model_len - len(self.prompt_ids[pi]))


def to_sample(st: RunState, sid: int, body: dict[str, Any], server: str) -> tuple[dict, list[str]]:
    """A sample from one server response, and the problems that make it unusable (if any).

    Ids from the server are the answer: they are split at the tokenizer's wrapper ids, and the server's text
    (whatever its reasoning parser did with it) only has to agree with them. A text-only answer is rendered.
    """
    pi = sid % len(st.conversations)
    prompt_ids = st.prompt_ids[pi]
    choice = body["choices"][0]
    msg = choice.get("message") or {}
    # vLLM renamed reasoning_content to reasoning; both exist in the wild.
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    content = msg.get("content") or ""
    finish = choice.get("finish_reason") or "stop"
    server_prompt, server_completion = body.get("prompt_token_ids"), choice.get("token_ids")
    problems: list[str] = []
    # checked whenever the server sends them, an empty answer included: it is the one sign of a server that
    # renders prompts with another tokenizer or template than --model
    if isinstance(server_prompt, list) and list(server_prompt) != prompt_ids:
        problems.append("the server's prompt_token_ids differ from the target tokenizer's rendering: "
                        "the server runs another tokenizer or chat template than --model")
    # text that is not a string (content parts, a number) can be neither rendered nor checked against ids
    problems += [f"the server's message {k} is a JSON {json_type(v)}, not a string" for k, v in
                 (("content", content), ("reasoning", reasoning)) if v is not None and not isinstance(v, str)]
    completion: list = []
    source = "rendered"
    if isinstance(server_prompt, list) and isinstance(server_completion, list) and server_completion:
        source, completion = "server", list(server_completion)
        vocab = len(st.tokenizer)
        if not all(type(t) is int and 0 <= t < vocab for t in completion):  # decode() raises on these, or lies
            problems.append(f"the server's token_ids hold ids that are not token ids of --model's tokenizer "
                            f"[0, {vocab}): the server runs another model than --model")
        elif not problems:
            reasoning, content, problems = from_server_ids(prompt_ids, completion, (reasoning, content),
                                                           st.tokenizer, st.tokens, finish != "length")
    elif not problems:
        completion, problem = _rendered(st, prompt_ids, reasoning, content, finish)
        reasoning, content = split_text(reasoning, content)
        problems += [problem] if problem else []
    sample = new_sample(id=sid, prompt_index=pi, messages=st.conversations[pi], thinking=st.cfg.thinking,
                        reasoning=reasoning, content=content, prompt_ids=prompt_ids, completion_ids=completion,
                        finish_reason=finish, source=source, server=server)
    if not problems:
        problems = validate_sample(sample, st.tokenizer, st.tokens, check_prompt=False)
    return sample, problems


NO_IDS = "the server gave no token ids"


def _rendered(st: RunState, prompt_ids: list[int], reasoning: str | None, content: str,
              finish: str) -> tuple[list[int], str | None]:
    """Completion ids rendered from a text-only answer (wrappers left in its content split out), or why they
    cannot be exact: the prompt opens a thinking block, and neither a reasoning field nor a `</think>` in the
    text says where it ends (an empty block, or a server that dropped the wrappers: the text cannot tell, and
    guessing is the mistake this project exists to catch)."""
    if not reasoning and THINK_CLOSE not in content and prompt_opens_thinking(prompt_ids, st.tokens):
        return [], f"{NO_IDS}, and no reasoning nor </think> closes the block the prompt opens"
    reasoning, content = split_text(reasoning, content)
    try:
        return render_completion(st.tokenizer, prompt_ids, reasoning, content, finished=finish != "length"), None
    except ValueError as e:  # reasoning from a target without <think>/</think> tokens
        return [], f"the server's answer cannot be rendered with --model's tokenizer: {e}"


# The first rejections' cause, as the refusal names it, and its fix.
NOT_EXACT = (
    (("prompt_token_ids differ", "not token ids of --model", "disagrees with its token ids"),
     "another model or template than --model", "serve the folder that --model names"),
    ((NO_IDS,), "no token ids, and its text hides the thinking split",
     "use a server that returns token ids (vLLM), or start it with this target's --reasoning-parser"),
)


def not_exact(st: RunState, server: str, problem: str) -> DatasetError:
    """The refusal of a target or server whose first answers cannot make exact samples, with the fix."""
    cause, fix = next(((c, f) for keys, c, f in NOT_EXACT if any(k in problem for k in keys)),
                      (problem[:60], "see rejected.jsonl and docs/interop.md (thinking styles)"))
    return DatasetError(f"{server} gave {st.counts.rejected} inexact answers first ({cause}); "
                        f"{fix}", code="SYNTH_NOT_EXACT", names=server)


def scan(ds: Dataset, manifest: dict[str, Any]) -> tuple[set[int], Counts]:
    """Ids already answered (kept, set aside or rejected) and the counts of what is there; reads only.

    The one source of the dataset's counts, so the stats are the same whether or not a run was
    interrupted. A torn last line (a killed run) is skipped here and cut when the file is next appended to;
    any other unreadable line is refused with what to do about it (bad_line_fix, by the manifest's status).
    """
    done: set[int] = set()
    c = Counts()
    fix = bad_line_fix(ds, manifest)
    for name in ANSWERED:
        path = ds.path / name
        if not path.exists():
            continue
        for lineno, rec in iter_jsonl(path, torn_end_ok=True, fix=fix):
            if not isinstance(rec, dict) or type(rec.get("id")) is not int:
                raise DatasetError(f"{path}:{lineno}: a record without an integer id; {fix}")
            if rec["id"] in done:
                raise DatasetError(f"{path}: sample id {rec['id']} appears twice; the dataset was edited by hand")
            done.add(rec["id"])
            if name == REJECTED:
                c.rejected += 1
                continue
            if name == TRUNCATED:
                c.truncated_dropped += 1
            else:
                c.samples += 1
                c.rendered += rec["source"] == "rendered"
                c.truncated_kept += rec["finish_reason"] == "length"
                c.servers[rec["server"]] = c.servers.get(rec["server"], 0) + 1
            p = rec["loss_mask"].count(0)
            c.prompt_tokens += p
            c.completion_tokens += len(rec["input_ids"]) - p
    return done, c


def _models(base: str) -> tuple[list[str], dict[str, int | None]]:
    """The model names a server lists at /v1/models, and each one's context length (vLLM's max_model_len)."""
    try:
        r = httpx.get(f"{base}/v1/models", timeout=30, trust_env=False)
    except httpx.HTTPError as e:
        raise DatasetError(f"cannot read the served model from {base}/v1/models ({type(e).__name__}: {e}); is the "
                           f"server up at that --server URL? Start it, or leave that --server out") from None
    if r.status_code != 200:  # it answered: say what, in one line (httpx's own message spans two)
        body = " ".join(r.text.split())[:200]
        raise DatasetError(f"{base}/v1/models answered HTTP {r.status_code} ({body or 'no body'}); that --server "
                           f"must be an OpenAI-compatible server (vLLM, SGLang) that is ready: check its log")
    try:
        entries = r.json()["data"]
        lengths = {e["id"]: e.get("max_model_len") for e in entries}
        if not lengths or not all(isinstance(k, str) for k in lengths):
            raise ValueError("no model ids")
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
        raise DatasetError(f"{base}/v1/models did not list a model ({type(e).__name__}: {e}); that --server must "
                           f"be an OpenAI-compatible server (vLLM, SGLang)") from None
    return list(lengths), {k: int(v) if type(v) is int and v > 0 else None for k, v in lengths.items()}


def servers_info(servers: list[str], served_model: str | None) -> tuple[str, int | None]:
    """The model name to request and the context every server gives it (the smallest; None: none says).

    Every --server is asked, not only the first: one that is down or serves another model fails each request
    sent to it (a refused connection, a 404 for the model name) and one with a smaller context each long one
    (a 400 for max_tokens), and the run ends short naming a request, not the --server to fix. A --served-model
    given is taken as said (SGLang answers to any name; vLLM lists the names it answers to)."""
    bases = [check_server_url(s) for s in servers]
    name, contexts = served_model, []
    for base in bases:
        names, lengths = _models(base)
        if name is None:
            name = names[0]
        elif served_model is None and name not in lengths:
            raise DatasetError(f"{base} serves {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}, not "
                               f"{name!r} as {bases[0]} does: every --server must serve the same target; if they "
                               f"serve it under different names, serve it under one (vLLM --served-model-name) and "
                               f"pass that name with --served-model")
        contexts.append(lengths.get(name, lengths[names[0]]))  # a name not listed: the server's one model
    known = [c for c in contexts if c is not None]
    return name, min(known) if known else None


def _render_prompts(conversations: list[list[dict]], todo: list[int], tokenizer, cfg: SynthConfig
                    ) -> dict[int, list[int]]:
    """Each distinct prompt once (the cross-check for the server's prompt ids), checked to fit the context."""
    out = {}
    for pi in sorted({i % len(conversations) for i in todo}):
        try:
            out[pi] = render_prompt(tokenizer, conversations[pi], cfg.thinking)
        except Exception as e:  # noqa: BLE001 - jinja raises its own types for what a template rejects
            raise DatasetError(f"{cfg.prompts}: prompt {pi + 1} (counting non-blank lines) is refused by the "
                               f"target's chat template: {e}. Fix or drop that prompt") from None
    _refuse_too_long(out, cfg)
    return out


def _refuse_too_long(prompt_ids: dict[int, list[int]], cfg: SynthConfig) -> None:
    """Every prompt that leaves no room for an answer in the server's context, named at once (one fix, one rerun)."""
    if cfg.max_model_len is None:
        return
    over = {pi: len(ids) for pi, ids in prompt_ids.items() if len(ids) >= cfg.max_model_len}
    if not over:
        return
    named = ", ".join(f"{pi + 1} ({n:,} tokens)" for pi, n in sorted(over.items())[:5])
    longest = max(over.values())
    raise DatasetError(
        f"{cfg.prompts}: {len(over)} prompt(s) leave no room for an answer in the server's context "
        f"(max_model_len {cfg.max_model_len}): {named}{f' and {len(over) - 5} more' if len(over) > 5 else ''} "
        f"(counting non-blank lines). Shorten or drop them, or serve the target with --max-model-len "
        f"{longest + cfg.max_tokens} (the longest prompt, {longest:,} tokens, and its --max-tokens "
        f"{cfg.max_tokens:,})")


def _payload(st: RunState, sid: int) -> dict[str, Any]:
    cfg, pi = st.cfg, sid % len(st.conversations)
    return {
        "model": cfg.served_model, "messages": st.conversations[pi], "max_tokens": st.max_tokens(pi),
        "temperature": cfg.temperature, "top_p": cfg.top_p,
        "return_token_ids": True,
    } | ({} if cfg.seed is None else {"seed": cfg.seed * 1_000_003 + sid}) | (
        {"chat_template_kwargs": template_kwargs(cfg.thinking, st.switches)} if cfg.thinking is not None else {})


def _failed(st: RunState, sid: int, e: RequestFailed) -> None:
    """Record a failed request; stop the run when the first answers of a new dataset all failed the same way."""
    st.failed[sid] = e.last_error
    st.counts.failed += 1
    st.outage_first = st.outage_first or e.first
    st.last_failure = (e.kind, e.last_error)
    if st.done or st.counts.samples or st.counts.rejected or st.counts.truncated_dropped:
        return  # something worked (in this run or before): the failures are these requests', not the setup's
    st.first_errors.append((e.kind, e.last_error))
    kinds = {k for k, _ in st.first_errors}
    if len(st.first_errors) >= min(FIRST_FAILURES, len(st.todo)) and len(kinds) == 1:
        raise DatasetError(f"{st.ds.ref}: the first {len(st.first_errors)} requests all failed alike, so the run "
                           f"stopped: {st.first_errors[0][1]}")


@dataclass
class _Files:
    samples: JsonlAppender
    truncated: JsonlAppender
    rejected: JsonlAppender
    failures: JsonlAppender


class _Probe:
    """The first answers go alone: the others wait until they are in, so a target or server that cannot give
    exact samples is refused after a handful of requests, not after a full window of --concurrency."""

    def __init__(self, first: int):
        self.first, self.sent, self.finished, self.open = first, 0, 0, asyncio.Event()

    async def admit(self) -> None:
        while self.sent >= self.first and not self.open.is_set():
            await self.open.wait()
        self.sent += 1

    def finish(self) -> None:
        self.finished += 1
        if self.finished >= self.first:
            self.open.set()


async def _answer(st: RunState, sid: int, pool: ChatPool, files: _Files, bar: tqdm) -> None:
    """Ask for one id and append its answer where it belongs."""
    cfg, c = st.cfg, st.counts
    try:
        body, server = await pool.chat(_payload(st, sid))
    except RequestFailed as e:
        files.failures.write({"id": sid, "attempts": e.attempts, "error": e.last_error})
        _failed(st, sid, e)
        return
    sample, problems = to_sample(st, sid, body, server)
    first = min(FIRST_ANSWERS, len(st.todo))
    if st.evidence.add(body, sample, problems, st.tokens, st.prompt_ids[sample["prompt_index"]], first):
        tqdm.write(f"[synth] {st.evidence.line()}", file=sys.stderr)
    if problems:
        c.rejected += 1
        files.rejected.write({"id": sid, "problems": problems, "sample": sample})
        if c.rejected >= first and c.samples == 0 and not st.done:  # not exact from the start: the setup's fault
            raise not_exact(st, server, problems[0])
        return
    if sample["finish_reason"] == "length" and cfg.drop_truncated:
        c.truncated_dropped += 1
        files.truncated.write(sample)
    else:
        c.samples += 1
        files.samples.write(sample)
    c.completion_tokens += sample["loss_mask"].count(1)
    bar.update(1)
    bar.set_postfix_str(_postfix(c, pool, bar), refresh=False)


async def _produce(st: RunState, bar: tqdm) -> None:
    """Ask for every id of `st.todo`, the first few alone (_Probe); append each answer where it belongs."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for sid in st.todo:
        queue.put_nowait(sid)
    cfg, path = st.cfg, st.ds.path
    probe = _Probe(min(FIRST_ANSWERS, len(st.todo)))
    with JsonlAppender(path / SAMPLES) as samples, JsonlAppender(path / TRUNCATED) as truncated, \
            JsonlAppender(path / REJECTED, sync_every=1) as rejected, \
            JsonlAppender(path / FAILURES, sync_every=1) as failures:
        files = _Files(samples, truncated, rejected, failures)
        async with ChatPool(cfg.servers, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                            retry=RetryPolicy(max_attempts=cfg.max_attempts), breaker_s=cfg.breaker_s) as pool:

            async def worker() -> None:
                while not queue.empty():
                    await probe.admit()
                    if queue.empty():
                        return
                    try:
                        await _answer(st, queue.get_nowait(), pool, files, bar)
                    finally:
                        probe.finish()

            workers = [asyncio.create_task(worker()) for _ in range(min(cfg.concurrency, len(st.todo)))]
            watch = asyncio.create_task(report_silence(pool, _say_silence, min(SILENCE_S, cfg.timeout_s / 4)))
            try:
                await asyncio.gather(*workers)
            finally:
                for w in (*workers, watch):
                    w.cancel()
                await asyncio.gather(*workers, watch, return_exceptions=True)
                st.pool_stats = dict(pool.stats)


def _say_silence(line: str) -> None:
    tqdm.write(f"[synth] {line}. Ctrl-C keeps every answer so far; rerunning the command resumes", file=sys.stderr)


def _postfix(c: Counts, pool: ChatPool, bar: tqdm) -> str:
    elapsed = max(bar.format_dict["elapsed"], 1e-6)
    return (f"{c.completion_tokens / elapsed:,.0f} tok/s, retries {pool.stats.get('retries', 0)}, "
            f"failed {c.failed}, rejected {c.rejected}")


def run(options: SynthOptions | None = None, *, data_root: Path | None = None, progress: bool = True,
        **fields: Any) -> dict[str, Any]:
    """Make (or resume) synth dataset `options.name`; returns its final stats.

    `options` as the CLI builds them, or their fields as keywords (SynthOptions(**fields)).
    """
    o = options if options is not None else SynthOptions(**fields)
    o.check()  # before the slow part (the tokenizer), and before any request
    conversations = load_prompts(o.prompts)
    tokenizer = load_tokenizer(o.model, o.trust_remote_code)
    thinking, why = resolve_thinking(tokenizer, o.thinking)
    print(f"[synth] thinking: {why}; each answer is split at its token ids", file=sys.stderr)
    ds = Dataset.parse(o.name, "synth", data_root)
    served, context = servers_info(list(o.servers), o.served_model)
    cfg = SynthConfig(
        prompts=str(o.prompts), prompts_sha256=sha256_file(o.prompts), model=str(o.model),
        served_model=served, servers=list(o.servers), n=len(conversations) if o.n is None else o.n,
        max_tokens=o.max_tokens, max_model_len=context, temperature=o.temperature, top_p=o.top_p,
        thinking=thinking, seed=o.seed, drop_truncated=o.drop_truncated, concurrency=o.concurrency,
        timeout_s=o.timeout_s, max_attempts=o.max_attempts, allow_missing=str(o.allow_missing),
        allow_rejected=str(o.allow_rejected), breaker_s=o.breaker_s, trust_remote_code=o.trust_remote_code)
    with WriterLock(ds, stage="01_synth"):
        st = _prepare(ds, cfg, tokenizer, conversations, o.allow_code_change)
        return _run_and_finish(st, progress)


def _prepare(ds: Dataset, cfg: SynthConfig, tokenizer, conversations: list[list[dict]],
             allow_code_change: bool) -> RunState:
    """Check everything, then (and only then) write the partial manifest: a refused rerun changes nothing."""
    made = (ds.read_manifest().get("params") or {}) if ds.exists() else {}
    if made.get("prompts_sha256") not in (None, cfg.prompts_sha256):  # open_output would name two hashes only
        same = "the same file, changed since" if made.get("prompts") == cfg.prompts else f"it was {made.get('prompts')}"
        raise DatasetError(f"{ds.ref} was made from other prompts than --prompts {cfg.prompts} holds now ({same}); "
                           f"resume it with the prompts it was made from, or pick another --name")
    # A complete dataset is extended (a larger --n); the manifest is written below, only if there is work.
    manifest = open_output(ds, stage="01_synth", params=asdict(cfg), may_change=MAY_CHANGE,
                           target=target_fingerprint(tokenizer, cfg.model), inputs=[],
                           allow_code_change=allow_code_change, complete="extend")
    done, _ = scan(ds, manifest)
    extra = sorted(i for i in done if i >= cfg.n)
    if extra:
        raise DatasetError(f"{ds.ref} already holds samples with ids up to {extra[-1]}, more than --n {cfg.n}; "
                           f"pass --n {extra[-1] + 1} or more")
    todo = [i for i in range(cfg.n) if i not in done]
    st = RunState(cfg, ds, manifest, tokenizer, conversations, done, todo, switches=template_switches(tokenizer))
    st.prompt_ids = _render_prompts(conversations, todo, tokenizer, cfg)
    if cfg.max_model_len is not None and cfg.max_tokens > cfg.max_model_len - min(map(len, st.prompt_ids.values()), default=0):
        print(f"[synth] --max-tokens {cfg.max_tokens} does not fit the server's max_model_len {cfg.max_model_len} "
              f"with every prompt: each request asks for at most max_model_len - its prompt tokens", file=sys.stderr)
    if not todo and manifest.get("status") == "complete":
        return st  # nothing to do, nothing to write
    manifest["status"] = "partial"
    ds.path.mkdir(parents=True, exist_ok=True)
    ds.write_manifest(manifest)
    (ds.path / FAILURES).unlink(missing_ok=True)  # failures of an earlier run are retried now
    print(f"[synth] {ds.ref}: {len(done)} of {cfg.n} samples already there, {len(todo)} to make from "
          f"{len(conversations)} prompts on {len(cfg.servers)} server(s), {cfg.concurrency} in flight", file=sys.stderr)
    return st


def _run_and_finish(st: RunState, progress: bool) -> dict[str, Any]:
    """Produce the missing samples; mark the dataset complete only if it holds what was asked."""
    ds, cfg = st.ds, st.cfg
    if not st.todo and st.manifest.get("status") == "complete":
        print(f"[synth] {ds.ref} is already complete", file=sys.stderr)
        return st.manifest["stats"]
    t0 = time.monotonic()
    bar = tqdm(total=cfg.n, initial=len(st.done), unit="sample", disable=not progress, dynamic_ncols=True,
               desc=f"synth {ds.name}", smoothing=0.05)
    try:
        with sigterm_as_interrupt():
            if st.todo:
                run_interruptible(_produce(st, bar))
    except KeyboardInterrupt:
        bar.close()
        print(f"\n[synth] interrupted: {st.counts.samples} new samples are saved in {ds.path / SAMPLES}; "
              f"rerun the same command to resume", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    except ServersDown as e:
        raise DatasetError(f"{ds.ref}: stopped: every server failed for {e.seconds:.0f} s (--breaker "
                           f"{cfg.breaker_s:g}); {_failure_story(st.outage_first or e.first, e.last)}. "
                           f"What was made is kept: rerun the same command once a server is up") from None
    finally:
        bar.close()
    return _finish(st, time.monotonic() - t0)


def _finish(st: RunState, wall: float) -> dict[str, Any]:
    ds, cfg = st.ds, st.cfg
    done, counts = scan(ds, st.manifest)  # from the files, so the stats agree whether or not a run was interrupted
    counts.failed = len(st.failed)
    missing = [i for i in range(cfg.n) if i not in done]  # ids with no answer (rejected ones are answered)
    stats = asdict(counts) | {
        "requested": cfg.n, "missing": missing, "wall_s_last_run": round(wall, 2),
        "samples_per_s_last_run": round(len(st.todo) / wall, 3) if st.todo and wall else None,
        "completion_tokens_per_s_last_run": round(st.counts.completion_tokens / wall, 1) if wall else None,
        "client": st.pool_stats,
    }
    records = {SAMPLES: counts.samples, TRUNCATED: counts.truncated_dropped, REJECTED: counts.rejected,
               FAILURES: counts.failed}
    for fname, k in records.items():
        if k == 0 and (ds.path / fname).exists() and (ds.path / fname).stat().st_size == 0:
            (ds.path / fname).unlink()
    summary = (f"{counts.samples} samples ({counts.rendered} rendered from text, {counts.truncated_kept} truncated "
               f"kept, {counts.truncated_dropped} dropped), {len(missing)} missing of {cfg.n} asked "
               f"({counts.failed} failed, {counts.rejected} rejected), {wall:.1f} s")
    refusal = _refusal(st, summary, missing, counts)
    if refusal:
        st.manifest["stats"] = stats
        ds.write_manifest(st.manifest)
        raise DatasetError(refusal)
    finalize(ds, st.manifest, stats=stats, records={k: v for k, v in records.items() if (ds.path / k).exists()})
    print(f"[synth] {ds.ref} complete: {summary}", file=sys.stderr)
    if missing:
        print(f"[synth] accepted short by {len(missing)} (--allow-missing {cfg.allow_missing}): ids {missing[:20]}",
              file=sys.stderr)
    if counts.rejected:
        print(f"[synth] accepted with {counts.rejected} rejected (--allow-rejected {cfg.allow_rejected}; "
              f"in {ds.path / REJECTED})", file=sys.stderr)
    return stats


def _refusal(st: RunState, summary: str, missing: list[int], counts: Counts) -> str | None:
    """Why the dataset must stay partial (None: it is complete): nothing usable, too many ids with no
    answer, or too many answers rejected. The first reason found is the one named."""
    ds, cfg = st.ds, st.cfg
    if not counts.samples:  # nothing to train on, whatever the budgets say
        why = next(iter(st.failed.values()), None) or _first_rejection(ds)
        return (f"{ds.ref} stays partial: no usable sample ({summary}); first problem: {why} (details in "
                f"{ds.path / REJECTED} and {ds.path / FAILURES}). Check that --model is the target the server runs")
    budget = budget_count(cfg.allow_missing, cfg.n)
    if len(missing) > budget:
        story = _failure_story(st.outage_first, st.last_failure)
        return (f"{ds.ref} stays partial: {summary}; missing ids {missing[:20]}{' ...' if len(missing) > 20 else ''} "
                f"({story}; all in {ds.path / FAILURES}). Rerun the same command to retry them, or accept "
                f"the shortfall with --allow-missing N or PCT% (now {cfg.allow_missing}, i.e. {budget})")
    allowed = budget_count(cfg.allow_rejected, cfg.n)
    if counts.rejected > allowed:
        return (f"{ds.ref} stays partial: {summary}; {counts.rejected} answers rejected, over --allow-rejected "
                f"{cfg.allow_rejected} ({allowed}); first problem: {_first_rejection(ds)} (all in "
                f"{ds.path / REJECTED}; `eyas-synth validate` explains). Fix the cause and make a new dataset, "
                f"or accept them with --allow-rejected N or PCT%")
    return None


def _first_rejection(ds: Dataset) -> str | None:
    if not (ds.path / REJECTED).exists():
        return None
    return next((f"sample {rec['id']}: {rec['problems'][0]}"
                 for _, rec in iter_jsonl(ds.path / REJECTED, torn_end_ok=True)), None)


def _failure_story(first: Failure | None, last: Failure | None) -> str:
    """The errors of an outage as a user needs them: a server that first returned an error (an HTTP 500
    and its message) and then stopped answering has died, and its first error says why."""
    if first and last and last[0] in ("connect_errors", "timeouts") and first[0] != last[0]:
        return (f"the server stopped answering (last error: {last[1]}) after it first failed with: {first[1]}; "
                f"check the server's log and restart it (an engine that died does not come back by itself)")
    return f"first error: {(first or last or ('', f'see {FAILURES}'))[1]}"
