"""The data contract: refs, manifests, atomic writes, torn JSONL, refusals, eyas-data."""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from eyas_common import contract
from eyas_common.cli import main as data_cli
from eyas_common.contract import Dataset, DatasetError
from helpers import assert_refused, refuses


def make_dataset(root, name="d1", status="complete", schema=None, target=None) -> Dataset:
    ds = Dataset.parse(f"synth/{name}", root=root)
    ds.path.mkdir(parents=True)
    (ds.path / "samples.jsonl").write_text('{"id": 0}\n{"id": 1}\n')
    m = contract.new_manifest("synth", stage="test", target=target or {"tokenizer_sha256": "a", "chat_template_sha256": "b"},
                              inputs=[], params={})
    if schema:
        m["schema"] = schema
    if status == "complete":
        contract.finalize(ds, m, stats={"samples": 2}, records={"samples.jsonl": 2})
    else:
        ds.write_manifest(m)
    return ds


def test_refs_parse_and_refuse(tmp_path):
    assert Dataset.parse("synth/x", root=tmp_path).path == tmp_path / "synth" / "x"
    assert Dataset.parse("x", "hidden", root=tmp_path).ref == "hidden/x"
    for bad in ("synth/../etc", "nope/x", "a/b/c", "synth/"):
        with pytest.raises(DatasetError):
            Dataset.parse(bad, root=tmp_path)
    with refuses("WRONG_KIND", "synth/x"):
        Dataset.parse("synth/x", "hidden", root=tmp_path)
    # a path to the folder: taken under this root (trailing slash too), else the EYAS_DATA that reaches it is named
    assert Dataset.parse(f"{tmp_path}/drafts/d/", "drafts", root=tmp_path).ref == "drafts/d"
    with refuses("OUTSIDE_DATA_ROOT", "/srv/eyas/drafts/d"):
        Dataset.parse("/srv/eyas/drafts/d", "drafts", root=tmp_path)
    with refuses("REF_IS_PATH", "/tmp"):
        Dataset.parse("/tmp", "drafts", root=tmp_path)   # was drafts/tmp


def test_manifest_complete_roundtrip_and_lineage(tmp_path):
    ds = make_dataset(tmp_path)
    m = ds.read_manifest()
    assert m["schema"] == "eyas.synth/1" and m["status"] == "complete"
    assert m["files"] == [{"name": "samples.jsonl", "bytes": 20, "records": 2,
                           "sha256": contract.sha256_file(ds.path / "samples.jsonl")}]
    assert m["producer"]["stage"] == "test" and m["producer"]["version"]
    _, opened = contract.open_input("synth/d1", "synth", root=tmp_path)
    assert opened == m
    ref = contract.input_ref(ds)
    assert ref == {"ref": "synth/d1", "manifest_sha256": contract.sha256_file(ds.manifest_path)}


def test_open_input_refusals_name_dataset_and_fix(tmp_path):
    make_dataset(tmp_path, "part", status="partial")
    with refuses("PARTIAL", "synth/part"):
        contract.open_input("synth/part", "synth", root=tmp_path)
    contract.open_input("synth/part", "synth", root=tmp_path, allow_partial=True)
    make_dataset(tmp_path, "future", schema="eyas.synth/2")
    with refuses("SCHEMA_VERSION", "synth/future"):
        contract.open_input("synth/future", "synth", root=tmp_path)
    make_dataset(tmp_path, "alien", schema="other/1")
    with refuses("WRONG_SCHEMA", "synth/alien"):
        contract.open_input("synth/alien", "synth", root=tmp_path)
    with refuses("NO_DATASET", "synth/missing"):
        contract.open_input("synth/missing", "synth", root=tmp_path)
    bad = Dataset.parse("synth/garbled", root=tmp_path)
    bad.path.mkdir(parents=True)
    bad.manifest_path.write_text("{not json")
    with refuses("MANIFEST_NOT_JSON", "garbled/manifest.json"):
        contract.open_input("synth/garbled", "synth", root=tmp_path)


def test_target_mismatch_refused(tmp_path):
    ds = make_dataset(tmp_path)
    m = ds.read_manifest()
    contract.check_target(ds, m, {"tokenizer_sha256": "a", "chat_template_sha256": "b"})
    with refuses("TARGET_MISMATCH", "synth/d1"):
        contract.check_target(ds, m, {"tokenizer_sha256": "a", "chat_template_sha256": "other", "model": "/m"})
    with refuses("TARGET_MISMATCH", "tokenizer"):
        contract.check_target(ds, m, {"tokenizer_sha256": "zz", "chat_template_sha256": "b"})
    # a manifest with no fingerprint (edited, or another tool's) says so, not "made with (None; None vs a)"
    with refuses("NO_TARGET_HASH", "target.tokenizer_sha256"):
        contract.check_target(ds, {**m, "target": {}}, {"tokenizer_sha256": "a", "chat_template_sha256": "b"})


