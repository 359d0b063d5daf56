"""Running the Makefile from a test: `make` with knobs that fix its output whatever this checkout and machine
are, and `make -n`'s command lines (tests/test_make_images.py, tests/test_makefile.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# knobs that fix the dry-run output whatever this checkout and machine are
FIXED = {"TAG": "abc123", "REGISTRY": "reg.example:5000/team", "SETTINGS": "/nonexistent"}


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
