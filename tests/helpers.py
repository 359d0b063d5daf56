"""What several test modules share and no benchmark needs (builders of targets and datasets are in
eyas_testing): running the Makefile with knobs that fix its output and reading `make -n`'s command lines;
stub answers rendered with a real tokenizer; a tiny EAGLE-3 draft with sharp attention."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from eyas_common.chat import render_completion, render_prompt
from eyas_testing.stub import vllm_body

# --- the Makefile (tests/test_makefile.py, tests/test_make_images.py) ----------------------------------------
REPO = Path(__file__).resolve().parents[1]
# knobs that fix the dry-run output whatever this checkout and machine are (no settings file: /dev/null is empty)
FIXED = {"TAG": "abc123", "REGISTRY": "reg.example:5000/team", "SETTINGS": "/dev/null"}


def make(*args: str, env: dict[str, str] | None = None, **knobs: str | None) -> subprocess.CompletedProcess:
    """make ARGS KNOB=value ... in the checkout (FIXED knobs first; a knob given None is left out)."""
    env = {k: v for k, v in (env or os.environ).items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    knobs = {k: v for k, v in {**FIXED, **knobs}.items() if v is not None}
    cmd = ["make", "--no-print-directory", "-C", str(REPO), *args, *(f"{k}={v}" for k, v in knobs.items())]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def dry_lines(*targets: str, **knobs: str) -> list[str]:
    """The commands `make -n` would run, one per line, without the usage guards."""
    r = make("-n", *targets, **knobs)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if line and not line.startswith("test -n")]


def remote(cmd: str) -> list[str]:
    """ssh ... 'REMOTE': the ssh words, then the remote command as the remote shell will split it."""
    words = shlex.split(cmd)
    return words[:-1] + [words[-1]]


# --- synth against the stub (tests/test_synth.py, tests/test_data_safety.py) -----------------------------------
def rendering_answer(tok):
    """Stub answers shaped like the fixture's (ids rendered with the real tokenizer); every 7th is cut by length."""
    def answer(payload):
        msgs = payload["messages"]
        prompt = render_prompt(tok, msgs, (payload.get("chat_template_kwargs") or {}).get("thinking"))
        q = msgs[-1]["content"]
        if payload["seed"] % 7 == 3:
            completion = render_completion(tok, prompt, "I keep thinking about " + q, "", finished=False)
            return vllm_body("", prompt, completion, reasoning="I keep thinking about " + q, finish_reason="length")
        reasoning, content = f"The question was {q}", f"The answer to {q}"
        return vllm_body(content, prompt, render_completion(tok, prompt, reasoning, content), reasoning=reasoning)
    return answer


# --- a draft to train (tests/test_train_ttt.py, tests/test_train_packing.py) -----------------------------------
V, VD = 40, 24


def tiny(norm_before_residual: bool = False, seed: int = 0) -> Any:
    """A float64 Eagle3Draft over V tokens (VD in its draft vocabulary) whose attention is far from uniform."""
    # imported here: the Makefile tests import this module too, and need no torch
    import torch

    from eyas_train.model import DraftConfig, Eagle3Draft
    from eyas_train.vocab import build_vocab

    cfg = DraftConfig(vocab_size=V, draft_vocab_size=VD, hidden_size=16, target_hidden_size=16, num_aux=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                      rms_norm_eps=1e-6, max_position_embeddings=64, norm_before_residual=norm_before_residual)
    d = Eagle3Draft(cfg).double()
    d.init_weights(seed)
    with torch.no_grad():
        d.embed.weight.normal_(generator=torch.Generator().manual_seed(seed + 1))
        # weights at init are small (0.02); scale up so attention patterns are far from uniform
        for p in d.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(20)
    vocab = build_vocab(torch.arange(V).flip(0), VD)
    d.d2t.copy_(vocab.d2t)
    d.t2d.copy_(vocab.t2d)
    return d


# --- refusals (every test of a coded refusal) --------------------------------------------------------------------
@contextmanager
def refuses(code: str, names: str | None = None) -> Iterator[Any]:
    """`with refuses(CODE, NAMES): ...`: the body raises a DatasetError that assert_refused accepts."""
    from eyas_common.contract import DatasetError

    with pytest.raises(DatasetError) as raised:
        yield raised
    assert_refused(raised.value, code, names)


def assert_refused(error: BaseException | str, code: str, names: str | None = None) -> None:
    """A coded refusal: a DatasetError (or a CLI's output / `Error:` line) with CODE, naming NAMES, in one line of
    at most 200 characters. The wording is free to change; the code and the thing named are not."""
    if isinstance(error, BaseException):
        assert getattr(error, "code", None) == code, f"expected [{code}], got {error!r}"
        line = error.line  # type: ignore[attr-defined]
    else:
        lines = [x for x in error.splitlines() if f"[{code}]" in x]
        assert len(lines) == 1 and "Traceback" not in error, error
        line = lines[0].removeprefix("Error: ")
    # measured as a user reads it: a test's temporary folder stands for a data root such as /data
    short = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/(popen-gw\d+/)?[^/\s)'\"]+", "/data", line)
    assert len(short) <= 200 + len(code) + 3, f"{len(short)} characters: {short}"
    assert names is None or names in line, f"{names!r} not named in: {line}"
