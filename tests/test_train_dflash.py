"""The DFlash draft (eyas_train/dflash.py): shapes, its attention mask against a dense reference, what a
block may see (the context before its anchor, its own block, nothing else), the slot weights and the loss,
and that a tiny draft overfits one sample."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eyas_common.methods import dflash_layers, eagle3_layers, to_dflash_ids
from eyas_testing.servers import default_vllm_python
from eyas_train.dflash import (BlockLoss, DFlashConfig, DFlashDraft, block_attention, block_labels,
                               context_visible, default_block_size, default_draft_layers, default_gamma, leads,
                               pad_anchors, sample_anchors, slot_weights, valid_anchors, vocab_ce)
from eyas_train.dflash_export import (NOT_EXPORTED, exported_name, exported_tensors, hf_config, imported_state,
                                      write_dflash_draft)
from eyas_common.checkpoint import read_text_config as text_config
from eyas_train.methods.dflash import DFlash, pick_mask_token, usable_mask_rows


def tiny_config(**over) -> DFlashConfig:
    base = dict(vocab_size=50, hidden_size=32, target_hidden_size=32, num_features=3, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
                max_position_embeddings=256, block_size=4, mask_token_id=49)
    return DFlashConfig(**{**base, **over})


def tiny_draft(seed: int = 0, **over) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(tiny_config(**over)).double()
    draft.init_weights(seed)
    with torch.no_grad():
        draft.embed.weight.normal_(0, 1)
        draft.lm_head.weight.normal_(0, 0.3)
    return draft


def sample(length: int = 20, prompt: int = 6, seed: int = 1, features: int = 3, width: int = 32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (1, length), generator=g)
    aux = torch.randn(1, length, features * width, generator=g, dtype=torch.float64)
    mask = torch.zeros(1, length, dtype=torch.long)
    mask[:, prompt:] = 1
    return ids, aux, mask


def test_default_knobs_follow_the_target():
    assert dflash_layers(36) == [2, 10, 18, 26, 34] and to_dflash_ids(dflash_layers(36)) == [1, 9, 17, 25, 33]
    assert dflash_layers(8) == [2, 3, 4, 5, 6] and eagle3_layers(8) == [2, 4, 5]
    assert len(dflash_layers(61)) == 5 and dflash_layers(5) == [2, 3]  # shallow targets get fewer
    assert [default_draft_layers(n) for n in (8, 30, 36, 61)] == [3, 4, 5, 5]
    assert default_block_size(128) == 8 and default_block_size(4096) == 16
    assert [default_gamma(b) for b in (16, 10, 8, 4)] == [7.0, 5.0, 4.0, 4.0]
    with pytest.raises(ValueError, match=">= 1"):
        to_dflash_ids([0, 3])


def test_slot_weights_decay_from_one():
    w = slot_weights(8, 4.0)
    assert w.shape == (7,) and w[0] == 1 and torch.allclose(w[1:] / w[:-1], torch.full((6,), math.exp(-0.25)))


def test_anchors_are_completion_tokens_followed_by_one():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    assert valid_anchors(mask).tolist() == [2, 3, 6]
    drawn = sample_anchors(torch.ones(100, dtype=torch.long), 10, torch.Generator().manual_seed(0))
    assert drawn.numel() == 10 and drawn.tolist() == sorted(set(drawn.tolist())) and int(drawn.max()) < 99
    anchors, real = pad_anchors([torch.tensor([2, 3]), torch.tensor([6])])
    assert anchors.tolist() == [[2, 3], [6, 0]] and real.tolist() == [[True, True], [True, False]]
    ids = torch.arange(8)[None]
    labels, counted = block_labels(ids, mask[None], torch.tensor([[3, 6]]), torch.ones(1, 2, dtype=torch.bool), 4)
    assert labels[0, 0].tolist() == [4, 5, 6] and counted[0, 0].tolist() == [True, False, True]
    assert labels[0, 1, :1].tolist() == [7] and counted[0, 1].tolist() == [True, False, False]  # past the end


def test_block_attention_matches_a_dense_masked_reference():
    """Context keys before the anchor, every key of the block's own block (bidirectional), no other block's."""
    g = torch.Generator().manual_seed(0)
    r, heads, kv, a, b, d, t = 2, 4, 2, 3, 4, 8, 11
    q = torch.randn(r, heads, a, b, d, generator=g, dtype=torch.float64)
    ck, cv = (torch.randn(r, kv, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    bk, bv = (torch.randn(r, kv, a, b, d, generator=g, dtype=torch.float64) for _ in range(2))
    anchors = torch.tensor([[0, 4, 9], [2, 3, 10]])  # anchor 0 sees no context row: its own block only
    out = block_attention(q, ck, cv, bk, bv, context_visible(anchors, t))

    keys = torch.cat([ck, bk.flatten(2, 3)], dim=2).repeat_interleave(2, dim=1)
    values = torch.cat([cv, bv.flatten(2, 3)], dim=2).repeat_interleave(2, dim=1)
    owner = torch.arange(a).repeat_interleave(b)                                     # block of each query/key
    ctx_mask = torch.arange(t)[None, None, :] < anchors.repeat_interleave(b, dim=1)[..., None]
    blk_mask = (owner[:, None] == owner[None, :]).expand(r, -1, -1)
    mask = torch.cat([ctx_mask, blk_mask], dim=-1)[:, None]
    ref = F.scaled_dot_product_attention(q.flatten(2, 3), keys, values, attn_mask=mask)
    assert torch.allclose(out.flatten(2, 3), ref, atol=1e-12)


def test_a_block_sees_its_context_and_its_block_only():
    """The block at anchor p computed in the whole sample equals the block computed as vLLM would, from the
    rows before p alone; other anchors in the same pass change nothing; later rows change nothing."""
    draft = tiny_draft()
    ids, aux, _ = sample()
    full = draft(ids, aux, torch.tensor([[6, 9, 14]]))
    for i, p in enumerate((6, 9, 14)):
        # what the server has at that step: the context rows t < p and the anchor token x_p, nothing after
        served_ids = torch.cat([ids[:, :p + 1], torch.zeros(1, 3, dtype=ids.dtype)], dim=1)
        served_aux = torch.cat([aux[:, :p], torch.randn(1, 4, aux.shape[-1], dtype=aux.dtype)], dim=1)
        alone = draft(served_ids, served_aux, torch.tensor([[p]]))
        assert torch.allclose(full[0, i], alone[0, 0], atol=1e-10)


def test_the_block_is_bidirectional():
    """Slot 0 (the anchor) depends on the masked slots after it: its output moves with the mask embedding."""
    draft = tiny_draft()
    ids, aux, _ = sample()
    before = draft(ids, aux, torch.tensor([[8]]))
    with torch.no_grad():
        draft.embed.weight[draft.cfg.mask_token_id] += 1.0
    after = draft(ids, aux, torch.tensor([[8]]))
    assert (before[0, 0, 0] - after[0, 0, 0]).abs().max() > 1e-4


def test_loss_is_the_weighted_mean_of_the_slot_cross_entropies():
    draft = tiny_draft()
    ids, aux, mask = sample()
    anchors, real = pad_anchors([valid_anchors(mask[0])])
    module = BlockLoss(draft, gamma=2.0, chunk_rows=5)
    denom = module.denominator(mask, anchors, real)
    loss, stats, lead = module(ids, aux, mask, anchors, real, denom)

    states = draft(ids, aux, anchors)[:, :, 1:]
    labels, counted = block_labels(ids, mask, anchors, real, 4)
    ce = F.cross_entropy(draft.lm_head(states).flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    w = slot_weights(4, 2.0).double()
    assert torch.isclose(denom, (w * counted).sum().float())
    assert torch.allclose(loss, (ce * w * counted).sum() / (w * counted).sum())
    assert stats[:, 2].tolist() == counted.sum((0, 1)).tolist()
    assert torch.allclose(stats[:, 0], (ce * counted).sum((0, 1)))
    hits = draft.lm_head(states).argmax(-1) == labels
    assert lead.tolist() == leads(hits, counted).tolist()
    assert leads(torch.tensor([[[True, False, True], [True, True, True]]]), torch.ones(1, 2, 3, dtype=torch.bool)
                 ).tolist() == [[1, 3]]


def test_chunked_cross_entropy_gives_autograd_gradients():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (7,), generator=g)
    ce, best = vocab_ce(h, w, labels, chunk_rows=3)
    (ce * torch.arange(7)).sum().backward()
    ref_h = h.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_h @ w.T, labels, reduction="none")
    (ref * torch.arange(7)).sum().backward()
    assert torch.allclose(ce, ref) and torch.allclose(h.grad, ref_h.grad)
    assert best.tolist() == (ref_h @ w.T).argmax(-1).tolist()


def test_a_tiny_draft_overfits_one_sample():
    draft = tiny_draft(num_hidden_layers=1).float()
    ids, aux, mask = sample(length=24, prompt=4)
    anchors, real = pad_anchors([valid_anchors(mask[0])])
    module = BlockLoss(draft, gamma=4.0)
    denom = module.denominator(mask, anchors, real)
    opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(60):
        loss, stats, _ = module(ids, aux.float(), mask, anchors, real, denom)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    acc = stats[:, 1].sum() / stats[:, 2].sum()
    assert losses[-1] < 0.3 * losses[0] and acc > 0.8, (losses[0], losses[-1], float(acc))


def test_a_zero_mask_row_makes_every_masked_slot_the_same():
    """Why the mask token needs a real embedding row: with W_e[M] = 0 (a padding row) the masked slots' queries
    are 0, their attention uniform, and every slot's output identical whatever its position, so every slot
    proposes one token (the first fixture draft: slot accuracies all ~0.25, vLLM 0.30, 0.02, 0.02 ...)."""
    draft = tiny_draft(num_hidden_layers=1)
    ids, aux, _ = sample()
    with torch.no_grad():
        draft.embed.weight[draft.cfg.mask_token_id] = 0.0
    dead = draft(ids, aux, torch.tensor([[8]]))[0, 0, 1:]
    assert torch.allclose(dead, dead[:1].expand_as(dead), atol=1e-12)
    with torch.no_grad():
        draft.embed.weight[draft.cfg.mask_token_id].normal_(0, 1)
    live = draft(ids, aux, torch.tensor([[8]]))[0, 0, 1:]
    assert (live[1:] - live[:1]).abs().amax(-1).min() > 1e-3  # RoPE now tells the slots apart


class _Tokenizer:
    """The fixture tokenizer's specials: [PAD] 0, [BOS] 1, <|im_end|> 2."""
    all_special_ids = [1, 2, 0]

    def get_vocab(self) -> dict[str, int]:
        return {"[PAD]": 0, "[BOS]": 1, "<|im_end|>": 2}

    def convert_ids_to_tokens(self, i: int) -> str:
        return {0: "[PAD]", 1: "[BOS]", 2: "<|im_end|>"}.get(i, f"t{i}")