def test_verify_detects_corruption(tmp_path):
    ds = make_dataset(tmp_path)
    assert contract.verify(ds) == []
    with open(ds.path / "samples.jsonl", "r+b") as f:
        f.write(b"[")
    assert any("sha256 differs" in p for p in contract.verify(ds))
    (ds.path / "samples.jsonl").write_text("x")
    assert any("bytes, manifest says" in p for p in contract.verify(ds))
    (ds.path / "stray.bin").write_text("x")
    assert any("stray.bin: present but not in the manifest" in p for p in contract.verify(ds))


def test_atomic_write_leaves_no_temp_and_reports_full_disk(tmp_path, monkeypatch):
    p = tmp_path / "a" / "f.json"
    contract.write_json_atomic(p, {"x": 1})
    contract.write_json_atomic(p, {"x": 2})
    assert json.loads(p.read_text()) == {"x": 2}
    assert [q.name for q in p.parent.iterdir()] == ["f.json"]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with refuses("DISK_FULL", "f.json"):
        contract.write_json_atomic(p, {"x": 3})
    assert json.loads(p.read_text()) == {"x": 2}  # the old file survives
    assert [q.name for q in p.parent.iterdir()] == ["f.json"]


def test_torn_jsonl_is_repaired(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_bytes(b'{"id": 0}\n{"id": 1}\n{"id": 2, "inp')
    assert contract.repair_jsonl(p) == len(b'{"id": 2, "inp')
    assert [r["id"] for _, r in contract.iter_jsonl(p)] == [0, 1]
    p.write_bytes(b'{"id": 0}\n{"id": 1,,}\n')  # a complete-looking but unparsable last line
    contract.repair_jsonl(p)
    assert p.read_bytes() == b'{"id": 0}\n'
    with contract.JsonlAppender(p) as w:
        w.write({"id": 5})
    assert [r["id"] for _, r in contract.iter_jsonl(p)] == [0, 5]
    p.write_bytes(b'{"id": 0}\n{bad}\n{"id": 2}\n')
    with refuses("MALFORMED_JSONL", "s.jsonl:2"):
        list(contract.iter_jsonl(p))


def test_eyas_data_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    make_dataset(tmp_path, "good")
    make_dataset(tmp_path, "half", status="partial")
    r = CliRunner().invoke(data_cli, ["list"])
    assert r.exit_code == 0 and "synth/good" in r.output and "complete" in r.output and "partial" in r.output
    r = CliRunner().invoke(data_cli, ["show", "synth/good"])
    assert json.loads(r.output)["status"] == "complete"
    assert CliRunner().invoke(data_cli, ["verify", "synth/good"]).exit_code == 0
    (tmp_path / "synth" / "good" / "samples.jsonl").write_text("tampered\n")
    r = CliRunner().invoke(data_cli, ["verify", "synth/good"])
    assert r.exit_code == 1 and "samples.jsonl: 9 bytes, manifest says 20" in r.output
    # rm asks, and refuses anything outside the data root
    r = CliRunner().invoke(data_cli, ["rm", "synth/good"], input="n\n")
    assert r.exit_code != 0 and (tmp_path / "synth" / "good").exists()
    r = CliRunner().invoke(data_cli, ["rm", "synth/good", "--yes"])
    assert r.exit_code == 0 and not (tmp_path / "synth" / "good").exists()
    assert CliRunner().invoke(data_cli, ["rm", "synth/../../etc", "--yes"]).exit_code != 0
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / "synth" / "link").symlink_to(outside)
    r = CliRunner().invoke(data_cli, ["rm", "synth/link", "--yes"])
    assert r.exit_code == 0 and "deleted the link" in r.output and outside.exists()
    assert not (tmp_path / "synth" / "link").is_symlink()


def one_line_error(r, says: str) -> str:
    """A refusal of eyas-data: exit status 1 or 2, no traceback, SAYS on its `Error:` line."""
    assert r.exit_code in (1, 2) and isinstance(r.exception, SystemExit), (r.output, r.exception)
    (line,) = [x for x in r.output.splitlines() if x.startswith("Error:")]
    assert says in line and "Traceback" not in r.output, r.output
    return line


