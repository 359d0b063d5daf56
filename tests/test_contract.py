"""The data contract: refs, manifests, atomic writes, torn JSONL, refusals, eyas-data."""

from __future__ import annotations

import errno
import json
import os

import pytest
from click.testing import CliRunner

from eyas_common import contract
from eyas_common.cli import main as data_cli
from eyas_common.contract import Dataset, DatasetError


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
    with pytest.raises(DatasetError, match="is a synth dataset"):
        Dataset.parse("synth/x", "hidden", root=tmp_path)


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
    with pytest.raises(DatasetError, match=r"synth/part: status is 'partial'.*rerun eyas-synth run"):
        contract.open_input("synth/part", "synth", root=tmp_path)
    contract.open_input("synth/part", "synth", root=tmp_path, allow_partial=True)
    make_dataset(tmp_path, "future", schema="eyas.synth/2")
    with pytest.raises(DatasetError, match=r"synth/future: schema 'eyas.synth/2'.*reads eyas.synth/1"):
        contract.open_input("synth/future", "synth", root=tmp_path)
    make_dataset(tmp_path, "alien", schema="other/1")
    with pytest.raises(DatasetError, match="is not a eyas.synth dataset"):
        contract.open_input("synth/alien", "synth", root=tmp_path)
    with pytest.raises(DatasetError, match="no dataset at"):
        contract.open_input("synth/missing", "synth", root=tmp_path)
    bad = Dataset.parse("synth/garbled", root=tmp_path)
    bad.path.mkdir(parents=True)
    bad.manifest_path.write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        contract.open_input("synth/garbled", "synth", root=tmp_path)


def test_target_mismatch_refused(tmp_path):
    ds = make_dataset(tmp_path)
    m = ds.read_manifest()
    contract.check_target(ds, m, {"tokenizer_sha256": "a", "chat_template_sha256": "b"})
    with pytest.raises(DatasetError, match=r"synth/d1: the chat template .* does not match.*--model"):
        contract.check_target(ds, m, {"tokenizer_sha256": "a", "chat_template_sha256": "other", "model": "/m"})
    with pytest.raises(DatasetError, match="the tokenizer"):
        contract.check_target(ds, m, {"tokenizer_sha256": "zz", "chat_template_sha256": "b"})


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
    with pytest.raises(DatasetError, match=r"disk full while writing .*f\.json"):
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
    with pytest.raises(DatasetError, match=r"s\.jsonl:2: malformed JSON"):
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


def test_open_output_is_the_one_create_or_resume_rule(tmp_path):
    target = {"tokenizer_sha256": "a", "chat_template_sha256": "b"}
    kw = dict(stage="test", target=target, inputs=[], may_change=("concurrency",))
    fresh = Dataset.parse("synth/new", root=tmp_path)
    assert contract.open_output(fresh, params={"n": 1}, **kw)["status"] == "partial"
    assert not fresh.path.exists()  # writes nothing
    done = make_dataset(tmp_path, "done")
    with pytest.raises(DatasetError, match=r"synth/done is already complete; .*eyas-data rm synth/done"):
        contract.open_output(done, params={}, **kw)
    assert contract.open_output(done, params={}, complete="keep", **kw)["status"] == "complete"
    part = make_dataset(tmp_path, "part", status="partial")
    part.write_manifest(part.read_manifest() | {"params": {"n": 1, "concurrency": 4}})
    resumed = contract.open_output(part, params={"n": 1, "concurrency": 8}, **kw)
    assert resumed["params"]["concurrency"] == 8 and len(resumed["producers"]) == 2
    with pytest.raises(DatasetError, match=r"synth/part was made with n=1 \(now 2\); resume it with the same"):
        contract.open_output(part, params={"n": 2, "concurrency": 4}, **kw)
    with pytest.raises(DatasetError, match=r"synth/part was started from \[\]"):
        contract.open_output(part, params={"n": 1}, **kw | {"inputs": [{"ref": "x", "manifest_sha256": "y"}]})
    assert contract.open_output(part, params={"n": 2}, resume=False, **kw)["params"] == {"n": 2}
    stray = Dataset.parse("synth/stray", root=tmp_path)
    stray.path.mkdir(parents=True)
    (stray.path / ".x.tmp-1").write_text("a killed writer's temp file is not data")
    contract.open_output(stray, params={}, **kw)
    (stray.path / "samples.jsonl").write_text("")
    with pytest.raises(DatasetError, match=r"holds files but no manifest\.json"):
        contract.open_output(stray, params={}, **kw)


def test_atomic_output_names_a_read_only_volume(tmp_path, monkeypatch):
    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(DatasetError, match=r"cannot write .*f\.bin: its volume is read-only"):
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
    with pytest.raises(DatasetError, match=r"samples\.jsonl:1: input_ids outside the target's vocabulary \[0, 3\); "
                                           r".*eyas-synth validate"):
        index_samples(path, vocab_size=3)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(DatasetError, match=r"samples\.jsonl:2: sample id 1 appears twice"):
        index_samples(path, vocab_size=4)
    path.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(DatasetError, match=r"samples\.jsonl:2: malformed JSON record .*; the synth dataset is "
                                           r"corrupted: check it with `eyas-data verify`"):
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
