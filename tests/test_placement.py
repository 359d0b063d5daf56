"""Extraction placement (stages/02_extract/eyas_extract/placement.py): the planner's decisions on
recorded checkpoints, the dry run, and a device_map run split over two devices (CPU + accelerate's
disk offload) that writes the same shards as one device."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from eyas_common.checkpoint import read_checkpoint_size
from eyas_common.contract import DatasetError
from eyas_extract.placement import Devices, estimate_seconds, plan_placement, shard_work_note
from eyas_extract.run import run as extract

# Kimi-K2.5's text model as its config.json records it (DeepseekV3 shape), and its checkpoint's
# total_size: INT4 routed experts through compressed-tensors, the rest bf16 (about 595 GB).
KIMI_K25_TEXT = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
                 "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
                 "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                 "num_attention_heads": 64}
KIMI_K25_BYTES = 594_726_000_000
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
LLAMA_8B_BYTES = 16_060_522_496


def recorded(folder: Path, config: dict, total: int, shards: int) -> Path:
    """A checkpoint folder holding only config.json and the safetensors index (no weights)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    weight_map = {f"w{i}": f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": KIMI_K25_TEXT, "quantization_config": {"quant_method": "compressed-tensors"}}
    return recorded(tmp_path_factory.mktemp("k25") / "Kimi-K2.5", cfg, KIMI_K25_BYTES, 64)


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> Path:
    return recorded(tmp_path_factory.mktemp("l8") / "Llama-8B", LLAMA_8B, LLAMA_8B_BYTES, 4)


def test_1t_moe_on_8x96gb_spreads_one_copy(kimi: Path) -> None:
    size = read_checkpoint_size(kimi)
    plan = plan_placement(size=size, devices=Devices.parse("8x96GB"), dtype="bfloat16")
    assert plan.kind == "device_map" and plan.ranks == 1 and plan.devices == 8
    assert plan.model_bytes == KIMI_K25_BYTES  # quantized: loads as stored
    assert set(plan.max_memory) == {str(i) for i in range(8)}


def test_1t_moe_refuses_eight_full_copies_naming_the_alternatives(kimi: Path) -> None:
    size = read_checkpoint_size(kimi)
    with pytest.raises(DatasetError) as e:
        plan_placement(size=size, devices=Devices.parse("8x96GB"), dtype="bfloat16", nproc=8)
    msg = str(e.value.message)
    assert "NPROC=8" in msg and "NPROC=1" in msg and "--backend vllm" in msg and "tensor_parallel_size 8" in msg


def test_1t_moe_on_vllm_uses_tensor_and_expert_parallel(kimi: Path) -> None:
    plan = plan_placement(size=read_checkpoint_size(kimi), devices=Devices.parse("8x96GB"), dtype="bfloat16",
                          backend="vllm")
    assert (plan.kind, plan.tensor_parallel_size, plan.enable_expert_parallel) == ("vllm", 8, True)


def test_model_larger_than_every_device_together_is_refused(kimi: Path) -> None:
    with pytest.raises(DatasetError, match="quantized checkpoint"):
        plan_placement(size=read_checkpoint_size(kimi), devices=Devices.parse("4x96GB"), dtype="bfloat16")


def test_8b_on_8x80gb_runs_data_parallel(llama8b: Path) -> None:
    size = read_checkpoint_size(llama8b)
    plan = plan_placement(size=size, devices=Devices.parse("8x80GB"), dtype="bfloat16", nproc=8)
    assert (plan.kind, plan.ranks, plan.devices) == ("data_parallel", 8, 1)
    one = plan_placement(size=size, devices=Devices.parse("8x80GB"), dtype="bfloat16")
    assert one.kind == "data_parallel" and "NPROC=8" in one.describe()
    vllm = plan_placement(size=size, devices=Devices.parse("8x80GB"), dtype="bfloat16", backend="vllm")
    assert vllm.tensor_parallel_size == 1 and not vllm.enable_expert_parallel
    # Eight ranks finish about eight times sooner than one (the estimate scales with the working devices).
    assert estimate_seconds(plan, size, Devices.parse("8x80GB"), 10**9) * 8 == pytest.approx(
        estimate_seconds(one, size, Devices.parse("8x80GB"), 10**9))


def test_fixture_on_cpu_reads_real_headers(fixture_target: Path) -> None:
    from safetensors import safe_open

    size = read_checkpoint_size(fixture_target)
    with safe_open(fixture_target / "model.safetensors", "pt") as f:
        expected = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert size.params == expected and size.stored_bytes == 4 * expected
    plan = plan_placement(size=size, devices=Devices.parse("cpu:24GB"), dtype="float32")
    assert (plan.kind, plan.ranks) == ("data_parallel", 1)


def test_bad_devices_spec_is_one_line() -> None:
    with pytest.raises(DatasetError, match=r"--devices '8xlots': expected NxSIZE"):
        Devices.parse("8xlots")


@pytest.fixture(scope="module")
def root(tmp_path_factory, fixture_target) -> Path:
    from eyas_testing.datasets import make_synth

    root = tmp_path_factory.mktemp("placement")
    make_synth(root, fixture_target, n=6)
    return root


SMALL = {"shard_samples": 3, "batch_tokens": 160, "progress": False}


def test_dry_run_prints_plan_bill_and_time_and_writes_nothing(root: Path, fixture_target: Path, capsys) -> None:
    out = extract(synth="synth/fx", model=fixture_target, name="dry", data_root=root, dry_run=True,
                  devices="2x80GB", **SMALL)
    err = capsys.readouterr().err
    assert "placement: 1 data-parallel rank(s)" in err and "disk bill:" in err and "estimated time:" in err
    assert out["plan"]["kind"] == "data_parallel" and out["tokens"] > 0
    assert not (root / "hidden" / "dry").exists()
    with pytest.raises(DatasetError, match="--dry-run only"):
        extract(synth="synth/fx", model=fixture_target, name="dry", data_root=root, devices="2x80GB", **SMALL)


def _tensors(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                out[f"{path.name}:{k}"] = hashlib.sha256(f.get_tensor(k).contiguous().view(torch.uint8).numpy()).hexdigest()
    return out


def test_device_map_over_two_devices_gives_the_same_shards(root: Path, fixture_target: Path, capsys) -> None:
    """Half the fixture fits the CPU budget, accelerate puts the rest on its second device (disk offload,
    loaded layer by layer through its hooks): the capture hooks must see the same states."""
    torch.set_num_threads(1)
    extract(synth="synth/fx", model=fixture_target, name="one", data_root=root, **SMALL)
    half = read_checkpoint_size(fixture_target).stored_bytes // 2
    extract(synth="synth/fx", model=fixture_target, name="two", data_root=root, device_map="auto",
            max_memory={"cpu": f"{half // 1024}KiB"}, **SMALL)
    err = capsys.readouterr().err
    assert "device_map over 1 device(s)" in err and "'disk'" in err and "'cpu'" in err
    manifest = json.loads((root / "hidden" / "two" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["params"]["max_memory"] == {"cpu": f"{half // 1024}KiB"}
    one, two = _tensors(root / "hidden" / "one"), _tensors(root / "hidden" / "two")
    assert one and one == two


def test_a_shard_of_long_work_gets_smaller_shards_suggested():
    """An interrupted extraction keeps only finished shards: when each is more than half an hour of work (a real
    target on a CPU), the start line names the --shard-mb that makes one about every 15 min."""
    # one 2.006 GB shard estimated at 111 min (SmolLM2-135M x 2,000 answers, as the old whole-CPU guess saw 2 cores)
    note = shard_work_note(6660, 1, 2_006_000_000)
    assert note == ("each of the 1 shard(s) is about 111 min of work, and an interrupted run keeps only finished "
                    "shards: --shard-mb 258 makes one about every 15 min"), note
    assert shard_work_note(6660, 8, 2_006_000_000) is None  # 14 min each
    assert shard_work_note(40, 1, 2 << 30) is None  # a 2 GiB shard on a GPU: seconds
    assert shard_work_note(6660, 0, 2_006_000_000) is None  # a resumed dataset keeps its shard size
