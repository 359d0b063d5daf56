"""The data contract: datasets under a data root, their manifests, atomic writes and refusals.

A dataset is a folder `<root>/<kind>/<name>/` holding data files and a `manifest.json`. The manifest
says what the folder is (`schema`), whether it is finished (`status`), who made it (`producer`), from
what (`inputs`, with the sha256 of each input's manifest), for which target (`target` fingerprints),
how (`params`), what it holds (`files`: bytes, sha256, records) and what was measured (`stats`).
Every consumer goes through `open_input`, which refuses an unknown schema, a partial dataset or a
target mismatch with a message that names the dataset and the fix; every producer through `open_output`,
the one create-or-resume rule. Every file is written by `atomic_output` (or appended by JsonlAppender),
and every producer records `code_version()`.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import io
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from eyas_common import __version__

# Known kinds and the major schema version this code reads and writes.
SCHEMAS: dict[str, int] = {"synth": 1, "hidden": 1, "drafts": 1, "bench": 1}
MANIFEST = "manifest.json"
# A dataset's name: a folder, a make NAME= and a word in the commands eyas prints, so nothing a shell reads.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# How to (re)make each kind: named in every refusal so the user knows what to run.
REMAKE = {
    "synth": "eyas-synth run (make synth)",
    "hidden": "eyas-extract run (make extract)",
    "drafts": "eyas-train run (make train)",
    "bench": "eyas-serve bench (make bench-serve)",
}


class DatasetError(Exception):
    """A refusal: what is wrong (naming the file, line, option or dataset) and the fix, in one line.

    `code` is stable (tests and scripts match it, never the wording): upper-case words such as
    `SYNTH_NOT_EXACT`; `names` is the thing the message names (a path, an option, a dataset ref).
    Plain (no click): library callers catch it; the CLIs print `message` as one line (eyas_common.cli_errors),
    prefixed by the code when there is one.
    """

    def __init__(self, message: str, *, code: str | None = None, names: str | None = None):
        super().__init__(message)
        self.message, self.code, self.names = message, code, names

    @property
    def line(self) -> str:
        return f"[{self.code}] {self.message}" if self.code else self.message


def data_root() -> Path:
    """The data root: $EYAS_DATA, else ./data (the images set EYAS_DATA=/data, where make mounts the host's DATA).
    A set but empty EYAS_DATA is refused: it would mean the working directory, where datasets land by mistake."""
    value = os.environ.get("EYAS_DATA", "data")
    if not value.strip():
        raise DatasetError("EYAS_DATA is set but empty: set it to the data root folder (e.g. /data), or unset it "
                           "for ./data", code="EYAS_DATA_EMPTY", names="EYAS_DATA")
    return Path(value).absolute()


@dataclass(frozen=True)
class Dataset:
    """A dataset reference `kind/name` resolved against a data root."""

    root: Path
    kind: str
    name: str

    @classmethod
    def parse(cls, ref: str, kind: str | None = None, root: Path | None = None) -> "Dataset":
        """`synth/x` or, when `kind` is given, plain `x`; refuses names that leave the root. A path to the folder
        (`/data/synth/x`, `./synth/x`) is taken where it is that dataset under this root, else refused naming the
        EYAS_DATA and reference that reach it."""
        root = Path(root) if root is not None else data_root()
        body = ref.rstrip("/")
        if body.startswith(("/", "./", "../", "~")) or body.count("/") > 1:
            return cls._from_path(body, kind, root)
        parts = body.split("/")
        if len(parts) == 1 and kind is not None:
            parts = [kind, parts[0]]
        if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
            raise DatasetError(f"bad dataset reference {ref!r}: expected KIND/NAME, e.g. synth/synth_10k", code="BAD_REF", names=ref)
        if parts[0] not in SCHEMAS:
            raise DatasetError(f"unknown dataset kind {parts[0]!r} in {ref!r}; known: {', '.join(SCHEMAS)}", code="UNKNOWN_KIND", names=parts[0])
        if not NAME_PATTERN.fullmatch(parts[1]):
            raise DatasetError(f"bad dataset name {parts[1]!r}: use letters, digits and . _ + - (starting with a letter "
                               f"or digit), e.g. synth_10k: a name is a folder, a make NAME= and a shell word", code="BAD_NAME", names=parts[1])
        if kind is not None and parts[0] != kind:
            raise DatasetError(f"{ref!r} is a {parts[0]} dataset, but a {kind} dataset is needed here", code="WRONG_KIND", names=ref)
        return cls(root.absolute(), parts[0], parts[1])

    @classmethod
    def _from_path(cls, ref: str, kind: str | None, root: Path) -> "Dataset":
        path, root = Path(os.path.abspath(Path(ref).expanduser())), root.absolute()
        if len(path.parts) < 3 or path.parent.name not in SCHEMAS:
            raise DatasetError(f"{ref!r} is a path, not a dataset reference: name a dataset KIND/NAME under the data "
                               f"root (EYAS_DATA={root}), e.g. {kind or 'synth'}/NAME", code="REF_IS_PATH", names=ref)
        short = f"{path.parent.name}/{path.name}"
        if path.parent.parent.resolve() != root.resolve():
            raise DatasetError(f"{ref!r} is not under the data root (EYAS_DATA={root}): set EYAS_DATA="
                               f"{path.parent.parent} and name it {short}", code="OUTSIDE_DATA_ROOT", names=ref)
        return cls.parse(short, kind, root)

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def path(self) -> Path:
        return self.root / self.kind / self.name

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def _in_the_way(self) -> str:
        """Why the manifest cannot be read though something is there: a folder where the manifest must be, or a
        file where the dataset's folder (or the data root, or a kind's folder) must be."""
        if self.manifest_path.is_dir():
            return f"{self.ref}: {self.manifest_path} is a folder, not a manifest file; {remake_fix(self)}"
        blocker = file_in_the_way(self.path)
        if blocker == self.path:
            return f"{self.ref}: {self.path} is a file, not a dataset folder; remove it by hand if it is yours"
        return (f"{self.ref}: {blocker} is a file, not a folder: EYAS_DATA (now {self.root}) must be the data root "
                f"folder, with KIND/NAME folders under it")

    def read_manifest(self, check: bool = True) -> dict[str, Any]:
        """The manifest as a dict; with `check`, its `files` field is refused unless well-formed, so that no reader
        trips over a hand-edited one (`eyas-data show` and `list` read it unchecked, to show what is there)."""
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            raise DatasetError(f"{self.ref}: no {MANIFEST} at {self.path}; make it with {REMAKE[self.kind]}", code="NO_MANIFEST", names=self.ref) from None
        except (NotADirectoryError, IsADirectoryError):
            raise DatasetError(self._in_the_way(), code="IN_THE_WAY", names=self.ref) from None
        except json.JSONDecodeError as e:
            raise DatasetError(f"{self.ref}: {self.manifest_path} is not valid JSON (line {e.lineno} column "
                               f"{e.colno}); {remake_fix(self)}", code="MANIFEST_NOT_JSON", names=str(self.manifest_path)) from None
        except UnicodeDecodeError:
            raise DatasetError(f"{self.ref}: {self.manifest_path} is not UTF-8 text; "
                               f"delete it with `eyas-data rm {self.ref}` and rerun {REMAKE[self.kind]}", code="MANIFEST_NOT_UTF8", names=str(self.manifest_path)) from None
        if not isinstance(manifest, dict):
            raise DatasetError(f"{self.ref}: {self.manifest_path} holds a JSON {json_type(manifest)}, not an "
                               f"object; delete it with `eyas-data rm {self.ref}` and rerun {REMAKE[self.kind]}", code="MANIFEST_NOT_OBJECT", names=str(self.manifest_path))
        if check and "files" in manifest and (problem := files_problem(manifest["files"])):
            raise DatasetError(f"{self.ref}: {self.manifest_path}: {problem}; {remake_fix(self)}", code="MANIFEST_FILES", names=str(self.manifest_path))
        return manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        manifest["updated"] = now_iso()
        write_json_atomic(self.manifest_path, manifest)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def remake_fix(ds: Dataset) -> str:
    """The fix for a dataset that cannot be repaired in place, as every such refusal ends."""
    return f"remake it: `eyas-data rm {ds.ref} --yes`, then rerun {REMAKE[ds.kind]}"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages about a file's content: object, array, string..."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def human_bytes(n: float) -> str:
    """n bytes in the largest unit that keeps it at least 1 (GB, MB, KB, B), so a small size never reads 0.00 GB."""
    unit, size = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)) if n >= s), ("B", 1))
    return f"{n / size:.2f} {unit}" if size > 1 else f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------
# Atomic writes: temp file in the same folder, fsync, rename, fsync the folder. A killed writer
# leaves either the old file or the new one, never a torn one. A full or read-only volume is named,
# not hidden: every writer of a dataset file goes through `atomic_output` (or `raise_write_error`).


def raise_write_error(path: Path, e: OSError) -> NoReturn:
    """Raise a full or read-only volume as the contract's one-line error, naming the path and the fix; any
    other OSError as it is. Called from the `except OSError` of every writer of dataset files."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        raise DatasetError(f"disk full while writing {path} ({human_bytes(free)} free on its volume): free space "
                           f"or point EYAS_DATA at a larger volume, then rerun the same command; finished files are "
                           f"kept", code="DISK_FULL", names=str(path)) from e
    if e.errno == errno.EROFS:
        raise DatasetError(f"cannot write {path}: its volume is read-only; point EYAS_DATA (or the path) at a "
                           f"writable one", code="READ_ONLY", names=str(path)) from e
    raise e


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """Where `path` is written before its rename: a dot file beside it, named after this process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def temp_files(path: Path) -> list[Path]:
    """The temp files of `path` left by any process (a killed writer's)."""
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and ".tmp-" in path.name


def holds_work(ds: Dataset) -> bool:
    """Whether a dataset folder holds anything but its manifest: a file with bytes in it (temp files aside)."""
    return any(p.is_file() and p.name != MANIFEST and not is_temp(p) and p.stat().st_size
               for p in ds.path.rglob("*"))


def temp_target(tmp: Path) -> Path:
    """The file temp `tmp` (temp_path's) becomes on its rename."""
    return tmp.with_name(tmp.name[1:].rsplit(".tmp-", 1)[0])


def commit_temp(tmp: Path, path: Path) -> None:
    """fsync the finished temp file, rename it onto `path`, fsync the folder: the last step of every atomic write."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """A temp path beside `path` for the caller to write (with any library); on a clean exit it becomes `path`
    (commit_temp). On an error the temp file is removed and the old file stays; a full or read-only volume
    is raised as the contract's one-line error."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        commit_temp(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise_write_error(path, e)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes | str) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_png_atomic(path: Path, fig: Any) -> Path:
    """A matplotlib Figure (made without pyplot, so nothing holds it after) as a PNG at `path`, replaced
    atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, buf.getvalue())
    return path


def write_json_atomic(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl_atomic(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """A whole JSONL file at once (records as JsonlAppender writes them), replacing the old one atomically."""
    atomic_write(path, b"".join(map(_jsonl_line, records)))


# ---------------------------------------------------------------------------------------------
# JSONL: append-only record files that survive a kill. A record is one line; a torn last line
# (killed mid-write) is cut off on open, so resume never reads half a record.


def _last_line_start(f, end: int, chunk: int = 1 << 20) -> int:
    """Offset just after the last b"\\n" before `end` (0 when there is none), read back in chunks."""
    pos = end
    while pos > 0:
        step = min(chunk, pos)
        f.seek(pos - step)
        at = f.read(step).rfind(b"\n")
        if at >= 0:
            return pos - step + at + 1
        pos -= step
    return 0


def repair_jsonl(path: Path) -> int:
    """Truncate a torn or unparsable last line, whatever its size; return the number of bytes cut.

    Only the last line is ever cut: every byte before the last complete record stays.
    """
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            start = _last_line_start(f, size - 1)
            f.seek(start)
            try:
                json.loads(f.read(size - 1 - start))
                return 0
            except (json.JSONDecodeError, UnicodeDecodeError):
                keep = start
        else:
            keep = _last_line_start(f, size)  # no newline at the end: the last record is torn
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


def iter_jsonl(path: Path, *, torn_end_ok: bool = False, fix: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each line; a malformed line raises naming file, line and (`fix`) what to do.

    torn_end_ok: skip an unparsable last line (what repair_jsonl would cut) instead of raising, to read
    a file left by a killed writer without changing it.
    """
    for lineno, _, record in iter_jsonl_at(path, torn_end_ok=torn_end_ok, fix=fix):
        yield lineno, record


def iter_jsonl_at(path: Path, *, torn_end_ok: bool = False, fix: str = "") -> Iterator[tuple[int, int, Any]]:
    """iter_jsonl with each line's byte offset: (line number, offset, record), to read a record again alone."""
    with open(path, "rb") as f:
        pending: tuple[int, bytes, Exception] | None = None
        pos = 0
        for lineno, line in enumerate(f, 1):
            start, pos = pos, pos + len(line)
            if pending is not None:
                raise _malformed(path, *pending, fix)
            if not line.strip():
                continue
            try:
                yield lineno, start, json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                pending = (lineno, line, e)
        if pending is not None and not torn_end_ok:
            raise _malformed(path, *pending, fix)


def _malformed(path: Path, lineno: int, line: bytes, e: Exception, fix: str) -> DatasetError:
    where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
    what = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
    return DatasetError(f"{path}:{lineno}: malformed JSON ({what}{where}){'; ' + fix if fix else ''}", code="MALFORMED_JSONL", names=f"{path}:{lineno}")


def _jsonl_line(record: dict[str, Any]) -> bytes:
    """One record as a JSONL line: compact JSON and a newline."""
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


class JsonlAppender:
    """Appends one JSON record per line, flushed and fsynced every `sync_every` records."""

    def __init__(self, path: Path, sync_every: int = 16):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_jsonl(self.path)
        self._f = open(self.path, "ab")
        self._pending = 0
        self.sync_every = sync_every

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._f.write(_jsonl_line(record))
            self._pending += 1
            if self._pending >= self.sync_every:
                self.sync()
        except OSError as e:
            raise_write_error(self.path, e)

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._pending = 0

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
            self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JsonlTail:
    """Reads a JSONL file while another process appends to it: each `read_new` returns the records
    completed since the last call, as (line number, byte offset, record).

    A last line without its newline is still being written (JsonlAppender's buffered writes land in pieces),
    or was torn by a kill and will be cut by the writer's next open: it is not a record yet, and is read
    once its newline is there. A complete line that does not parse is refused, like iter_jsonl_at does.
    """

    def __init__(self, path: Path, *, fix: str = ""):
        self.path, self.fix = Path(path), fix
        self.pos = 0      # byte offset just after the last complete line read
        self.lineno = 0

    def read_new(self) -> list[tuple[int, int, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < self.pos:
                raise DatasetError(f"{self.path}: shrank below the {self.pos} bytes already read (replaced or cut "
                                   f"by hand while being read){'; ' + self.fix if self.fix else ''}", code="JSONL_SHRANK", names=str(self.path))
            f.seek(self.pos)
            data = f.read()
        records = []
        for line in data[:data.rfind(b"\n") + 1].split(b"\n")[:-1]:
            self.lineno += 1
            start, self.pos = self.pos, self.pos + len(line) + 1
            if not line.strip():
                continue
            try:
                records.append((self.lineno, start, json.loads(line)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _malformed(self.path, self.lineno, line, e, self.fix) from None
        return records


# ---------------------------------------------------------------------------------------------
# Manifests


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def code_version() -> str | None:
    """The version of the code that writes, as producers record it and resumes compare it.

    In a checkout: the Makefile's TAG rule, the 12-character git sha with `-dirty` when tracked files are
    modified, so two runs of one commit with different local edits are told apart. In an image: the same
    string, read from its tag ($EYAS_IMAGE_TAG = eyas-STAGE:TAG, set at build time) less the variant suffix
    `-cpu`, so a dataset started from a checkout resumes in an image of the same commit (the image itself is
    recorded as the producer's `image`). None outside a git checkout.
    """
    image = os.environ.get("EYAS_IMAGE_TAG")
    if image:
        return image.rpartition(":")[2].removesuffix("-cpu")
    return _checkout_version()


@cache  # the code a process runs is the one it started with
def _checkout_version() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "--short=12", "HEAD")
        return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def producer_info(stage: str) -> dict[str, Any]:
    return {
        "stage": stage,
        "version": __version__,
        "git": code_version(),
        **({"image": os.environ["EYAS_IMAGE_TAG"]} if os.environ.get("EYAS_IMAGE_TAG") else {}),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "argv": sys.argv,
    }


def add_producer(ds: Dataset, manifest: dict[str, Any], stage: str, *, allow_code_change: bool) -> None:
    """Record this process as one more producer of a resumed dataset; refuse other code unless allowed.

    Old and new samples made by different code in one dataset is how a mixed dataset happens, so a
    resume by another version (git sha or image tag) needs --allow-code-change, and is then recorded.
    """
    producers = manifest.setdefault("producers", [manifest["producer"]] if manifest.get("producer") else [])
    me = producer_info(stage)
    before = {p.get("git") for p in producers}
    if producers and me["git"] not in before and not allow_code_change:
        raise DatasetError(f"{ds.ref} was written by code version {', '.join(sorted(map(str, before)))}, this is "
                           f"{me['git']}: mixing outputs of two versions in one dataset is refused. Resume with the "
                           f"version that started it, pick another --name, or pass --allow-code-change", code="CODE_CHANGED", names=ds.ref)
    producers.append(me | {"started": now_iso()})


CHANGE = "{key}={old!r} (now {new!r})"  # how a refusal names a changed param


def changed_params(old: dict[str, Any], new: dict[str, Any], *, may_change: Collection[str],
                   ) -> list[str]:
    """`key=old (now new)` for every param a resume may not change.

    The one resume convention: a stage lists what MAY change; everything else must match, so a setting
    added later is checked by default.
    """
    return [CHANGE.format(key=k, old=old.get(k), new=new.get(k)) for k in sorted(set(old) | set(new))
            if k not in may_change and old.get(k) != new.get(k)]


def input_ref(ds: Dataset) -> dict[str, str]:
    """Lineage entry for an input dataset: its ref and the sha256 of its manifest as read now."""
    return {"ref": ds.ref, "manifest_sha256": sha256_file(ds.manifest_path)}


def new_manifest(kind: str, *, stage: str, target: dict[str, Any] | None, inputs: list[dict[str, str]],
                 params: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": f"eyas.{kind}/{SCHEMAS[kind]}",
        "status": "partial",
        "producer": producer_info(stage),
        "producers": [producer_info(stage) | {"started": now_iso()}],  # one entry per run that wrote into it
        "inputs": inputs,
        "target": target,
        "params": params,
        "files": [],
        "stats": {},
        "created": now_iso(),
        "updated": now_iso(),
    }


def open_output(ds: Dataset, *, stage: str, params: dict[str, Any], may_change: Collection[str],
                target: dict[str, Any] | None, inputs: list[dict[str, str]], allow_code_change: bool = False,
                complete: str = "refuse", resume: bool = True, made_with: dict[str, Any] | None = None,
                fix: str = "resume it with the same options, or pick another --name"
                ) -> dict[str, Any]:
    """The manifest a stage writes its output `ds` with: a new one, or the existing one once a rerun has
    passed every check. Writes nothing (the caller writes it once its own checks have passed too).

    The one create-or-resume rule of every stage:
    - a folder holding files but no manifest is refused: it is not a dataset, or one whose manifest was lost;
    - a complete dataset is refused (complete="refuse"), returned unchanged after the checks below ("keep":
      the caller reports it done), or resumed like a partial one ("extend": synth's larger --n);
    - a partial one is resumed. Its inputs (with the sha256 of each input's manifest), target and params must
      be what this run has: every param but the stage's one `may_change` list (where things are, how hard to
      push), compared with `made_with` (default: the manifest's params). A refusal names each differing param
      (CHANGE: key=old (now new)), then `fix`. This run joins its producers (another code version only with
      allow_code_change) and its params become `params`;
    - resume=False: nothing of a partial dataset can be resumed (train before its first checkpoint, a bench
      run), so it starts over with a new manifest.
    """
    if not ds.exists():
        leftovers = ds.path.exists() and (not ds.path.is_dir() or any(p.is_file() and not is_temp(p)
                                                                     for p in ds.path.rglob("*")))
        if leftovers:
            raise DatasetError(f"{ds.ref}: {ds.path} holds files but no {MANIFEST}; delete it "
                               f"(`eyas-data rm {ds.ref}`) or pick another --name", code="LEFTOVER_FILES", names=ds.ref)
        return new_manifest(ds.kind, stage=stage, target=target, inputs=inputs, params=params)
    manifest = ds.read_manifest()
    check_schema(ds, manifest)
    done = manifest.get("status") == "complete"
    if done and complete == "refuse":
        raise DatasetError(f"{ds.ref} is already complete; choose another --name, or delete it with "
                           f"`eyas-data rm {ds.ref}` and rerun {REMAKE[ds.kind]}", code="ALREADY_COMPLETE", names=ds.ref)
    if not (done or resume):
        return new_manifest(ds.kind, stage=stage, target=target, inputs=inputs, params=params)
    if (manifest.get("inputs") or []) != inputs:
        raise DatasetError(f"{ds.ref} was started from {[i.get('ref') for i in manifest.get('inputs') or []]}, not "
                           f"from {[i['ref'] for i in inputs]} as they are now (an input's manifest changed since); "
                           f"delete it (`eyas-data rm {ds.ref}`) or pick another --name", code="INPUTS_CHANGED", names=ds.ref)
    check_target(ds, manifest, target or {})
    changed = changed_params(manifest.get("params", {}) if made_with is None else made_with, params,
                             may_change=may_change)
    if changed:
        empty = not done and not holds_work(ds)
        raise DatasetError(f"{ds.ref} was made with {', '.join(changed)}; " + (
            f"nothing is in it yet: delete it (`eyas-data rm {ds.ref} --yes`) and rerun with the new options, or "
            f"resume it with the old ones" if empty else fix), code="PARAMS_CHANGED", names=ds.ref)
    if done and complete == "keep":
        return manifest
    add_producer(ds, manifest, stage, allow_code_change=allow_code_change)
    manifest["params"] = params
    return manifest


# What every entry of a manifest's `files` holds (describe_files writes them; `records` and others are optional).
FILE_ENTRY = {"name": str, "bytes": int, "sha256": str}


def files_problem(files: Any) -> str | None:
    """What makes a manifest's `files` unusable (not a list of FILE_ENTRY objects), or None."""
    if not isinstance(files, list):
        return f"`files` is a JSON {json_type(files)}, expected an array of files"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            return f"`files[{i}]` is a JSON {json_type(entry)}, expected an object"
        for key, kind in FILE_ENTRY.items():
            if type(entry.get(key)) is not kind:  # exact: a JSON true is no byte count
                found = f"is a JSON {json_type(entry[key])}" if key in entry else "is missing"
                return f"`files[{i}].{key}` {found}, expected a {json_type(kind())}"
    return None


def final_files(ds: Dataset) -> list[Path]:
    """Every final file in the dataset's folder: not its manifest, not a writer's temp file."""
    return [p for p in sorted(ds.path.rglob("*")) if p.is_file() and p.name != MANIFEST and not is_temp(p)]


def describe_files(ds: Dataset, records: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """bytes, sha256 and (where known) record count of every final file in the dataset."""
    records = records or {}
    files = []
    for p in final_files(ds):
        rel = p.relative_to(ds.path).as_posix()
        entry: dict[str, Any] = {"name": rel, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        if rel in records:
            entry["records"] = records[rel]
        files.append(entry)
    return files


def finalize(ds: Dataset, manifest: dict[str, Any], *, stats: dict[str, Any],
             records: dict[str, int] | None = None) -> dict[str, Any]:
    """Hash every file, record stats and mark the dataset complete (last write of a stage)."""
    manifest["files"] = describe_files(ds, records)
    manifest["stats"] = stats
    manifest["status"] = "complete"
    ds.write_manifest(manifest)
    return manifest


def check_schema(ds: Dataset, manifest: dict[str, Any]) -> None:
    schema = str(manifest.get("schema", ""))
    kind, _, ver = schema.partition("/")
    expected = f"eyas.{ds.kind}"
    if kind != expected or not ver.isdigit():
        raise DatasetError(f"{ds.ref}: schema {schema!r} is not a {expected} dataset; "
                           f"delete it (`eyas-data rm {ds.ref}`) and rerun {REMAKE[ds.kind]}", code="WRONG_SCHEMA", names=ds.ref)
    if int(ver) != SCHEMAS[ds.kind]:
        raise DatasetError(f"{ds.ref}: schema {schema!r}, but this eyas reads {expected}/{SCHEMAS[ds.kind]}; "
                           f"use the eyas version that wrote it, or rerun {REMAKE[ds.kind]} with this one", code="SCHEMA_VERSION", names=ds.ref)


def check_complete(ds: Dataset, manifest: dict[str, Any], *, allow_partial: bool = False) -> None:
    """Refuse a dataset that is not finished (unless `allow_partial`), or whose status or file list no producer
    writes: a producer writes 'partial' while it runs and 'complete', with every file listed, at its end."""
    status = manifest.get("status")
    if status not in ("partial", "complete"):
        has = "no status" if status is None else f"status {status!r}"
        raise DatasetError(f"{ds.ref}: {ds.manifest_path} has {has}, which no eyas stage writes: it was "
                           f"edited; {remake_fix(ds)}", code="BAD_STATUS", names=ds.ref)
    if status == "partial" and not allow_partial:
        raise DatasetError(f"{ds.ref}: status is 'partial', not 'complete' (its producer stopped before the "
                           f"end); rerun {REMAKE[ds.kind]} with the same name to finish it", code="PARTIAL", names=ds.ref)
    if status == "complete" and "files" not in manifest:
        raise DatasetError(f"{ds.ref}: {ds.manifest_path} is complete but lists no `files`: it was "
                           f"edited; {remake_fix(ds)}", code="NO_FILES_LIST", names=ds.ref)


def open_input(ref: str, kind: str, *, allow_partial: bool = False, root: Path | None = None
               ) -> tuple[Dataset, dict[str, Any]]:
    """Open a dataset a stage consumes; refuse anything unknown, partial or malformed."""
    ds = Dataset.parse(ref, kind, root)
    if not ds.path.is_dir():
        raise DatasetError(f"{ds.ref}: not under EYAS_DATA={ds.root}; make it with {REMAKE[kind]}, or point "
                           f"EYAS_DATA at the data root that holds it", code="NO_DATASET", names=ds.ref)
    manifest = ds.read_manifest()
    check_schema(ds, manifest)
    check_complete(ds, manifest, allow_partial=allow_partial)
    return ds, manifest


def await_start(ref: str, kind: str, *, root: Path | None, poll_s: float, say: Any) -> None:
    """--follow: wait until the producer of `ref` has started it (its manifest is there), saying so every
    30 s, so that the stages of a pipeline can be started together (`make pipeline`)."""
    ds = Dataset.parse(ref, kind, root)
    said_at = None
    while not ds.manifest_path.exists():
        if said_at is None or time.monotonic() - said_at >= 30:
            say(f"waiting for {ds.ref} to be started (no {MANIFEST} at {ds.path} yet)")
            said_at = time.monotonic()
        time.sleep(poll_s)


def check_target(ds: Dataset, manifest: dict[str, Any], fingerprint: dict[str, Any]) -> None:
    """Refuse a dataset made for another tokenizer or chat template than the one loaded now."""
    made = manifest.get("target") or {}
    if not isinstance(made, dict):  # a hand-edited manifest: name it, rather than fail on made.get
        raise DatasetError(f"{ds.ref}: {ds.manifest_path}: `target` is a JSON {json_type(made)}, expected the "
                           f"target's fingerprint (an object); it was edited; {remake_fix(ds)}", code="BAD_TARGET", names=ds.ref)
    for key, what in (("tokenizer_sha256", "tokenizer"), ("chat_template_sha256", "chat template")):
        if fingerprint.get(key) and not made.get(key):  # every stage records both: edited, or another tool's
            raise DatasetError(f"{ds.ref}: {ds.manifest_path} records no `target.{key}` (the target that made "
                               f"it); {remake_fix(ds)}", code="NO_TARGET_HASH", names=ds.ref)
        if made.get(key) != fingerprint.get(key):
            raise DatasetError(
                f"{ds.ref}: the {what} of {fingerprint.get('model')} is not the one it was made with (that of "
                f"{Path(str(made.get('model'))).name}); pass that target as --model", code="TARGET_MISMATCH",
                names=ds.ref)


def verify(ds: Dataset) -> list[str]:
    """The problems of a dataset's files against its manifest ('NAME: missing', ...), without the dataset's ref;
    one of a manifest that cannot be checked (unknown schema, not complete: check_schema, check_complete)."""
    manifest = ds.read_manifest()
    try:
        check_schema(ds, manifest)
        check_complete(ds, manifest)
    except DatasetError as e:
        return [e.message.removeprefix(f"{ds.ref}: ")]
    return file_problems(ds, manifest)


def file_problems(ds: Dataset, manifest: dict[str, Any], names: set[str] | None = None) -> list[str]:
    """Recompute bytes and sha256 of every file the complete `manifest` lists, and find files it does not list;
    with `names`, of those files only (a reader that needs a few files of a large dataset hashes just them)."""
    problems = []
    listed = {entry["name"] for entry in manifest["files"]}
    for name in sorted(names - listed) if names is not None else []:
        problems.append(f"{name}: not in the manifest")
    for entry in manifest["files"]:
        if names is not None and entry["name"] not in names:
            continue
        p = ds.path / entry["name"]
        if not p.is_file():
            problems.append(f"{entry['name']}: missing")
        elif p.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['name']}: {p.stat().st_size} bytes, manifest says {entry['bytes']}")
        elif sha256_file(p) != entry["sha256"]:
            problems.append(f"{entry['name']}: sha256 differs from the manifest")
    for name in (p.relative_to(ds.path).as_posix() for p in final_files(ds)) if names is None else []:
        if name not in listed:
            problems.append(f"{name}: present but not in the manifest")
    return problems


def check_intact(ds: Dataset, manifest: dict[str, Any], names: set[str] | None = None) -> None:
    """Refuse a dataset that is not complete, or whose files (`names` only, when given) are not the ones its
    manifest lists, in one line naming the first problems and the fix: what `eyas-data verify` and every reader
    of a finished dataset run."""
    check_schema(ds, manifest)
    check_complete(ds, manifest)
    if problems := file_problems(ds, manifest, names):
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise DatasetError(f"{ds.ref}: {'; '.join(problems[:3])}{more}: changed after it was finished; "
                           f"restore it, or {remake_fix(ds)}", code="FILES_CHANGED", names=ds.ref)


def list_datasets(root: Path | None = None) -> list[tuple[Dataset, dict[str, Any] | None]]:
    root = Path(root) if root is not None else data_root()
    out = []
    for kind in SCHEMAS:
        kdir = root / kind
        if not kdir.is_dir():
            continue
        for d in sorted(p for p in kdir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            ds = Dataset(root.absolute(), kind, d.name)
            try:
                out.append((ds, ds.read_manifest(check=False)))  # a listing shows even a malformed one
            except (DatasetError, OSError):  # one bad dataset must not hide the others
                out.append((ds, None))
    return out


def file_in_the_way(path: Path) -> Path | None:
    """The first of PATH and its parents that exists and is not a folder (a file where a folder must be), or None."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def lock_file(ds: Dataset, part: str = "") -> Path:
    """The writer lock of a dataset (eyas_common.lock), beside its folder so the folder's bytes stay the data's."""
    return ds.root / ds.kind / f".{ds.name}{'.' + part if part else ''}.lock"


def folder_bytes(path: Path) -> int:
    if Path(path).is_symlink():
        return 0
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())
