"""Stage 02 extract: shard format, hooks vs output_hidden_states, options, kill and resume, shard
parts, torchrun ranks, refusals, and the vllm backend against the hf one."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import Dataset, DatasetError, verify
from helpers import refuses
from eyas_extract.batching import make_batches, plan_shards
from eyas_extract.capture import encode, find_parts
from eyas_extract.config import ExtractConfig
from eyas_extract.hf_backend import pad_batch
from eyas_extract.run import run as extract
from eyas_common.hidden import ShardWriter, bytes_per_token, count_shard, dequant_aux, open_hidden, shard_layout
from eyas_common.samples import SampleLine
from eyas_testing.datasets import make_synth
from eyas_testing.fixture import build_deepseek_fixture
from eyas_testing.servers import default_vllm_python

REPO = Path(__file__).resolve().parents[1]
SYNTH = "synth/fx"
# Small shards and batches, so a dozen samples make several shards of several batches each.
SMALL = {"shard_samples": 3, "batch_tokens": 160, "progress": False}
FP8_TOPK = {"aux_dtype": "fp8", "teacher": "topk", "topk": 8}


# Tiny matmuls on a shared 2-core machine: one thread is many times faster than two fighting.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory, fixture_target) -> Path:
    root = tmp_path_factory.mktemp("extract")
    make_synth(root, fixture_target)
    return root


@pytest.fixture(scope="module")
def target(fixture_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(fixture_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def baseline(root, fixture_target) -> Path:
    """hidden/base: the default layout, one uninterrupted in-process run."""
    extract(synth=SYNTH, model=fixture_target, name="base", data_root=root, **SMALL)
    return root / "hidden" / "base"


def shard_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("shard-*.safetensors"))}


def synth_samples(root: Path) -> dict[int, dict]:
    return {r["id"]: r for r in map(json.loads, (root / "synth" / "fx" / "samples.jsonl").read_text().splitlines())}


def reference(hd, model) -> dict[int, dict[str, torch.Tensor]]:
    """Each sample's rows recomputed with output_hidden_states=True over the same batches as the run."""
    cfg = ExtractConfig(**hd.params)
    out = {}
    for path in hd.files:
        with safe_open(path, "pt") as f:
            offsets, ids, sids = f.get_tensor("offsets"), f.get_tensor("input_ids"), f.get_tensor("sample_ids")
        seqs = [ids[offsets[k]:offsets[k + 1]].tolist() for k in range(len(sids))]
        for batch in make_batches([len(s) for s in seqs], cfg.batch_tokens):
            padded, index = pad_batch([seqs[k] for k in batch])
            with torch.inference_mode():
                res = model(padded, output_hidden_states=True)
            hs = [h.flatten(0, 1)[index] for h in res.hidden_states]
            # The same encoding of the same states; hidden_states[L] is the final norm's output.
            rows = encode(cfg, torch.stack([hs[k] for k in cfg.layers], dim=1), hs[cfg.num_layers],
                          lm_head=model.lm_head)
            r = 0
            for k in batch:
                n = len(seqs[k])
                out[int(sids[k])] = {name: t[r:r + n] for name, t in rows.items()}
                r += n
    return out


# ------------------------------------------------------------------------------------------------
# format and planning


