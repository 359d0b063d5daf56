"""One line, no traceback, for every error a user can cause: the click group all eyas CLIs use, and their
number type that refuses nan and inf.

Library code raises DatasetError (plain, click-free) with a message that names the file or option and
the fix; this group prints it as `Error: ...` with exit status 1. Operating-system refusals a user
causes (a read-only data root, no permission, a full disk) are printed the same way, with the path.
"""

from __future__ import annotations

import errno
import math
from typing import Any

import click

from eyas_common.contract import DatasetError
from eyas_common.launch import INTERRUPTED

_OS_FIX = {
    errno.EROFS: "the volume is read-only: point EYAS_DATA (or the path) at a writable one",
    errno.EACCES: "no permission: fix the owner/permissions, or point EYAS_DATA at a folder you own",
    errno.EPERM: "not permitted: fix the owner/permissions, or point EYAS_DATA at a folder you own",
    errno.ENOSPC: "disk full: free space or point EYAS_DATA at a larger volume, then rerun (finished work is kept)",
    errno.EDQUOT: "disk quota exceeded: free space or point EYAS_DATA at another volume, then rerun",
    errno.ENOTDIR: "a file is where a folder must be: point EYAS_DATA (or the path) at a folder",
}


class EyasGroup(click.Group):
    """A click group that turns DatasetError and user-caused OSErrors into one-line errors, and a Ctrl-C that no
    command handled (one that was not writing anything) into exit status 130 rather than click's `Aborted!`, 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            raise SystemExit(INTERRUPTED) from None
        except DatasetError as e:
            raise click.ClickException(e.line) from None
        except OSError as e:
            if e.errno not in _OS_FIX:
                raise
            raise click.ClickException(f"{e.filename or ''}: {e.strerror}; {_OS_FIX[e.errno]}".lstrip(": ")) from None


class Finite(click.FloatRange):
    """A FloatRange that refuses nan and inf: click's range check lets nan through (every comparison with it is
    false), and a nan temperature or timeout only fails later, deep in a request or a wait that never ends."""

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r}: expected a finite number", param, ctx)
        return rv