def test_the_mask_token_has_a_usable_embedding_row():
    """[PAD] is unused by the completions but its row is zero: the pick skips it (here for [BOS]), refuses it
    when asked for, and falls back to an unused id whose row is real."""
    embedding = torch.randn(10, 8) * 0.02
    embedding[0] = 0.0
    counts = torch.tensor([0, 0, 5, 3, 3, 3, 0, 3, 3, 0])  # <|im_end|> ends every completion
    assert usable_mask_rows(embedding, counts).tolist() == [False] + [True] * 9
    assert pick_mask_token(_Tokenizer(), counts, None, embedding) == (1, "[BOS]")
    with pytest.raises(ValueError, match="embedding row"):
        pick_mask_token(_Tokenizer(), counts, 0, embedding)
    assert pick_mask_token(_Tokenizer(), counts, 6, embedding) == (6, "t6")
    embedding[1] *= 0.1  # [BOS] far below the others: nearly as bad as zero
    assert pick_mask_token(_Tokenizer(), counts, None, embedding) == (9, "t9")


def test_eval_proposes_what_the_trained_block_predicts():
    """`eyas-train eval`'s DFlash proposer (vLLM's layout: the last token and k masks, the rows before it as
    context) gives, at K = B - 1, the argmax of the training forward's block at that anchor; with fewer draft
    tokens it runs a shorter block, as vLLM runs K + 1 queries."""
    draft = tiny_draft()
    ids, aux, _ = sample()
    for p in (6, 11, 15):
        trained = draft.lm_head(draft(ids, aux, torch.tensor([[p]]))[0, 0, 1:]).argmax(-1).tolist()
        assert DFlash.propose(draft, ids[0, :p + 1], aux[0, :p], 3) == trained
        short = draft(ids[:, :p + 1], torch.cat([aux[:, :p], aux[:, :1]], 1), torch.tensor([[p]]), block_size=3)
        shorter = draft.lm_head(short[0, 0, 1:]).argmax(-1).tolist()
        assert DFlash.propose(draft, ids[0, :p + 1], aux[0, :p], 2) == shorter


