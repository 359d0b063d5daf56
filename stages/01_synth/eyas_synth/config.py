"""Stage 01's configuration: the options `eyas-synth run` is asked, and the record each dataset saves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from eyas_common.contract import DatasetError
from eyas_common.samples import parse_budget

# Params a resumed run may change (where things are, how hard to push, what to accept); every other
# param defines what a sample is and must match, including any added later. max_model_len is the server's,
# not an option: a replacement server may have another, and each sample records where it was cut.
MAY_CHANGE = ("prompts", "model", "served_model", "servers", "n", "concurrency", "timeout_s", "max_attempts",
              "allow_missing", "allow_rejected", "breaker_s", "max_model_len")

@dataclass(frozen=True)
class SynthOptions:
    """What `eyas-synth run` is asked (its options, defaults as in --help); `run` resolves them."""

    prompts: Path                 # prompts file (JSONL messages/conversations, or plain text)
    name: str                     # output dataset: synth/NAME (resumed if present)
    model: Path                   # local path of the target's tokenizer
    servers: list[str]            # base URLs of OpenAI-compatible servers
    n: int | None = None          # samples to make; None: one per prompt
    max_tokens: int = 4096        # completion budget per sample, tokens
    temperature: float = 0.6
    top_p: float = 0.95
    thinking: bool | None = None  # the template's thinking switch; None: decided from the target
    seed: int | None = None       # per-request seed base; None: none sent
    drop_truncated: bool = False  # length-truncated answers to truncated.jsonl instead of samples.jsonl
    concurrency: int = 128        # requests in flight, all servers together
    timeout_s: float = 600.0      # per-request timeout, seconds
    max_attempts: int = 8         # tries per request before it is recorded as failed
    served_model: str | None = None  # model name sent; None: the server's only one
    allow_missing: str = "0"      # samples that may be missing at the end: a count or a percentage
    allow_rejected: str = "1%"    # answers that may fail validation: a count or a percentage
    breaker_s: float = 120.0      # stop when every server has failed for this long, seconds
    allow_code_change: bool = False  # resume a dataset started by another eyas version
    trust_remote_code: bool = False  # run the tokenizer code shipped with the target (explicit opt-in)

    def check(self) -> None:
        """Refuse options no run could use, before anything slow or any request."""
        if not self.servers:
            raise DatasetError("no --server given: pass the base URL of a running vLLM or SGLang server")
        for server in self.servers:
            check_server_url(server)
        for opt, value, low in (("--n", self.n, 1), ("--concurrency", self.concurrency, 1),
                                ("--max-tokens", self.max_tokens, 1), ("--max-attempts", self.max_attempts, 1),
                                ("--timeout", self.timeout_s, 1e-9)):
            if value is not None and value < low:
                raise DatasetError(f"{opt} {value}: must be at least {low if low >= 1 else 'above 0'}")
        for opt, value in (("--allow-missing", self.allow_missing), ("--allow-rejected", self.allow_rejected)):
            try:
                parse_budget(value)
            except ValueError as e:
                raise DatasetError(f"{opt} {e}") from None


def check_server_url(server: str) -> str:
    """--server as its base URL (http(s)://host[:port][/prefix], a trailing /v1 dropped); a malformed one is refused
    in one line naming it, before anything is asked of it (httpx's own error says neither which --server nor the fix)."""
    try:
        url = httpx.URL(server)
        scheme, host, path = url.scheme, url.host, url.path
    except httpx.InvalidURL as e:
        raise DatasetError(f"--server {server!r} is not a URL ({e}); write it as http://HOST:PORT") from None
    if scheme not in ("http", "https"):
        example = f"http://{server}" if "://" not in server else "http://HOST:PORT"
        raise DatasetError(f"--server {server!r}: {f'scheme {scheme!r}' if '://' in server else 'no scheme'}; write it "
                           f"as {example} (an OpenAI-compatible server's base URL)")
    if not host:
        raise DatasetError(f"--server {server!r}: no host; write it as http://HOST:PORT")
    base = server.rstrip("/").removesuffix("/v1")
    for route in ("/chat/completions", "/models"):
        if path.rstrip("/").endswith(route):
            raise DatasetError(f"--server {server!r} names a route; pass the server's base URL, "
                               f"{base[:base.rindex(route)].removesuffix('/v1')}")
    return base


@dataclass
class SynthConfig:
    prompts: str                  # prompts file (JSONL messages/conversations, or plain text)
    prompts_sha256: str           # its content hash: a resume must read the same prompts
    model: str                    # local path of the target's tokenizer (and weights, for later stages)
    served_model: str             # model name sent to the server
    servers: list[str]            # base URLs of OpenAI-compatible servers
    n: int                        # samples to make (sample i answers prompt i mod #prompts)
    max_tokens: int               # completion budget per sample, tokens (fitted to the context, below)
    max_model_len: int | None     # the server's context (prompt + completion), from /v1/models; None: unknown
    temperature: float            # sent explicitly: servers otherwise apply generation_config defaults
    top_p: float
    thinking: bool | None         # the chat-template thinking switch sent; None: none (the template's default)
    seed: int | None              # per-request seed = seed * 1_000_003 + sample id; None: no seed sent
    drop_truncated: bool          # length-truncated samples go to truncated.jsonl instead of samples.jsonl
    concurrency: int              # requests in flight, all servers together
    timeout_s: float              # per-request timeout, seconds
    max_attempts: int             # tries per request before it is recorded as failed
    allow_missing: str            # samples that may be missing at the end: a count (5) or a percentage (0.5%)
    allow_rejected: str           # answers that may fail validation: a count or a percentage of n
    breaker_s: float              # stop the run when every server has failed for this long, seconds
    trust_remote_code: bool = False  # the tokenizer's own code (shipped with the target) was run