def test_shard_writer_layout(tmp_path):
    cfg = ExtractConfig(synth="synth/x", model="m", backend="hf", layers=[1, 2], num_layers=4, hidden_size=8,
                        vocab_size=50, aux_dtype="fp8", teacher="topk", topk=3, shard_samples=8, shard_tokens=99,
                        num_shards=1, batch_tokens=64, dtype="float32", attn="sdpa", device_map=None,
                        trust_remote_code=False)
    assert bytes_per_token(cfg) == 2 * 8 + 2 * 4 + 3 * 4 + 3 * 4 + 4 + 1
    lengths = [3, 5, 2]
    w = ShardWriter(tmp_path / "shard-00000.safetensors", cfg, [7, 9, 12], lengths)
    rows = {k: {"aux": torch.randn(n, 16).to(torch.float8_e4m3fn), "aux_scale": torch.rand(n, 2),
                "topk_ids": torch.randint(0, 50, (n, 3), dtype=torch.int32), "topk_logprobs": -torch.rand(n, 3)}
            for k, n in enumerate(lengths)}
    w.put("input_ids", 0, torch.arange(10, dtype=torch.int32))
    w.put("loss_mask", 0, torch.ones(10, dtype=torch.uint8))
    for k in (2, 0, 1):  # any order, as length-sorted batches come
        w.put_sample(k, rows[k])
    assert w.commit() == (tmp_path / "shard-00000.safetensors").stat().st_size == shard_layout(cfg, 3, 10).size
    data = load_file(tmp_path / "shard-00000.safetensors")
    assert data["offsets"].tolist() == [0, 3, 8, 10] and data["sample_ids"].tolist() == [7, 9, 12]
    assert data["aux"].dtype == torch.float8_e4m3fn and data["aux"].shape == (10, 16)
    assert torch.equal(data["aux"][3:8].view(torch.uint8), rows[1]["aux"].view(torch.uint8))
    assert torch.equal(data["topk_logprobs"][8:], rows[2]["topk_logprobs"])
    with safe_open(tmp_path / "shard-00000.safetensors", "pt") as f:  # mmap'd row slices, fp8 included
        assert torch.equal(f.get_slice("aux")[3:8].view(torch.uint8), rows[1]["aux"].view(torch.uint8))
    unfinished = ShardWriter(tmp_path / "shard-00001.safetensors", cfg, [1], [4])
    with pytest.raises(RuntimeError, match="never written"):
        unfinished.commit()
    unfinished.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.safetensors"]


def test_plan_and_batches():
    refs = [SampleLine(i, n, 1, 0) for i, n in enumerate([5, 50, 7, 30, 30, 2, 90, 4])]
    shards = plan_shards(refs, shard_samples=3, shard_tokens=80)
    assert [[r.id for r in s] for s in shards] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    lengths = [5, 50, 7, 30, 30, 2, 90, 4]
    batches = make_batches(lengths, batch_tokens=64)
    assert sorted(k for b in batches for k in b) == list(range(8))
    for b in batches:
        assert [lengths[k] for k in b] == sorted((lengths[k] for k in b), reverse=True)
        assert len(b) == 1 or len(b) * lengths[b[0]] <= 64  # a sample over budget goes alone
    assert make_batches(lengths, 64) == batches  # deterministic


# ------------------------------------------------------------------------------------------------
# extraction


def test_extract_shapes_offsets_and_hooks(root, baseline, target):
    hd = open_hidden("hidden/base", data_root=root)
    m, p = hd.manifest, hd.params
    assert m["schema"] == "eyas.hidden/1" and m["status"] == "complete"
    assert m["inputs"][0]["ref"] == SYNTH and m["target"] == Dataset.parse(SYNTH, root=root).read_manifest()["target"]
    assert p["layers"] == [2, 4, 5] and (p["num_layers"], p["hidden_size"], p["vocab_size"]) == (8, 128, 3000)
    assert (p["aux_dtype"], p["teacher"], p["backend"], p["dtype"]) == ("bf16", "final", "hf", "float32")
    assert verify(hd.ds) == []
    samples = synth_samples(root)
    s = m["stats"]
    assert s["samples"] == len(hd) == len(samples) and hd.sample_ids == sorted(samples)
    assert s["tokens"] == sum(len(r["input_ids"]) for r in samples.values())
    assert s["masked_tokens"] == sum(sum(r["loss_mask"]) for r in samples.values())
    assert s["bytes"] == sum(f["bytes"] for f in m["files"] if f["name"].startswith("shard-"))
    assert s["bytes_per_token"] == pytest.approx(s["bytes"] / s["tokens"], abs=0.01) and s["tokens_per_s"] > 0
    assert len(hd.files) == p["num_shards"] == 4  # 12 samples, 3 per shard
    ref = reference(hd, target)
    for j, sid in enumerate(hd.sample_ids):
        row = hd.sample(j)
        n = len(samples[sid]["input_ids"])
        assert row["sample_id"] == sid
        assert row["aux"].shape == (n, 3 * 128) and row["aux"].dtype == torch.bfloat16
        assert row["final"].shape == (n, 128) and row["final"].dtype == torch.bfloat16
        assert row["input_ids"].dtype == torch.int32 and row["input_ids"].tolist() == samples[sid]["input_ids"]
        assert row["loss_mask"].dtype == torch.uint8 and row["loss_mask"].tolist() == samples[sid]["loss_mask"]
        assert set(row) == {"aux", "final", "input_ids", "loss_mask", "sample_id"}
        # Hooks and output_hidden_states=True give identical tensors, bit for bit.
        assert torch.equal(row["aux"], ref[sid]["aux"]) and torch.equal(row["final"], ref[sid]["final"])
        assert torch.equal(hd.aux(j), row["aux"].float())
    # The aux states are HF hidden_states[k] at the chosen ids (not, say, the layer outputs).
    one = samples[hd.sample_ids[0]]["input_ids"]
    with torch.inference_mode():
        hs = target(torch.tensor([one]), output_hidden_states=True).hidden_states
    got = hd.aux(0).view(len(one), 3, 128)
    for slot, k in enumerate([2, 4, 5]):
        torch.testing.assert_close(got[:, slot], hs[k][0], atol=0.05, rtol=0.01)  # bf16 storage
        assert not torch.allclose(got[:, slot], hs[k + 1][0], atol=0.05, rtol=0.01)