def test_eyas_data_names_a_file_or_folder_in_the_wrong_place(tmp_path, monkeypatch):
    """show/verify of a file where a dataset folder (or the data root) must be, or of a folder where the manifest
    must be, used to end in NotADirectoryError / IsADirectoryError tracebacks."""
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    (tmp_path / "drafts").mkdir()
    (tmp_path / "drafts" / "f").write_text("not a dataset")
    (tmp_path / "synth" / "m" / "manifest.json").mkdir(parents=True)
    for cmd in ("show", "verify"):
        one_line_error(CliRunner().invoke(data_cli, [cmd, "drafts/f"]), "drafts/f is a file, not a dataset folder")
        one_line_error(CliRunner().invoke(data_cli, [cmd, "synth/m"]),
                       "manifest.json is a folder, not a manifest file; remake it: `eyas-data rm synth/m --yes`")
    monkeypatch.setenv("EYAS_DATA", str(tmp_path / "drafts" / "f"))
    one_line_error(CliRunner().invoke(data_cli, ["show", "synth/x"]), f"{tmp_path}/drafts/f is a file, not a folder: "
                   f"EYAS_DATA (now {tmp_path}/drafts/f) must be the data root folder")
    # set but empty (a `EYAS_DATA= eyas-data ...` or an unset shell variable in a script) meant the working folder
    monkeypatch.setenv("EYAS_DATA", " ")
    for args in (["show", "synth/x"], ["list"]):
        one_line_error(CliRunner().invoke(data_cli, args), "EYAS_DATA is set but empty: set it to the data root "
                       "folder (e.g. /data), or unset it for ./data")


