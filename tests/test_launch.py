"""The console scripts' entry (eyas_common.launch) and the CLIs' group (cli_errors): a Ctrl-C before a command's
own handling is one line and exit status 130, never an import traceback nor click's `Aborted!` with 1; a file where
a folder must be is one line."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import tomllib

import click
import pytest
from click.testing import CliRunner

from eyas_common import launch
from eyas_common.cli_errors import EyasGroup
from helpers import REPO


def test_every_console_script_starts_through_the_guard():
    """A script added to a pyproject that names its CLI module directly would import torch unguarded."""
    scripts = {}
    for path in [REPO / "common/pyproject.toml", *sorted(REPO.glob("stages/*/pyproject.toml"))]:
        scripts |= tomllib.loads(path.read_text())["project"]["scripts"]
    assert set(scripts) == {"eyas-data", "eyas-synth", "eyas-extract", "eyas-train", "eyas-serve"}
    for name, entry in scripts.items():
        module, func = entry.split(":")
        assert module == "eyas_common.launch" and func == name.removeprefix("eyas-"), entry
        cli = {"data": "eyas_common.cli"}.get(func, f"eyas_{func}.cli")
        assert callable(importlib.import_module(cli).main), cli


def test_an_interrupt_while_a_cli_imports_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "slow_cli.py").write_text("raise KeyboardInterrupt  # Ctrl-C inside `import torch`\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        launch._start("slow_cli")
    assert e.value.code == 130 and capsys.readouterr().err == "interrupted while starting: nothing was run\n"
    sys.modules.pop("slow_cli", None)


def raising(error: BaseException) -> click.Group:
    """An EyasGroup whose one command, `go`, raises `error`."""
    @click.group(cls=EyasGroup)
    def cli() -> None:
        pass

    @cli.command()
    def go() -> None:
        raise error

    return cli


def test_an_interrupt_no_command_handled_exits_130():
    r = CliRunner().invoke(raising(KeyboardInterrupt()), ["go"])
    assert r.exit_code == 130 and r.output == "interrupted\n" and "Aborted" not in r.output


def test_a_file_where_a_folder_must_be_is_one_line():
    """EYAS_DATA (or a path under it) naming a file: a stage's first mkdir raised NotADirectoryError, a traceback."""
    import errno

    r = CliRunner().invoke(raising(NotADirectoryError(errno.ENOTDIR, "Not a directory", "/srv/data/drafts")), ["go"])
    assert r.exit_code == 1 and r.output == ("Error: /srv/data/drafts: Not a directory; a file is where a folder must "
                                             "be: point EYAS_DATA (or the path) at a folder\n"), r.output


SIGTERM_MID_GATHER = """
import asyncio, sys
from eyas_common.procs import run_interruptible, sigterm_as_interrupt

async def busy():
    while True:
        sum(range(2000))  # the signal lands inside a task most of the time
        await asyncio.sleep(0)

async def many():
    tasks = [asyncio.create_task(busy()) for _ in range(8)]
    print("ready", flush=True)
    await asyncio.gather(*tasks)

with sigterm_as_interrupt():
    try:
        run_interruptible(many())
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


def test_sigterm_inside_a_loop_of_tasks_ends_as_one_interrupt_and_no_traceback():
    """The bench's and synth's loops: a SIGTERM raised inside a task printed its traceback at shutdown."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "common"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_MID_GATHER], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and out.strip() == "interrupted", (out, err)
    assert "Traceback" not in err, err