def option_dataset(root: Path, fixture_target: Path, **opts: Any) -> str:
    """hidden/opt-...: the synth extracted with `opts`, once per module, by whichever test reads it first (the
    tests that read it pass in any order)."""
    name = "opt-" + "-".join(str(v) for v in opts.values()).replace(", ", "_").replace("[", "").replace("]", "")
    if not (root / "hidden" / name / "manifest.json").exists():
        extract(synth=SYNTH, model=fixture_target, name=name, data_root=root, dtype="fp32", **SMALL, **opts)
    return name


@pytest.mark.parametrize("opts", [
    {"aux_dtype": "fp32"},
    FP8_TOPK,
    {"aux_dtype": "bf16", "teacher": "topk", "topk": 4, "layers": [1, 3, 6, 7]},
], ids=["fp32", "fp8-topk", "bf16-topk-4layers"])
def test_options_match_output_hidden_states(root, fixture_target, target, opts):
    hd = open_hidden(f"hidden/{option_dataset(root, fixture_target, **opts)}", data_root=root)
    ref = reference(hd, target)
    n_aux, h = len(hd.params["layers"]), 128
    for j, sid in enumerate(hd.sample_ids):
        row, want = hd.sample(j), ref[sid]
        t = row["input_ids"].shape[0]
        assert row["aux"].shape == (t, n_aux * h)
        assert torch.equal(row["aux"].view(torch.uint8), want["aux"].view(torch.uint8))  # identical bytes
        if hd.params["aux_dtype"] == "fp8":
            assert row["aux_scale"].shape == (t, n_aux) and row["aux_scale"].dtype == torch.float32
            assert torch.equal(row["aux_scale"], want["aux_scale"])
        if hd.params["teacher"] == "topk":
            k = hd.params["topk"]
            assert "final" not in row and row["topk_ids"].shape == (t, k) and row["topk_ids"].dtype == torch.int32
            assert row["topk_logprobs"].dtype == torch.float32
            assert torch.equal(row["topk_ids"], want["topk_ids"])
            assert torch.equal(row["topk_logprobs"], want["topk_logprobs"])
            assert (row["topk_logprobs"].diff(dim=-1) <= 0).all()  # sorted descending
        else:
            assert row["final"].dtype == torch.float32 and torch.equal(row["final"], want["final"])