def test_eyas_data_rm_with_no_one_to_ask_names_yes(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    ds = make_dataset(tmp_path, "keep")
    r = CliRunner().invoke(data_cli, ["rm", "synth/keep"], input="")   # end of input: a script, make in CI
    one_line_error(r, "rm synth/keep: no answer to the question (its input is not a terminal): add --yes to delete it")
    assert ds.path.is_dir()
    r = CliRunner().invoke(data_cli, ["rm", "synth/keep"], input="n\n")  # an answer is still taken from a pipe
    assert r.exit_code == 1 and "Aborted!" in r.output and ds.path.is_dir()
    r = CliRunner().invoke(data_cli, ["rm", "synth/keep"], input="y\n")
    assert r.exit_code == 0 and not ds.path.exists(), r.output


def test_eyas_data_out_paths_are_checked_before_anything_is_written(tmp_path, monkeypatch):
    """fixture --out into a folder that is not a copy of the fixture used to overwrite its files in place (a real
    model's config.json) and leave the rest, mixed; a file in place of a folder was a traceback."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"real": true}')
    r = CliRunner().invoke(data_cli, ["fixture", "--out", str(model)])
    one_line_error(r, f"{model} holds 1 file and no eyas fixture (no eyas_fixture.json): the fixture would overwrite "
                      f"its config.json; give an empty or new folder")
    assert (model / "config.json").read_text() == '{"real": true}'
    # a built fixture, as the cache holds it (no build here)
    cached = tmp_path / "cache"
    cached.mkdir()
    for name in ("config.json", "eyas_fixture.json", "model.safetensors"):
        (cached / name).write_text(name)
    fake = SimpleNamespace(build_fixture=lambda out, seed: cached, build_deepseek_fixture=None,
                           build_kimi_fixture=None, build_smollm2_fixture=lambda out, dtype: cached)
    monkeypatch.setattr("eyas_common.cli.testing_module", lambda name: fake)
    out = tmp_path / "new" / "target"
    for _ in range(2):  # a new folder, then the same again (a rerun of the demo)
        r = CliRunner().invoke(data_cli, ["fixture", "--out", str(out)])
        assert r.exit_code == 0 and r.output.strip() == str(out) and sorted(os.listdir(out)) == sorted(
            os.listdir(cached)), r.output
    (out / "extra.bin").write_text("another model's")
    one_line_error(CliRunner().invoke(data_cli, ["fixture", "--out", str(out)]),
                   f"{out} holds files this fixture does not write (extra.bin)")
    one_line_error(CliRunner().invoke(data_cli, ["fixture", "--out", str(out), "--kind", "smollm2", "--seed", "3"]),
                   "smollm2 has its own weights: only the trained fixtures take a seed")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    one_line_error(CliRunner().invoke(data_cli, ["fixture", "--out", str(a_file)]), "is a file")
    for cmd in ("fixture", "prompts"):
        one_line_error(CliRunner().invoke(data_cli, [cmd, "--out", str(a_file / "x" / "p.jsonl")]),
                       f"{a_file}/x/p.jsonl: {a_file} is a file, not a folder")
    one_line_error(CliRunner().invoke(data_cli, ["prompts", "--out", str(tmp_path)]), "is a directory")


def test_open_output_is_the_one_create_or_resume_rule(tmp_path):
    target = {"tokenizer_sha256": "a", "chat_template_sha256": "b"}
    kw = dict(stage="test", target=target, inputs=[], may_change=("concurrency",))
    fresh = Dataset.parse("synth/new", root=tmp_path)
    assert contract.open_output(fresh, params={"n": 1}, **kw)["status"] == "partial"
    assert not fresh.path.exists()  # writes nothing
    done = make_dataset(tmp_path, "done")
    with refuses("ALREADY_COMPLETE", "synth/done"):
        contract.open_output(done, params={}, **kw)
    assert contract.open_output(done, params={}, complete="keep", **kw)["status"] == "complete"
    part = make_dataset(tmp_path, "part", status="partial")
    part.write_manifest(part.read_manifest() | {"params": {"n": 1, "concurrency": 4}})
    resumed = contract.open_output(part, params={"n": 1, "concurrency": 8}, **kw)
    assert resumed["params"]["concurrency"] == 8 and len(resumed["producers"]) == 2
    with refuses("PARAMS_CHANGED", "n=1 (now 2)"):
        contract.open_output(part, params={"n": 2, "concurrency": 4}, **kw)
    with refuses("INPUTS_CHANGED", "synth/part"):
        contract.open_output(part, params={"n": 1}, **kw | {"inputs": [{"ref": "x", "manifest_sha256": "y"}]})
    assert contract.open_output(part, params={"n": 2}, resume=False, **kw)["params"] == {"n": 2}
    # a run stopped before it made anything (its files empty) is named as such: nothing would be lost to rm
    empty = make_dataset(tmp_path, "empty", status="partial")
    empty.write_manifest(empty.read_manifest() | {"params": {"n": 1}})
    for f in empty.path.iterdir():
        if f.name != "manifest.json":
            f.write_bytes(b"")
    with refuses("PARAMS_CHANGED", "synth/empty"):
        contract.open_output(empty, params={"n": 2}, **kw)
    stray = Dataset.parse("synth/stray", root=tmp_path)
    stray.path.mkdir(parents=True)
    (stray.path / ".x.tmp-1").write_text("a killed writer's temp file is not data")
    contract.open_output(stray, params={}, **kw)
    (stray.path / "samples.jsonl").write_text("")
    with refuses("LEFTOVER_FILES", "synth/stray"):
        contract.open_output(stray, params={}, **kw)


def test_atomic_output_names_a_read_only_volume(tmp_path, monkeypatch):
    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    with refuses("READ_ONLY", "f.bin"):
        with contract.atomic_output(tmp_path / "f.bin") as tmp:
            tmp.write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []


def test_code_version_is_the_makefile_tag_rule(monkeypatch):
    # an image's tag less its stage and variant: the string a checkout of that commit records
    for tag in ("eyas-synth:0123456789ab-dirty", "reg:5000/team/eyas-train:0123456789ab-dirty-cpu"):
        monkeypatch.setenv("EYAS_IMAGE_TAG", tag)
        assert contract.code_version() == "0123456789ab-dirty"
        assert contract.producer_info("01_synth")["image"] == tag
    monkeypatch.delenv("EYAS_IMAGE_TAG")
    version = contract.code_version()
    assert version is None or len(version.removesuffix("-dirty")) >= 12


def test_target_text_config_nested_either_way(tmp_path):
    from eyas_common.checkpoint import read_text_config

    for key in ("text_config", "language_config"):
        (tmp_path / "config.json").write_text(json.dumps({key: {"hidden_size": 7}, "hidden_size": 1}))
        assert read_text_config(tmp_path) == {"hidden_size": 7}
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1}))
    assert read_text_config(tmp_path)["hidden_size"] == 1


def test_samples_reader_refuses_a_bad_line_naming_file_line_and_fix(tmp_path):
    from eyas_common.samples import SAMPLES, index_samples, new_sample, read_tokens

    path = tmp_path / SAMPLES
    rows = [new_sample(id=i, prompt_index=i, messages=[], thinking=True, reasoning=None, content="",
                       prompt_ids=[1, 2], completion_ids=[3] * (i + 1), finish_reason="stop", source="rendered")
            for i in (1, 0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refs = index_samples(path, vocab_size=4)
    assert [(r.id, r.n_tokens, r.n_masked) for r in refs] == [(0, 3, 1), (1, 4, 2)]
    assert read_tokens(path, refs)[1] == ([1, 2, 3, 3], [0, 0, 1, 1])
    with refuses("BAD_SAMPLE", "samples.jsonl:1"):
        index_samples(path, vocab_size=3)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[0]) + "\n")
    with refuses("BAD_SAMPLE", "samples.jsonl:2"):
        index_samples(path, vocab_size=4)
    path.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with refuses("MALFORMED_JSONL", "samples.jsonl:2"):
        index_samples(path, vocab_size=4)


def test_an_interrupt_while_the_lock_record_is_written_releases_it(tmp_path, monkeypatch, capsys):
    """SIGTERM lands between the flock and the record's fsync (the `with` body never starts): the lock is
    released there, so the next writer starts cleanly instead of taking over from a 'crashed' holder."""
    from eyas_common.lock import WriterLock, holder

    ds = Dataset.parse("d", "drafts", tmp_path)

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with WriterLock(ds, stage="t"):
            pass
    monkeypatch.undo()
    assert holder(ds) is None
    with WriterLock(ds, stage="t") as lock:
        assert lock.took_over is None
    assert "taking over" not in capsys.readouterr().err


def test_a_malformed_files_list_is_one_line_for_every_reader(tmp_path, monkeypatch):
    """`files` not a list, or an entry without sha256: every reader refused it with a KeyError/TypeError traceback."""
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    for name, files, bad in (("text", "x", "`files`"), ("nohash", None, "`files[0].sha256`"),
                             ("boolsize", True, "`files[0].bytes`"), ("scalar", [3], "`files[0]`")):
        ds = make_dataset(tmp_path, name)
        m = json.loads(ds.manifest_path.read_text())
        if files is None:
            del m["files"][0]["sha256"]
        elif files is True:
            m["files"][0]["bytes"] = True
        else:
            m["files"] = files
        ds.manifest_path.write_text(json.dumps(m))
        with refuses("MANIFEST_FILES", bad):
            contract.open_input(f"synth/{name}", "synth", root=tmp_path)
        r = CliRunner().invoke(data_cli, ["verify", f"synth/{name}"])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and r.output.count("\n") == 1, r.output
        assert_refused(r.output, "MANIFEST_FILES", f"synth/{name}")
        # what is there can still be seen
        assert json.loads(CliRunner().invoke(data_cli, ["show", f"synth/{name}"]).output)["status"] == "complete"
    listing = CliRunner().invoke(data_cli, ["list"]).output
    assert listing.count("complete") == 4 and "unreadable" not in listing, listing


def test_open_input_refuses_a_status_or_file_list_no_producer_writes(tmp_path):
    """status missing or "done", or a complete manifest without `files`: refused, not taken as complete or partial."""
    for name, edit, code in (("done", {"status": "done"}, "BAD_STATUS"), ("nostatus", {"status": None}, "BAD_STATUS"),
                             ("nofiles", {"files": None}, "NO_FILES_LIST")):
        ds = make_dataset(tmp_path, name)
        m = {k: v for k, v in (ds.read_manifest() | edit).items() if v is not None}
        ds.manifest_path.write_text(json.dumps(m))
        for allow_partial in (False, True):
            with refuses(code, f"synth/{name}"):
                contract.open_input(f"synth/{name}", "synth", root=tmp_path, allow_partial=allow_partial)


def test_verify_is_one_line_naming_the_problem_and_the_fix(tmp_path, monkeypatch):
    """A size mismatch printed without `Error:` or a fix; a schema problem with the dataset named twice."""
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    ds = make_dataset(tmp_path, "edited")
    with open(ds.path / "samples.jsonl", "ab") as f:
        f.write(b" ")
    r = CliRunner().invoke(data_cli, ["verify", "synth/edited"])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert_refused(r.output, "FILES_CHANGED", "synth/edited: samples.jsonl")
    with pytest.raises(DatasetError) as raised:
        contract.check_intact(ds, ds.read_manifest())
    assert r.output == f"Error: {raised.value.line}\n"  # the line every reader of a finished dataset gives
    make_dataset(tmp_path, "newschema", schema="eyas.synth/2")
    r = CliRunner().invoke(data_cli, ["verify", "synth/newschema"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and r.output.count("synth/newschema") == 1, r.output
    assert_refused(r.output, "SCHEMA_VERSION", "eyas.synth/2")
    assert contract.verify(Dataset.parse("synth/newschema", root=tmp_path))[0].startswith("schema 'eyas.synth/2'")


def test_sizes_are_shown_in_a_unit_that_fits(tmp_path, monkeypatch):
    assert [contract.human_bytes(n) for n in (0, 999, 12_345, 3e6, 4.5e9)] == \
        ["0 B", "999 B", "12.35 KB", "3.00 MB", "4.50 GB"]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=12_000))  # 0.00 GB, as it read
    monkeypatch.setattr(os, "fsync", full)
    with refuses("DISK_FULL", "12.00 KB free"):
        contract.write_json_atomic(tmp_path / "f.json", {"x": 1})


def test_a_writer_that_opened_the_lock_just_before_rm_deleted_it_locks_the_new_one(tmp_path, monkeypatch):
    """rm deletes a dataset's lock file while holding it; a writer between its open and its flock then holds an
    unlinked file, and a third writer could create and hold a new one beside it: it must reopen instead."""
    import fcntl

    from eyas_common.lock import WriterLock, holder

    ds = Dataset.parse("d", "synth", tmp_path)
    real_flock, calls = fcntl.flock, []

    def rm_in_between(fd, op):
        if not calls:
            contract.lock_file(ds).unlink()  # what held_for_removal does, after the writer's open
        calls.append(op)
        return real_flock(fd, op)

    (tmp_path / "synth").mkdir()
    monkeypatch.setattr(fcntl, "flock", rm_in_between)
    with WriterLock(ds, stage="t"):
        monkeypatch.undo()
        assert contract.lock_file(ds).exists() and holder(ds)["pid"] == os.getpid()


@pytest.mark.parametrize("name", ["sp ace", "x;echo", "-flag", ".hidden", "a'b", "ü"])
def test_a_dataset_name_is_a_plain_word(name, tmp_path):
    """A name becomes a folder, a make NAME= and a word in printed commands: nothing a shell would split or run."""
    with refuses("BAD_NAME", name):
        Dataset.parse(name, "synth", tmp_path)
    assert Dataset.parse("synth_10k.v2-b+1", "synth", tmp_path).name == "synth_10k.v2-b+1"


@pytest.mark.parametrize("stage, command, option, value", [
    ("eyas_synth.cli", "run", "--temperature", "nan"), ("eyas_synth.cli", "run", "--timeout", "inf"),
    ("eyas_extract.cli", "run", "--poll-seconds", "nan"),
    ("eyas_train.cli", "run", "--lr", "nan"), ("eyas_train.cli", "run", "--epochs", "inf"),
])
def test_every_stage_refuses_a_number_that_is_not_finite(stage, command, option, value):
    """click's FloatRange lets nan through (every comparison with it is false) and inf past a lower bound: a nan
    learning rate trains a draft of nans, an infinite epoch count never ends. Each stage refuses both at once
    (click checks the options in the order given, so this one comes before the missing required ones)."""
    r = CliRunner().invoke(importlib.import_module(stage).main, [command, option, value])
    assert r.exit_code == 2 and f"'{option}': '{value}': expected a finite number" in r.output, r.output


def test_a_dataset_is_not_taken_for_another_whose_name_it_begins(tmp_path):
    """A name may hold dots: `a`'s locks are `.a.lock` and `.a.worker-W-of-N.lock`; `.a.b.lock` is dataset a.b's,
    and a writer of a.b neither blocks `eyas-data rm hidden/a` nor counts as a split of `a`."""
    from eyas_common.lock import WriterLock, any_holder, lock_parts, worker_part

    a, ab = Dataset.parse("a", "hidden", tmp_path), Dataset.parse("a.b", "hidden", tmp_path)
    (tmp_path / "hidden").mkdir()
    with WriterLock(ab, stage="t"), WriterLock(ab, stage="t", part=worker_part(0, 2)):
        assert lock_parts(a) == [] and any_holder(a) is None
        with WriterLock(a, stage="t", part=worker_part(1, 2)):
            assert lock_parts(a) == ["worker-1-of-2"] and any_holder(a)["pid"] == os.getpid()
        assert lock_parts(ab) == ["", "worker-0-of-2"]
