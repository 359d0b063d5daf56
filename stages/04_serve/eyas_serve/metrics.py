"""The engines' speculative-decoding counters, read before and after a run and differenced.

vLLM (`GET /metrics`, Prometheus text; counters summed over engines and models):
    vllm:spec_decode_num_drafts_total                          verification steps that carried a draft
    vllm:spec_decode_num_draft_tokens_total                    draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total                 draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}  accepted at draft position i
    acceptance length = 1 + accepted / drafts (the 1 is the token the target adds to every step);
    acceptance at position i = accepted_i / drafts.
    vllm:generation_tokens_total                               output tokens
    vllm:time_to_first_token_seconds_count                     steps that made a request's first token
    vllm:inter_token_latency_seconds_count                     steps that made a request's later tokens
    tokens per target step = generation tokens / (the two counts): each step of the target yields its own
    token plus the draft tokens it accepted, and the latency histograms observe each request once a step
    (on the engine's side, before streaming may join steps into one chunk). It counts the steps that
    carried no draft too: vLLM's n-gram prompt lookup drafts only where it finds a match, so its acceptance
    length is high over few drafts; an EAGLE-3 draft is proposed after every step, so its figure is the
    acceptance length less the prefill step of each request, which verifies no draft.
A server started without a draft has none of these: `None`, never a made-up 1.0.
SGLang (`GET /server_info`, older `/get_server_info`): `internal_states[i].avg_spec_accept_length` per
data-parallel rank (older versions: top level), a running mean since start-up that already counts the
bonus token; it has no counts to difference and no per-position split, so a fresh server gives the
cleanest figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

_VLLM_PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_POSITION = re.compile(r'position="(\d+)"')
_TOKENS = "vllm:generation_tokens_total"
_STEPS = ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count")
_READ = (_VLLM_PREFIX, _TOKENS, *_STEPS)


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...]  # accepted tokens at draft position 0, 1, ...
    tokens: float = 0.0              # output tokens
    steps: float = 0.0               # target steps that made output tokens (0: the server does not count them)

    def _combine(self, other: "SpecCounters", sign: float) -> "SpecCounters":
        n = max(len(self.per_position), len(other.per_position))
        mine = self.per_position + (0.0,) * (n - len(self.per_position))
        theirs = other.per_position + (0.0,) * (n - len(other.per_position))
        return SpecCounters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                            self.accepted + sign * other.accepted,
                            tuple(a + sign * b for a, b in zip(mine, theirs)),
                            self.tokens + sign * other.tokens, self.steps + sign * other.steps)

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        return self._combine(before, -1.0)

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, 1.0)

    def summary(self) -> dict[str, Any]:
        """The results.json `spec` block; acceptance is null when no step carried a draft, tokens per step when
        no step was counted."""
        d = self.drafts
        return {"drafts": int(d), "draft_tokens": int(self.draft_tokens), "accepted": int(self.accepted),
                "acceptance_length": (1 + self.accepted / d) if d else None,
                "per_position": [a / d for a in self.per_position] if d else [None] * len(self.per_position),
                "tokens_per_step": self.tokens / self.steps if self.steps else None}


def parse_vllm_metrics(text: str) -> SpecCounters | None:
    """The spec-decode counters in a vLLM /metrics page, or None when the server exposes none."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(_READ):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, value = m.group("name"), float(m.group("value"))
        if name == _VLLM_PREFIX + "num_accepted_tokens_per_pos_total":
            pos = _POSITION.search(m.group("labels") or "")
            if pos:
                positions[int(pos.group(1))] = positions.get(int(pos.group(1)), 0.0) + value
        elif name.endswith(("_total", "_count")):
            totals[name] = totals.get(name, 0.0) + value
    if _VLLM_PREFIX + "num_drafts_total" not in totals:
        return None
    per_pos = tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()
    return SpecCounters(totals[_VLLM_PREFIX + "num_drafts_total"],
                        totals.get(_VLLM_PREFIX + "num_draft_tokens_total", 0.0),
                        totals.get(_VLLM_PREFIX + "num_accepted_tokens_total", 0.0), per_pos,
                        totals.get(_TOKENS, 0.0),
                        # both counts or none (a vLLM that names them otherwise reports no steps, not half of them)
                        sum(totals[n] for n in _STEPS) if all(n in totals for n in _STEPS) else 0.0)


def parse_sglang_server_info(info: dict[str, Any]) -> float | None:
    """SGLang's running mean acceptance length (mean over data-parallel ranks), or None without speculation."""
    states = info.get("internal_states")
    values = [s["avg_spec_accept_length"] for s in states or [] if isinstance(s, dict)
              and isinstance(s.get("avg_spec_accept_length"), (int, float))]
    if not values and isinstance(info.get("avg_spec_accept_length"), (int, float)):
        values = [info["avg_spec_accept_length"]]
    return sum(values) / len(values) if values else None


def detect_engine(client: httpx.Client, url: str) -> str:
    """vllm when /metrics carries vLLM's names, else sglang when /server_info answers; else a clear error."""
    try:
        r = client.get(f"{url}/metrics")
        if r.status_code == 200 and "vllm:" in r.text:
            return "vllm"
        for path in ("/server_info", "/get_server_info"):
            r = client.get(f"{url}{path}")
            if r.status_code == 200:
                return "sglang"
    except httpx.HTTPError as e:
        raise ConnectionError(f"{url}: no answer ({type(e).__name__}: {e}); is the server running "
                              f"(`make serve`)?") from None
    raise ConnectionError(f"{url}: neither vLLM's /metrics nor SGLang's /server_info answers; pass --engine")


def read_vllm(client: httpx.Client, url: str) -> SpecCounters | None:
    r = client.get(f"{url}/metrics")
    r.raise_for_status()
    return parse_vllm_metrics(r.text)


def read_sglang(client: httpx.Client, url: str) -> float | None:
    for path in ("/server_info", "/get_server_info"):
        r = client.get(f"{url}{path}")
        if r.status_code == 200:
            return parse_sglang_server_info(r.json())
    r.raise_for_status()
    return None
