"""Stage 03 inputs: hidden shards made by the real stage 02 from the fixture target, read back through
eyas_common.hidden; the teacher from final states and from top-K; fp8 aux. The datasets come from
eyas_testing.datasets: greedy answers of the fixture target as a synth dataset, and the real
`eyas-extract run` over it as the hidden dataset.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eyas_common.contract import Dataset, iter_jsonl
from eyas_common.hidden import open_hidden
from eyas_common.samples import SAMPLES
from eyas_testing.datasets import build_datasets, extract_hidden
from eyas_train.data import collate, global_batches, rank_share, token_counts
from eyas_train.target import Teacher, load_lm_head
from eyas_train.vocab import build_vocab


@pytest.fixture(scope="module")
def small(fixture_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return root, build_datasets(root, fixture_target, 12, seed=3, per_shard=5)


def test_shards_read_back_the_samples(small, fixture_target):
    root, hidden = small
    shards = open_hidden(hidden.ref, root)
    synth = [s for _, s in iter_jsonl(root / "synth" / "fixture_12_3" / SAMPLES)]
    assert len(shards) == 12 and len(shards.files) == 3 and shards.teacher == "final"
    for ref, s in zip(shards.samples, synth):
        row = shards.read(ref, max_len=10_000)
        assert row["input_ids"].tolist() == s["input_ids"] and row["loss_mask"].tolist() == s["loss_mask"]
        assert row["aux"].shape == (len(s["input_ids"]), 3 * 128) and row["final"].shape == (len(s["input_ids"]), 128)
    assert shards.read(shards.samples[0], max_len=7)["aux"].shape[0] == 7
    counts = token_counts(shards, 3000)
    assert int(counts.sum()) == sum(sum(s["loss_mask"]) for s in synth)


def test_batches_are_a_deterministic_partition():
    batches = global_batches(50, 8, seed=1, epoch=2)
    assert batches == global_batches(50, 8, seed=1, epoch=2) != global_batches(50, 8, seed=1, epoch=3)
    flat = [i for b in batches for i in b]
    assert len(batches) == 6 and len(set(flat)) == 48
    lengths = list(range(50))
    shares = [rank_share(batches[0], lengths, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(batches[0])
    rows = collate([{"input_ids": torch.tensor([5, 6, 7]), "x": torch.ones(3, 2)},
                    {"input_ids": torch.tensor([8]), "x": torch.ones(1, 2)}])
    assert rows["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]] and rows["length"].tolist() == [3, 1]
    assert rows["x"][1, 1:].abs().sum() == 0


def test_teacher_final_and_topk_agree(small, fixture_target, tmp_path):
    """P_t from the final state through the lm_head equals P_t from stored top-K, within the top-K mass."""
    root, hidden = small
    shards = open_hidden(hidden.ref, root)
    synth = Dataset.parse("fixture_12_3", "synth", root)
    topk = extract_hidden(root, "topk", synth, fixture_target, teacher="topk", topk=3000, per_shard=5)
    top_shards = open_hidden(topk.ref, root)
    assert top_shards.teacher == "topk"
    vocab = build_vocab(token_counts(shards, 3000), 600)
    t = Teacher(vocab, load_lm_head(fixture_target), torch.device("cpu"))
    a = collate([shards.read(r, 10_000) for r in shards.samples[:3]])
    b = collate([top_shards.read(r, 10_000) for r in top_shards.samples[:3]])
    pa, ta = t(a)
    pb, tb = t(b)
    assert pa.shape == pb.shape == (3, a["input_ids"].shape[1], 600)
    real = torch.arange(a["input_ids"].shape[1])[None] < a["length"][:, None]
    # bf16 final states against fp32 logits: close, not equal (a near-tie may flip the top token).
    assert (ta[real] != tb[real]).float().mean() < 0.02
    assert (pa - pb)[real].abs().max() < 0.03
    assert torch.allclose(pa[real].sum(-1), torch.ones(int(real.sum())), atol=1e-4)


def test_fp8_aux_is_dequantised(small, fixture_target, tmp_path):
    root, hidden = small
    synth = Dataset.parse("fixture_12_3", "synth", root)
    fp8 = extract_hidden(root, "fp8", synth, fixture_target, aux_dtype="fp8", per_shard=5)
    assert fp8.read_manifest()["params"]["aux_dtype"] == "fp8"
    bf16, f8 = open_hidden(hidden.ref, root), open_hidden(fp8.ref, root)
    a = bf16.read(bf16.samples[0], 10_000)["aux"].float()
    b = f8.read(f8.samples[0], 10_000)["aux"]
    assert b.dtype == torch.float32 and a.shape == b.shape
    # e4m3 keeps 3 mantissa bits: relative error per element stays within about 2**-4 of the row scale.
    rel = (a - b).abs().view(a.shape[0], 3, -1).amax(-1) / a.abs().view(a.shape[0], 3, -1).amax(-1)
    assert rel.max() < 0.07


def test_target_weights_are_read_alone(tmp_path):
    """One tensor out of a sharded checkpoint, by suffix (wrappers prefix names); tied heads; clear errors."""
    from eyas_train.target import load_embedding, load_weight

    emb, head = torch.randn(10, 4), torch.randn(10, 4)
    save_file({"language_model.model.embed_tokens.weight": emb, "language_model.model.norm.weight": torch.ones(4)},
              str(tmp_path / "a.safetensors"))
    save_file({"language_model.lm_head.weight": head}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "language_model.model.embed_tokens.weight": "a.safetensors", "language_model.model.norm.weight": "a.safetensors",
        "language_model.lm_head.weight": "b.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 10, "tie_word_embeddings": False}}))
    assert torch.equal(load_embedding(tmp_path), emb) and torch.equal(load_lm_head(tmp_path), head)
    assert torch.equal(load_weight(tmp_path, "model.norm.weight"), torch.ones(4))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert torch.equal(load_lm_head(tmp_path), emb)
    with pytest.raises(KeyError, match="no tensor named \\*rotary.weight"):
        load_weight(tmp_path, "rotary.weight")
