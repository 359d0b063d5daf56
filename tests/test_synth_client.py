"""Synth's HTTP layer against the stub: retries, fault accounting, failover, fail-fast 4xx."""

from __future__ import annotations

import asyncio
import re
import socket
import time

from eyas_synth.client import ChatPool, RequestFailed, RetryPolicy, report_silence
from eyas_testing.stub import RETRYABLE_FAULTS, Faults, start_stub

FAST = RetryPolicy(max_attempts=8, backoff_s=0.01, max_backoff_s=0.1)
PAYLOAD = {"model": "eyas-stub", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}


async def _chat_all(pool: ChatPool, n: int, concurrency: int) -> list[tuple[dict, str] | RequestFailed]:
    """n chats, `concurrency` at a time; each one's answer or its RequestFailed."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> tuple[dict, str] | RequestFailed:
        async with gate:
            try:
                return await pool.chat(PAYLOAD)
            except RequestFailed as e:
                return e

    return await asyncio.gather(*(one() for _ in range(n)))


def test_faults_are_retried_and_counted_as_injected():
    # 20% retryable faults of every kind (hangs end at the 1 s timeout) and 5% answers without ids.
    faults = Faults(Faults.spread(0.2).rates | {"no_ids": 0.05}, retry_after="0.05", seed=7)
    n = 300

    async def main() -> tuple[list, dict[str, int]]:
        async with ChatPool([stub.url], concurrency=32, timeout_s=1.0, retry=FAST) as pool:
            return await _chat_all(pool, n, 32), pool.stats

    with start_stub(faults=faults) as stub:
        results, stats = asyncio.run(main())
        served = stub.counts()
    failed = [r for r in results if isinstance(r, RequestFailed)]
    answers = [r for r in results if not isinstance(r, RequestFailed)]
    assert len(failed) + len(answers) == n
    assert all(e.attempts == FAST.max_attempts for e in failed)
    assert all(s == stub.url for _, s in answers)
    assert all(served[k] > 0 for k in RETRYABLE_FAULTS), served   # every fault kind was exercised
    # every attempt reached the stub, and each failed attempt is counted under its cause
    assert stats["requests"] == n and stats["requests"] + stats["retries"] == sum(served.values())
    assert stats["http_5xx"] == served["500"] + served["503"]
    assert stats["http_429"] == served["429"]
    assert stats["timeouts"] == served["hang"]
    assert stats["bad_json"] == served["bad_json"]
    assert stats["connect_errors"] == served["drop"]
    assert stats["http_4xx"] == 0 and stats["failed"] == len(failed)
    # text-only answers are answers (the caller renders their ids), not retried
    no_ids = [b for b, _ in answers if "prompt_token_ids" not in b]
    assert len(no_ids) == served["no_ids"] and len(answers) == served["ok"] + served["no_ids"]


def test_retries_move_to_the_healthy_server():
    retry = RetryPolicy(max_attempts=4, backoff_s=0.05, max_backoff_s=1.0)
    n = 200

    async def main() -> tuple[list, dict[str, int]]:
        # the /v1 suffix is accepted and dropped
        async with ChatPool([bad.url, good.url + "/v1/"], concurrency=16, retry=retry) as pool:
            return await _chat_all(pool, n, 16), pool.stats

    with start_stub(faults=Faults({"500": 1.0})) as bad, start_stub() as good:
        results, stats = asyncio.run(main())
        hit_bad, hit_good = bad.counts()["500"], good.counts()["ok"]
    assert all(not isinstance(r, RequestFailed) and r[1] == good.url for r in results)
    # each request failed on the bad server at most once: its retry went to the good one
    assert hit_good == n and stats["retries"] == stats["http_5xx"] == hit_bad
    # and after failing, the bad server was mostly left alone rather than taking half the traffic
    assert hit_bad < n / 4, hit_bad


def test_an_answer_the_server_aborted_is_asked_again():
    """vLLM answers a request it dropped (preempted, shutting down) with finish_reason "abort": synth kept it as a
    sample, or rejected it for good (its id never asked again)."""
    from eyas_testing.stub import vllm_body

    calls = []

    def answer(payload):
        calls.append(1)
        return vllm_body("", [1], [], finish_reason="abort" if len(calls) % 2 else "stop")

    async def main() -> tuple[list, dict[str, int]]:
        async with ChatPool([stub.url], retry=FAST) as pool:
            return await _chat_all(pool, 3, 1), pool.stats

    with start_stub(answer=answer) as stub:
        results, stats = asyncio.run(main())
    assert [body["choices"][0]["finish_reason"] for body, _ in results] == ["stop"] * 3
    assert stats["aborted"] == 3 and stats["retries"] == 3 and stats["failed"] == 0


def test_client_errors_fail_at_once():
    async def main() -> tuple[RequestFailed, dict[str, int]]:
        async with ChatPool([stub.url], retry=FAST) as pool:
            try:
                await pool.chat({"model": "eyas-stub", "prompt": "not a chat"})
            except RequestFailed as e:
                return e, pool.stats
        raise AssertionError("a 400 must raise")

    with start_stub() as stub:
        err, stats = asyncio.run(main())
        assert stub.counts() == {"400": 1}
    assert err.attempts == 1 and "400" in err.last_error and "messages" in err.last_error
    assert stats["http_4xx"] == 1 and stats["retries"] == 0 and stats["failed"] == 1


def test_retry_after_is_honoured_and_attempts_are_bounded():
    retry = RetryPolicy(max_attempts=3, backoff_s=0.001, max_backoff_s=5.0)

    async def main(url: str) -> RequestFailed:
        async with ChatPool([url], retry=retry, timeout_s=2) as pool:
            try:
                await pool.chat(PAYLOAD)
            except RequestFailed as e:
                return e
        raise AssertionError("must fail")

    with start_stub(faults=Faults({"429": 1.0}, retry_after="0.3")) as stub:
        t = time.perf_counter()
        err = asyncio.run(main(stub.url))
        assert time.perf_counter() - t >= 0.6   # two waits of Retry-After, not ~1 ms of backoff
        assert stub.counts() == {"429": 3} and err.attempts == 3 and "429" in err.last_error
    refused = asyncio.run(main("http://127.0.0.1:9"))   # nothing listens on the discard port
    assert refused.attempts == 3 and "ConnectError" in refused.last_error


def test_silence_is_reported_with_which_server_still_answers():
    """A stub whose chats all hang still answers /v1/models (busy); a socket that accepts and never
    answers does not (hung). Lines come at the first silence, then at twice it, not at every tick."""
    lines: list[str] = []

    async def main(urls: list[str]) -> None:
        async with ChatPool(urls, concurrency=4, timeout_s=3.0, retry=RetryPolicy(max_attempts=1)) as pool:
            watch = asyncio.create_task(report_silence(pool, lines.append, first_s=0.4))
            await _chat_all(pool, 4, 4)   # all time out after 3 s
            watch.cancel()

    with start_stub(faults=Faults(rates={"hang": 1.0})) as stub, socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)   # the kernel completes the handshake; nothing ever reads or answers
        hung = f"http://127.0.0.1:{mute.getsockname()[1]}"
        asyncio.run(main([stub.url, hung]))
    assert 1 <= len(lines) <= 3, lines   # at ~0.4 s, then after 0.8 s (and maybe 1.6 s): doubling
    first = lines[0]
    assert re.match(r"no answer for \d s with 4 requests in flight \(each waits up to --timeout 3 s\): ", first), first
    assert f"{stub.url} answers GET /v1/models, so it is up and working on 2" in first
    assert f"{hung} does not answer GET /v1/models either (ReadTimeout): it hangs" in first