# ------------------------------------------------------------------------------------------------
# export


def test_every_weight_has_an_exported_name_and_comes_back():
    """Name-map coverage: every trained tensor is exported under a server name, the target's own are not, and
    the export reads back into the same module."""
    draft = tiny_draft(num_hidden_layers=3)
    state = draft.state_dict()
    tensors = exported_tensors(state, torch.float32)
    assert set(tensors) == {exported_name(n) for n in state if n not in NOT_EXPORTED}
    assert not any("embed" in n or "lm_head" in n for n in tensors)
    assert "layers.2.self_attn.k_norm.weight" in tensors and "hidden_norm.weight" in tensors
    back = imported_state(tensors, 3)
    assert set(back) == set(state) - NOT_EXPORTED
    assert all(torch.equal(back[n], state[n].float()) for n in back)
    with pytest.raises(KeyError, match="does not map"):
        exported_tensors({**state, "extra.weight": torch.zeros(1)}, torch.float32)


def test_config_names_the_dflash_keys_both_servers_read():
    cfg = tiny_config(num_features=5)
    out = hf_config(cfg, [2, 3, 4, 5, 6], {"num_hidden_layers": 8, "eos_token_id": 2}, torch.bfloat16, "[PAD]")
    assert out["architectures"] == ["DFlashDraftModel"] and out["model_type"] == "qwen3"
    assert out["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]  # layer outputs: aux id - 1
    assert out["dflash_config"]["mask_token_id"] == 49 and out["block_size"] == out["dflash_config"]["block_size"] == 4
    assert "eagle_config" not in out and "eagle_aux_hidden_state_layer_ids" not in out and "layer_types" not in out
    assert out["torch_dtype"] == "bfloat16" and out["num_target_layers"] == 8


@pytest.mark.vllm
def test_vllm_loads_the_export_with_its_own_loader(fixture_target, tmp_path):
    """vLLM 0.32's config code and DFlashQwen3ForCausalLM.load_weights read an eyas export: the method, the
    capture layers, the mask token, non-causal attention, and every weight equal to what eyas wrote; the
    embedding and lm_head are left to the target's."""
    target = text_config(fixture_target)
    cfg = tiny_config(vocab_size=target["vocab_size"], hidden_size=128, target_hidden_size=128, num_features=5,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=320,
                      block_size=8, mask_token_id=0, rope_parameters=target["rope_parameters"])
    draft = DFlashDraft(cfg)
    draft.init_weights(0)
    write_dflash_draft(tmp_path / "draft", draft.state_dict(), cfg, [2, 3, 4, 5, 6], target, "[PAD]")
    probe = Path(__file__).with_name("vllm_dflash_probe.py")
    run = subprocess.run([str(default_vllm_python()), str(probe), str(fixture_target), str(tmp_path / "draft"), "7"],
                         capture_output=True, text=True, timeout=900)
    lines = [x for x in run.stdout.splitlines() if x.startswith("PROBE ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("PROBE "))
    assert got["class"] == "DFlashQwen3ForCausalLM" and got["method"] == "dflash", got
    assert got["aux_layers"] == [2, 3, 4, 5, 6] and got["mask_token_id"] == 0 and got["non_causal"], got
    assert got["fc_in"] == 5 * 128 and got["layers"] == 2 and got["num_speculative_tokens"] == 7, got
    assert got["compared"] and all(got["compared"].values()), got
    # q/k/v and gate/up are stacked in vLLM: three fewer parameters per layer than exported tensors
    assert len(got["compared"]) == len(exported_tensors(draft.state_dict(), torch.float32)) - 3 * 2, got
    assert set(got["unloaded"]) == {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}, got
    assert not got["own_lm_head"] and not got["own_embed"], got


def test_packed_rows_keep_samples_apart():
    """Two samples end to end in one row (segment / positions, as data.collate lays them) give each sample's
    blocks exactly what it gets alone."""
    draft = tiny_draft()
    (ids_a, aux_a, mask_a), (ids_b, aux_b, mask_b) = sample(12, 3, seed=1), sample(9, 2, seed=2)
    ids, aux, mask = (torch.cat(p, dim=1) for p in ((ids_a, ids_b), (aux_a, aux_b), (mask_a, mask_b)))
    segment = torch.tensor([[1] * 12 + [2] * 9])
    positions = torch.cat([torch.arange(12), torch.arange(9)])[None]
    anchors = sample_anchors(mask[0], 100, segment=segment[0])
    assert anchors.tolist() == list(range(3, 11)) + list(range(14, 20))  # never the last token of a sample
    packed = draft(ids, aux, anchors[None], positions, segment)
    alone_a = draft(ids_a, aux_a, valid_anchors(mask_a[0])[None])
    alone_b = draft(ids_b, aux_b, valid_anchors(mask_b[0])[None])
    assert torch.allclose(packed[0, :8], alone_a[0], atol=1e-10)
    assert torch.allclose(packed[0, 8:], alone_b[0], atol=1e-10)
    labels, counted = block_labels(ids, mask, anchors[None], torch.ones(1, 14, dtype=torch.bool), 4, segment)
    assert counted[0, 7].tolist() == [True, False, False]  # the block at 10 stops at its sample's end


# ------------------------------------------------------------------------------------------------
# the run, on the fixture target: extraction of the DFlash layers (fp8, top-k), `--method dflash`, export


@pytest.fixture(scope="module")
def dflash_hidden(fixture_target, tmp_path_factory):
    from eyas_extract.run import run as extract
    from eyas_testing.datasets import generate_samples, write_synth

    root = tmp_path_factory.mktemp("dflash")
    synth = write_synth(root, "fx", generate_samples(fixture_target, 16, seed=5, max_new_tokens=48), fixture_target)
    extract(synth=synth.ref, model=fixture_target, name="fx5", layers=dflash_layers(8), teacher="topk", topk=4,
            aux_dtype="fp8", shard_samples=8, data_root=root, progress=False)
    return root


def test_run_method_dflash_trains_and_exports(dflash_hidden, fixture_target):
    from eyas_common.contract import Dataset
    from eyas_train.dflash_export import load_dflash_draft
    from eyas_train.export_ckpt import export_checkpoint
    from eyas_train.train import run as train

    root = dflash_hidden
    path = train(hidden="hidden/fx5", model=fixture_target, name="dfl", data_root=root, method="dflash", epochs=3,
                 batch_size=4, val_samples=4, log_every=1, ckpt_every=3, anchors=16)
    m = Dataset.parse("dfl", "drafts", root).read_manifest()
    draft_params, stats = m["params"]["draft"], m["stats"]
    assert m["status"] == "complete" and m["params"]["aux_layers"] == [2, 3, 4, 5, 6]
    # the knobs resolved from the target: width 128 -> blocks of 8, 8 layers -> three draft layers (the floor)
    assert draft_params["block_size"] == 8 and draft_params["num_hidden_layers"] == 3
    assert draft_params["num_features"] == 5
    # [BOS]: the first special token no completion uses whose embedding row is real ([PAD]'s is zero)
    assert draft_params["mask_token_id"] == 1
    assert len(stats["final"]["step_acc"]) == 7 and sorted(stats["predicted_acceptance"], key=int) == list("1234567")
    assert all(1 <= v <= 1 + int(k) for k, v in stats["predicted_acceptance"].items())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert cfg["dflash_config"]["mask_token"] == "[BOS]"
    # the card's serve line is the one this draft is served with: method dflash, K = block size - 1
    assert '"method": "dflash"' in (card := (path / "README.md").read_text()) and '"num_speculative_tokens": 7' in card
    draft, aux = load_dflash_draft(path, fixture_target)
    assert aux == [2, 3, 4, 5, 6] and draft.cfg.block_size == 8
    snap = export_checkpoint("dfl", out="dfl_snap", data_root=root)  # a re-export of the last checkpoint
    assert json.loads((snap / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]


def test_serve_command_lines_follow_the_draft_method(tmp_path):
    from eyas_common.drafts import read_config, served_spec_tokens
    from eyas_serve.config import LaunchConfig
    from eyas_serve.engines import engine_command

    cfg = tiny_config(num_features=5, block_size=6)
    write_dflash_draft(tmp_path, DFlashDraft(cfg).state_dict(), cfg, [2, 3, 4, 5, 6], {"num_hidden_layers": 8})
    assert read_config(tmp_path)["block_size"] == 6
    assert served_spec_tokens(tmp_path) == 5 and served_spec_tokens(tmp_path, eagle3=3) == 5  # block size - 1
    assert served_spec_tokens(tmp_path / "no-draft-here", eagle3=4) == 4  # no DFlash config: EAGLE-3's K
    for asked, k in ((None, 5), (2, 2)):  # --spec-tokens unset: the block the draft was trained for
        launch = LaunchConfig(engine="vllm", model="/models/target", python="python3", spec_tokens=asked)
        cmd = engine_command(launch, tmp_path)
        spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert spec == {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": k}
    sglang = engine_command(LaunchConfig(engine="sglang", model="/models/target", python="python3"), tmp_path)
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH"
    assert "--speculative-eagle-topk" not in sglang
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(tmp_path)


@pytest.fixture(scope="module")
def overfit_drafts(dflash_hidden, fixture_target) -> dict[str, dict]:
    """An EAGLE-3 and a DFlash draft trained alike on the same 16 answers (30 epochs, batch 4, lr 3e-3, no
    validation): each one's final training record."""
    from eyas_common.contract import Dataset
    from eyas_train.train import run as train

    final = {}
    for method in ("eagle3", "dflash"):
        train(hidden="hidden/fx5", model=fixture_target, name=f"overfit_{method}", data_root=dflash_hidden,
              method=method, epochs=30, batch_size=4, lr=3e-3, val_samples=0, log_every=8, ckpt_every=1000)
        final[method] = Dataset.parse(f"overfit_{method}", "drafts", dflash_hidden).read_manifest()["stats"]["final"]
    return final


def test_slot_one_learns_what_eagle3s_first_step_learns(overfit_drafts):
    """Slot 1 of a block has what EAGLE-3's first step has (the target's rows up to the anchor, the anchor
    token), so on the same data it must learn about as well. Measured: EAGLE-3 0.84, DFlash 0.86 (three
    layers; 0.81 with two, 0.76 with one); with the zero [PAD] row as the mask embedding every slot sat at
    ~0.25, below the anchor-token bigram (0.36), and slot 1 no better than slot 7."""
    eagle, dflash = overfit_drafts["eagle3"]["step_acc"], overfit_drafts["dflash"]["step_acc"]
    assert dflash[0] >= eagle[0] - 0.1 and dflash[0] > 0.5, (dflash, eagle)


@pytest.mark.vllm
def test_vllm_serves_a_trained_dflash_draft(overfit_drafts, dflash_hidden, fixture_target):
    """Real vLLM (CPU) serves a DFlash draft trained on the fixture (`"method": "dflash"`, K = block size - 1)
    and counts its drafts; `eyas-train eval` replays the same prompts offline (the block proposer, greedy
    verification) and gets vLLM's acceptance, as it does for EAGLE-3 (tests/test_serve_vllm.py)."""
    from eyas_testing.acceptance import vllm_acceptance
    from eyas_testing.fixture import write_prompts_jsonl
    from eyas_train.eval import evaluate

    root, path = dflash_hidden, dflash_hidden / "drafts" / "overfit_dflash"
    # The first 5 prompts of the 16 it was trained on (dflash_hidden: seed 5, train split): served greedily, their
    # answers are the training answers, so a draft that learnt them is accepted there and a broken one is not.
    prompts = write_prompts_jsonl(root / "trained5.jsonl", 5, seed=5, split="train")
    got = vllm_acceptance(fixture_target, path, prompts, root / "vllm_dflash.log", spec_tokens=7, max_tokens=64,
                          extra_args=["--enforce-eager"])
    offline = evaluate(draft="drafts/overfit_dflash", model=fixture_target, prompts=prompts, spec_tokens=7,
                       max_tokens=64, data_root=root)
    print(json.dumps({"vllm": got, "offline": offline}))
    assert got["drafts"] > 0 and got["draft_tokens"] == 7 * got["drafts"], got
    # vLLM's per-position counters, read apart from its accepted total, must add up to it, and fall with the
    # position (a block is accepted as a prefix): what a misread /metrics page would not give.
    pos = got["per_position"]
    assert len(pos) == 7 and abs(1 + sum(pos) - got["acceptance_length"]) < 1e-9, got
    assert all(a >= b for a, b in zip(pos, pos[1:])), got
    # Measured here: 3.62 (per position 0.64 .. 0.27; eval the same). An untrained draft gives about 1.0, and the
    # zero-mask-row draft, every slot one guess, gave 1.35 at 7 tokens (bench/RESULTS.md): 1.5 tells them apart.
    assert got["acceptance_length"] >= 1.5, got
    assert offline["method"] == "dflash" and len(offline["per_position"]) == 7, offline
    assert abs(offline["acceptance_length"] - got["acceptance_length"]) <= 0.15, (offline, got)


def test_bench_quality_runs_dflash_beside_eagle3():
    """bench/quality.py --method eagle3,dflash: EAGLE-3's cached names are unchanged, DFlash's drafts and
    hidden datasets have their own, its recipes drop --draft-vocab, and the table names the method and K."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality", Path(__file__).parents[1] / "bench" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    assert quality.draft_name("llama", 250, "hand", 0) == "llama_250_hand"
    assert quality.draft_name("llama", 250, "hand", 2, "dflash") == "llama_250_hand_dflash-seed2"
    assert quality.hidden_name("llama", 250, "eagle3") == "llama_250"
    assert quality.hidden_name("llama", 250, "dflash") == "llama_250_dflash"
    hand = quality.recipe_options("hand", "dflash", "llama")
    assert "draft_vocab" not in hand and hand["method"] == "dflash" and hand["lr"] == 3e-3
    assert quality.recipe_options("hand", "eagle3", "llama")["draft_vocab"] == 1024
    # a real target's hand recipe keeps the default vocabulary (1,024 covers too little of real text)
    assert "draft_vocab" not in quality.recipe_options("hand", "eagle3", "smollm2")
    assert quality.recipe_options("defaults", "eagle3", "smollm2") == {"method": "eagle3"}
    # held-out coverage: masked (answer) tokens only, against t2d; no t2d is the whole vocabulary
    answers = [([5, 1, 2, 3], [0, 1, 1, 1]), ([5, 4], [0, 1])]
    t2d = torch.tensor([False, True, True, False, False, True])
    assert quality.heldout_coverage(t2d, answers) == 0.5 and quality.heldout_coverage(None, answers) == 1.0
    cell = {"target": "llama", "samples": 250, "vllm": {"acceptance_length": 3.5}, "predicted": 3.4, "chain": 3.6,
            "train_s": 100.0, "resolved": {"batch_size": 4, "lr": 3e-3, "total_steps": 1080}}
    table = quality.table([{"defaults": [cell]}, {"defaults": [cell | {"method": "dflash", "spec_tokens": 7}]}])
    lines = table.splitlines()
    assert "| method (K) |" in lines[0] and "| eagle3 (3) |" in lines[2] and "| dflash (7) |" in lines[3], table
    # speedups at 1, 4 and 16 in flight where the cell measured them (cells cached before them show "-")
    assert "| defaults | 3.50 | 3.40 (3.60) | - |" in lines[2] and quality.SPEEDUP_AT == (1, 4, 16)
    timed = quality.table([{"defaults": [cell | {"speedup": {"1": 1.2, "4": 1.3, "16": 1.5}}]}]).splitlines()[2]
    assert "| 1.20x 1.30x 1.50x |" in timed, timed
    older = quality.table([{"defaults": [cell | {"speedup": {"1": 1.2, "16": 1.5}}]}]).splitlines()[2]
    assert "| 1.20x - 1.50x |" in older, older
    # one line per recipe of a row, each named
    both = quality.table([{"defaults": [cell], "fast": [cell | {"train_s": 40.0}]}]).splitlines()
    assert "| defaults |" in both[2] and "| fast |" in both[3] and "| 40 |" in both[3], both
    fast = quality.recipe_options("fast", "eagle3", "smollm2")
    assert fast["head_negatives"] == 256 and fast["ttt_steps"] == quality.SPEC_TOKENS + 1
    assert not {"head_negatives", "ttt_steps"} & set(quality.recipe_options("fast", "dflash", "smollm2"))
    # such a cell is measured again when the bench runs: its levels are not SPEEDUP_AT's
    assert quality.measured_at({"speedup": {"16": 1.5, "1": 1.2}}) == [1, 16] and quality.measured_at({}) == []
    covered = quality.table([{"defaults": [cell | {"heldout_coverage": 0.99}]}]).splitlines()
    assert "held-out coverage" in covered[0] and "| 0.990 |" in covered[2], covered