def test_fp8_and_topk_round_trip(root, fixture_target, target):
    """fp8 aux dequantises to within e4m3 rounding of the fp32 states; top-K log-probs are the target's."""
    hd8 = open_hidden(f"hidden/{option_dataset(root, fixture_target, **FP8_TOPK)}", data_root=root)
    hd32 = open_hidden(f"hidden/{option_dataset(root, fixture_target, aux_dtype='fp32')}", data_root=root)
    assert hd8.sample_ids == hd32.sample_ids
    for j in range(len(hd8)):
        x, x8 = hd32.aux(j), hd8.aux(j)
        row = hd8.sample(j)
        assert torch.equal(x8, dequant_aux(row["aux"], row["aux_scale"]))
        scale = row["aux_scale"].repeat_interleave(128, dim=1)
        # e4m3: 3 mantissa bits, so a relative error <= 2^-4, plus the subnormal step near zero.
        assert ((x8 - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()
        ids = row["input_ids"].long()[None]
        with torch.inference_mode():
            logp = target(ids).logits[0].log_softmax(-1)
        # The stored log-probs are log-softmax over the full vocab at the stored ids, and its top K.
        torch.testing.assert_close(logp.gather(-1, row["topk_ids"].long()), row["topk_logprobs"], atol=1e-4, rtol=0)
        torch.testing.assert_close(logp.topk(8).values, row["topk_logprobs"], atol=1e-4, rtol=0)
    for hd in (hd8, hd32):
        per_token = bytes_per_token(ExtractConfig(**hd.params))  # the rest is headers and offsets
        assert hd.manifest["stats"]["bytes_per_token"] == pytest.approx(per_token, rel=0.05)


def cli(root: Path, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "eyas_extract.cli", "run", "--synth", SYNTH, "--quiet", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


@pytest.mark.slow  # extraction killed and resumed: not in `make test-fast`
def test_sigkill_and_resume_equal_uninterrupted(root, baseline, fixture_target):
    args = ["--model", str(fixture_target), "--name", "killed", "--shard-samples", "1", "--batch-tokens", "160"]
    out = root / "hidden" / "killed"
    proc = cli(root, *args)
    deadline = time.monotonic() + 120
    while not list(out.glob("shard-*.safetensors")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(out.glob("shard-*.safetensors")))
    assert 0 < done < 12, f"the kill should land mid-run ({done} of 12 shards)"
    assert json.loads((out / "manifest.json").read_text())["status"] == "partial"
    with refuses("PARTIAL", "hidden/killed"):
        open_hidden("hidden/killed", data_root=root)
    proc = cli(root, *args)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert f"{done} of 12 shards already there" in log and "disk bill" in log and "tokens/s" in log
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    # Same content as one uninterrupted run with the same options.
    extract(synth=SYNTH, model=fixture_target, name="unkilled", data_root=root, shard_samples=1, batch_tokens=160,
            progress=False)
    assert shard_hashes(out) == shard_hashes(root / "hidden" / "unkilled")
    assert open_hidden("hidden/killed", data_root=root).manifest["stats"]["tokens"] == \
        open_hidden("hidden/unkilled", data_root=root).manifest["stats"]["tokens"]


def test_shard_parts_equal_single_run(root, baseline, fixture_target):
    stats = extract(synth=SYNTH, model=fixture_target, name="parts", shard="0/2", data_root=root, **SMALL)
    assert "dataset" not in stats  # not complete after one part
    assert json.loads((root / "hidden" / "parts" / "manifest.json").read_text())["status"] == "partial"
    stats = extract(synth=SYNTH, model=fixture_target, name="parts", shard="1/2", data_root=root, **SMALL)
    assert stats["dataset"]["samples"] == 12  # the last part finalizes
    assert shard_hashes(root / "hidden" / "parts") == shard_hashes(baseline)
    assert [r["worker"] for r in open_hidden("hidden/parts", data_root=root).manifest["stats"]["workers"]] == [0, 1]


def test_an_unreadable_shard_of_a_partial_dataset_is_extracted_again(root, baseline, fixture_target, capsys):
    """A partial dataset whose shard file was cut short (a full disk, a copy): rerunning the same command
    extracts that shard again, saying so, and ends as one uninterrupted run. A complete dataset's shards are
    never remade; reading a broken one names the fix that works (a rerun alone skips every file there)."""
    go = dict(synth=SYNTH, model=fixture_target, name="torn", data_root=root, **SMALL)
    extract(shard="0/2", **go)  # partial: shards 0 and 2 of 4, as a run killed after them leaves it
    ds = Dataset.parse("hidden/torn", root=root)
    torn = ds.path / "shard-00002.safetensors"
    os.truncate(torn, torn.stat().st_size // 2)
    with pytest.raises(DatasetError, match=rf"{re.escape(str(torn))} is not a readable .*; delete that file"):
        count_shard(ds, 2)
    capsys.readouterr()
    stats = extract(**go)
    assert f"{torn} is not a readable safetensors file" in capsys.readouterr().err
    assert stats["dataset"]["samples"] == 12 and shard_hashes(ds.path) == shard_hashes(baseline)
    os.truncate(torn, size := torn.stat().st_size // 2)
    extract(**go)  # complete: reported done, its files left as they are
    assert torn.stat().st_size == size
    fix = r"restore the file from a copy, or remake it: `eyas-data rm hidden/torn --yes`, then rerun eyas-extract run"
    with pytest.raises(DatasetError, match=r"not a readable safetensors file .*; " + fix):
        count_shard(ds, 2)
    with pytest.raises(DatasetError, match=rf"shard-00002.safetensors is {size} bytes, the manifest says .*{fix}"):
        open_hidden("hidden/torn", data_root=root)  # a training run's reader


@pytest.mark.slow  # torchrun extraction: not in `make test-fast`
def test_torchrun_ranks_equal_single_run(root, baseline, fixture_target):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "eyas_extract.cli", "run", "--synth", SYNTH,
           "--model", str(fixture_target), "--name", "ranks", "--shard-samples", "3", "--batch-tokens", "160",
           "--quiet"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert shard_hashes(root / "hidden" / "ranks") == shard_hashes(baseline)
    hd = open_hidden("hidden/ranks", data_root=root)
    assert sorted(r["worker"] for r in hd.manifest["stats"]["workers"]) == [0, 1]


def test_deepseek_structure(tmp_path, fixture_target):
    """The Kimi architecture (DeepseekV3, MLA + MoE) through the same hooks, checked against HF."""
    from transformers import AutoModelForCausalLM

    ds_target = build_deepseek_fixture()
    model = AutoModelForCausalLM.from_pretrained(ds_target, dtype=torch.float32).eval()
    parts = find_parts(model, 8, 128)
    assert parts.names == {"base": "model", "layers": "model.layers", "norm": "model.norm", "lm_head": "lm_head"}
    root = tmp_path
    make_synth(root, fixture_target, n=4, max_new_tokens=8)
    if target_fingerprint(load_tokenizer(ds_target), ds_target)["tokenizer_sha256"] != \
            target_fingerprint(load_tokenizer(fixture_target), fixture_target)["tokenizer_sha256"]:
        pytest.skip("the DeepseekV3 fixture's tokenizer differs from the Llama fixture's")
    extract(synth=SYNTH, model=ds_target, name="dsv3", data_root=root, **SMALL)
    hd = open_hidden("hidden/dsv3", data_root=root)
    ref = reference(hd, model)
    for j, sid in enumerate(hd.sample_ids):
        row = hd.sample(j)
        assert torch.equal(row["aux"], ref[sid]["aux"]) and torch.equal(row["final"], ref[sid]["final"])


def test_find_parts_names_what_it_found():
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    with pytest.raises(DatasetError, match=r"wanted a list of 8 identical layers.*blocks \(3 x Linear\)"):
        find_parts(Blocks(), 8, 4)


# ------------------------------------------------------------------------------------------------
# refusals


def copy_synth(root: Path, name: str) -> Path:
    src, dst = root / "synth" / "fx", root / "synth" / name
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_refusals(root, fixture_target, monkeypatch):
    go = dict(model=fixture_target, data_root=root, progress=False)
    part = copy_synth(root, "partial")
    m = json.loads((part / "manifest.json").read_text())
    (part / "manifest.json").write_text(json.dumps(m | {"status": "partial"}))
    with refuses("PARTIAL", "synth/partial"):
        extract(synth="synth/partial", name="x", **go)
    bad = copy_synth(root, "corrupt")
    lines = (bad / "samples.jsonl").read_bytes()
    (bad / "samples.jsonl").write_bytes(lines.replace(b'"stop"', b'"stoq"', 1))  # same size, other bytes
    with refuses("FILES_CHANGED", "synth/corrupt: samples.jsonl: sha256"):
        extract(synth="synth/corrupt", name="x", **go)
    (bad / "samples.jsonl").write_bytes(lines[: len(lines) // 2])
    with refuses("FILES_CHANGED", "synth/corrupt: samples.jsonl"):
        extract(synth="synth/corrupt", name="x", **go)
    other = copy_synth(root, "schema")
    (other / "manifest.json").write_text(json.dumps(m | {"schema": "eyas.synth/2"}))
    with refuses("SCHEMA_VERSION", "eyas.synth/2"):
        extract(synth="synth/schema", name="x", **go)
    tok = copy_synth(root, "othertok")
    (tok / "manifest.json").write_text(json.dumps(m | {"target": m["target"] | {"chat_template_sha256": "0" * 64}}))
    with refuses("TARGET_MISMATCH", "synth/othertok"):
        extract(synth="synth/othertok", name="x", **go)
    with pytest.raises(DatasetError, match=r"--layers \[2, 8\]: need distinct ids in \[0, 8\)"):
        extract(synth=SYNTH, name="x", layers=[2, 8], **go)
    if importlib.util.find_spec("vllm") is None:  # .venv has none: the vllm backend runs from .venv-vllm
        with pytest.raises(DatasetError, match=r"--backend vllm needs vLLM in this Python.*\.venv-vllm/bin/python"):
            extract(synth=SYNTH, name="x", backend="vllm", **go)
    assert not (root / "hidden" / "x").exists()  # nothing written by a refused run

    import eyas_extract.run as run_mod

    monkeypatch.setattr(run_mod, "_free_bytes", lambda path: 10_000)
    with pytest.raises(DatasetError, match=r"needs [\d.]+ [KM]B but 10.00 KB are free.*--aux-dtype fp8"):
        extract(synth=SYNTH, name="x", **go)
    monkeypatch.undo()
    # A resume must use the options the dataset was started with.
    extract(synth=SYNTH, name="fixed", shard="0/4", **SMALL | go)
    with refuses("PARAMS_CHANGED", "batch_tokens=160 (now 999)"):
        extract(synth=SYNTH, name="fixed", shard="1/4", **SMALL | go | {"batch_tokens": 999})


# ------------------------------------------------------------------------------------------------
# the vllm backend: real vLLM (CPU build) with our connector, against the hf backend


@pytest.mark.vllm
@pytest.mark.parametrize("opts", [["--aux-dtype", "fp32"], ["--teacher", "topk", "--topk", "8", "--aux-dtype", "fp8"]],
                         ids=["final-fp32", "topk-fp8"])
def test_vllm_backend_agrees_with_hf(root, fixture_target, opts):
    name = "vllm-" + opts[1]
    env = {**os.environ, "EYAS_DATA": str(root), "PYTHONPATH": f"{REPO / 'common'}:{REPO / 'stages' / '02_extract'}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"), "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    cmd = [str(default_vllm_python()), "-m", "eyas_extract.cli", "run", "--backend", "vllm", "--synth", SYNTH,
           "--model", str(fixture_target), "--name", name, "--shard-samples", "3", "--dtype", "fp32", "--quiet", *opts]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    hf_name = option_dataset(root, fixture_target, **({"aux_dtype": "fp32"} if "fp32" in opts else FP8_TOPK))
    v, h = open_hidden(f"hidden/{name}", data_root=root), open_hidden(f"hidden/{hf_name}", data_root=root)
    assert v.params["backend"] == "vllm" and h.params["backend"] == "hf"
    same = ("layers", "num_layers", "hidden_size", "vocab_size", "aux_dtype", "teacher", "topk", "dtype")
    assert {k: v.params[k] for k in same} == {k: h.params[k] for k in same}
    assert v.sample_ids == h.sample_ids and v.manifest["stats"]["tokens"] == h.manifest["stats"]["tokens"]
    for j in range(len(v)):
        a, b = v.sample(j), h.sample(j)
        assert set(a) == set(b)
        assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a if k != "sample_id")
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(v.aux(j), h.aux(j), atol=2e-4 if "fp32" in opts else 0.1, rtol=0.07)
        if "final" in a:
            torch.testing.assert_close(a["final"], b["final"], atol=2e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(a["topk_logprobs"], b["topk_logprobs"], atol=1e-4, rtol=0)
            assert (a["topk_ids"] == b["topk_ids"]).float().mean() > 0.99


# ------------------------------------------------------------------------------------------------
# bad input: one line naming the option or file and the fix, before anything is written


def cli_in_process(root: Path, *args: str):
    """eyas-extract ARGS in this process (click's runner): exit code and output, for refusals made before any
    target loads."""
    from click.testing import CliRunner

    from eyas_extract.cli import main

    res = CliRunner().invoke(main, list(args), env={"EYAS_DATA": str(root)})
    assert "Traceback" not in res.output and not isinstance(res.exception, (ValueError, OverflowError)), res.output
    return res.exit_code, res.output


def test_bad_options_are_refused_before_anything_is_written(root, fixture_target, tmp_path, monkeypatch):
    import eyas_extract.hf_backend as hf
    from eyas_extract.placement import Devices

    go = dict(synth=SYNTH, model=fixture_target, name="badopt", data_root=root, progress=False)
    # No GPU here (or none visible): torch failed only once the target loaded, after the dataset was started with
    # bf16 params that then refused the rerun with --device cpu.
    monkeypatch.setattr(hf.torch.cuda, "is_available", lambda: False)
    with pytest.raises(DatasetError, match=r"--device cuda: .*; pass --device cpu, or auto"):
        extract(device="cuda", **go)
    with pytest.raises(DatasetError, match=r"--device 'gpu7': not a device the hf backend runs on"):
        extract(device="gpu7", **go)
    with pytest.raises(DatasetError, match=r"--device-map 'banana': .*pass a strategy \(auto, balanced"):
        extract(device_map="banana", **go)
    (tmp_path / "config.json").write_text((fixture_target / "config.json").read_text())  # a config, no tokenizer
    with pytest.raises(DatasetError, match=rf"--model {re.escape(str(tmp_path))}: no tokenizer loads from this"):
        extract(**go | {"model": tmp_path})
    assert not (root / "hidden" / "badopt").exists()
    for spec in ("0x96GB", "8xinfGB", "-1x80GB"):
        with pytest.raises(DatasetError, match=r"--devices .*N and SIZE above 0"):
            Devices.parse(spec)
    args = ["run", "--synth", SYNTH, "--model", str(fixture_target), "--name", "badopt", "--quiet"]
    code, out = cli_in_process(root, *args, "--follow", "--disk-budget", "inf")
    assert code == 2 and "Error: Invalid value for '--disk-budget': 'inf' is not a size" in out
    code, out = cli_in_process(root, *args, "--device-map", "auto", "--max-memory", "0=80G")  # accelerate: no unit
    assert code == 2 and "'0=80G': expected DEVICE=SIZE pairs" in out and "e.g. 0=80GiB" in out
    assert not (root / "hidden" / "badopt").exists()


def test_ctrl_c_before_the_extraction_is_one_line(root, fixture_target, monkeypatch):
    import eyas_extract.run as run_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "run", interrupted)  # Ctrl-C while the tokenizer or the input is read
    code, out = cli_in_process(root, "run", "--synth", SYNTH, "--model", str(fixture_target), "--name", "cc")
    assert code == 130 and "interrupted: the shards already made are kept; rerun the same command" in out


def test_a_run_of_another_split_is_refused_while_one_runs(root, fixture_target):
    from eyas_common.lock import WriterLock

    ds = Dataset.parse("hidden/split", root=root)
    with WriterLock(ds, stage="02_extract", part="worker-0-of-1"):  # a whole-dataset run, still running
        # --shard 0/2 owns shards 0, 2, ... that the run above makes too (and it cleared that run's temp files)
        with pytest.raises(DatasetError, match=r"hidden/split is being written by 02_extract pid \d+ .* as "
                                               r"worker-0-of-1 \(its shards split over 1 worker.*over 2, so the two "
                                               r"would make the same shards"):
            extract(synth=SYNTH, model=fixture_target, name="split", shard="0/2", data_root=root, **SMALL)
    assert not (root / "hidden" / "split" / "manifest.json").exists()


def test_finalize_refuses_or_leaves_alone(root, baseline, tmp_path):
    from eyas_extract.run import finalize_dataset

    # A data root with no hidden/ yet: one line, and no mutex file made for a dataset that is not there.
    with refuses("NO_MANIFEST", "hidden/nothing"):
        finalize_dataset("nothing", data_root=tmp_path)
    assert not (tmp_path / "hidden").exists()
    # A complete dataset's files and stats are its record: finalizing it again rewrites nothing (it hashed what
    # was there, listing a stray file and blessing a changed shard).
    done = root / "hidden" / "refinal"
    done.mkdir()
    for p in baseline.rglob("*"):
        if p.is_file():
            (done / p.relative_to(baseline)).parent.mkdir(parents=True, exist_ok=True)
            (done / p.relative_to(baseline)).write_bytes(p.read_bytes())
    before = (done / "manifest.json").read_bytes()
    (done / "notes.txt").write_text("mine")
    finalize_dataset("refinal", data_root=root)
    assert (done / "manifest.json").read_bytes() == before
    # Begun by --follow while synth runs: no shard count yet (it divided by zero, or would list none).
    m = json.loads(before)
    (done / "manifest.json").write_text(json.dumps(m | {"status": "partial", "params": m["params"] | {"num_shards": 0}}))
    with pytest.raises(DatasetError, match=r"hidden/refinal is extracted with --follow while synth/fx is written.*"
                                           r"finish synth/fx .* then rerun the eyas-extract run"):
        finalize_dataset("refinal", data_root=root)
