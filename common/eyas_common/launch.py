"""The console scripts' first code (eyas-data, eyas-synth, eyas-extract, eyas-train, eyas-serve).

A CLI module imports click, torch or transformers before its own Ctrl-C handling can run: an interrupt in
that second or two printed an import traceback. Each script enters here instead, which imports only the
standard library, then imports its CLI under a guard and runs it. Nothing of a stage has run at that point,
so nothing can be lost.
"""

from __future__ import annotations

import importlib
import sys

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C or SIGTERM (the shell's for SIGINT)


def _start(module: str) -> None:
    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted while starting: nothing was run\n")
        raise SystemExit(INTERRUPTED) from None
    main()


def data() -> None:
    _start("eyas_common.cli")


def synth() -> None:
    _start("eyas_synth.cli")


def extract() -> None:
    _start("eyas_extract.cli")


def train() -> None:
    _start("eyas_train.cli")


def serve() -> None:
    _start("eyas_serve.cli")
