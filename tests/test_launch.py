"""The console scripts' entry (eyas_common.launch) and the CLIs' group: a Ctrl-C before a command's own handling
is one line and exit status 130, never an import traceback nor click's `Aborted!` with 1."""

from __future__ import annotations

import importlib
import sys
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


def test_an_interrupt_no_command_handled_exits_130():
    @click.group(cls=EyasGroup)
    def cli() -> None:
        pass

    @cli.command()
    def wait() -> None:
        raise KeyboardInterrupt

    r = CliRunner().invoke(cli, ["wait"])
    assert r.exit_code == 130 and r.output == "interrupted\n" and "Aborted" not in r.output
