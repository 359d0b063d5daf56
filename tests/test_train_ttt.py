"""Stage 03 model math on tiny shapes: the TTT attention mask and loss against a slow reference, the
eval's incremental chain against TTT rows (the vLLM semantics), the vocabulary maps, the export names."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers import V, VD, tiny
from eyas_train.methods.eagle3 import Eagle3
from eyas_train.export import NAME_MAP, NOT_EXPORTED, exported_tensors, hf_config, imported_state, write_draft
from eyas_train.ttt import ChainAttention, UnrolledLoss, shift, step_counts, ttt_attention
from eyas_train.vocab import build_vocab, count_tokens


def batch(seed: int = 0, lengths=(9, 6, 1)):
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.randint(1, V, (b, t), generator=g)
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        mask[i, n // 3:n] = 1
    aux = torch.randn(b, t, 48, generator=g, dtype=torch.double)
    p = torch.softmax(3 * torch.randn(b, t, VD, generator=g, dtype=torch.double), -1)
    top = torch.randint(0, V, (b, t), generator=g)
    return ids, aux, p, top, mask


# ------------------------------------------------------------------------------------------------
# slow reference: explicit keys of every step, an explicit boolean mask, per-row Python loops


class DenseMaskAttention:
    """Keys of all steps concatenated; query (step i, row t) may see key (step j, row u) iff
    j == 0 and u <= t (the first pass, causal), or 1 <= j <= i and u == t (its own chain)."""

    def __init__(self):
        self.k, self.v = [], []

    def __call__(self, q, k, v):
        self.k.append(k)
        self.v.append(v)
        i, t = len(self.k) - 1, q.shape[2]
        rep = q.shape[1] // k.shape[1]
        keys = torch.cat([x.repeat_interleave(rep, 1) for x in self.k], dim=2)      # [B, H, (i+1)T, D]
        vals = torch.cat([x.repeat_interleave(rep, 1) for x in self.v], dim=2)
        allowed = torch.zeros(t, (i + 1) * t, dtype=torch.bool)
        for row in range(t):
            for j in range(i + 1):
                for u in range(t):
                    allowed[row, j * t + u] = (j == 0 and u <= row) or (1 <= j <= i and u == row)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vals


def reference_loss(draft, steps, ids, aux, p, top, mask, decay=0.8):
    b, t = ids.shape
    attend = DenseMaskAttention()
    hidden = draft.fuse(aux)
    total = 0.0
    stats = torch.zeros(steps, 3, dtype=torch.double)
    right = torch.zeros(steps, b, t, dtype=torch.bool)  # step k at row r: counted and the target's top token
    counts = torch.zeros(steps)
    for k in range(steps):
        for i in range(b):
            for r in range(t):
                counts[k] += r + 2 + k < t and bool(mask[i, r + 2 + k])
    for k in range(steps):
        tokens = torch.zeros_like(ids)
        for i in range(b):
            for r in range(t):
                tokens[i, r] = ids[i, r + 1 + k] if r + 1 + k < t else 0
        out = draft.step(tokens, hidden, torch.arange(t).expand(b, t) + k, attend)
        logq = F.log_softmax(draft.logits(out), -1)
        for i in range(b):
            for r in range(t):
                if r + 2 + k < t and mask[i, r + 2 + k]:
                    ce = -(p[i, r + 1 + k] * logq[i, r]).sum()
                    total = total + decay**k * ce / counts[k]
                    stats[k, 0] += ce.item()
                    hit = draft.to_target_ids(logq[i, r].argmax()) == top[i, r + 1 + k]
                    stats[k, 1] += float(hit)
                    stats[k, 2] += 1
                    right[k, i, r] = bool(hit)
        hidden = out
    lead = right.long().cumprod(0).sum(0)  # leading right steps at each row
    return total, stats, lead


@pytest.mark.parametrize("norm_before_residual,steps,lengths", [(False, 4, (9, 6, 1)), (True, 4, (9, 6, 1)),
                                                                  (False, 7, (5, 3))])  # more steps than rows
def test_ttt_loss_and_grads_match_the_slow_reference(norm_before_residual, steps, lengths):
    ids, aux, p, top, mask = batch(lengths=lengths)
    fast = tiny(norm_before_residual)
    slow = tiny(norm_before_residual)
    loss, stats = UnrolledLoss(fast, steps)(ids, aux, p, top, mask, step_counts(mask, steps))
    ref, ref_stats, _ = reference_loss(slow, steps, ids, aux, p, top, mask)
    assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(stats, ref_stats, rtol=1e-10)
    loss.backward()
    ref.backward()
    for (name, a), b in zip(fast.named_parameters(), slow.parameters()):
        if a.requires_grad:
            assert torch.allclose(a.grad, b.grad, rtol=1e-8, atol=1e-12), name


def test_leads_count_the_right_proposals_in_a_row_from_each_root():
    """The replay's input: at row t, how many of steps 0, 1, ... were counted and right before the first miss.
    A zero lm_head makes the draft always propose d2t[0], so where the target's top token is d2t[0] decides
    the hits: scattered over the rows, they give leads of every length."""
    steps = 4
    ids, aux, p, _, mask = batch(lengths=(12, 9, 4))
    drafts = tiny(), tiny()
    for d in drafts:
        with torch.no_grad():
            d.lm_head.weight.zero_()
    proposed = int(drafts[0].d2t[0])
    g = torch.Generator().manual_seed(3)
    top = torch.where(torch.rand(ids.shape, generator=g) < 0.75, proposed, (proposed + 1) % V)
    leads: list[torch.Tensor] = []
    _, stats = UnrolledLoss(drafts[0], steps)(ids, aux, p, top, mask, step_counts(mask, steps), leads=leads)
    _, _, ref_lead = reference_loss(drafts[1], steps, ids, aux, p, top, mask)
    assert torch.equal(leads[0], ref_lead)
    assert set(ref_lead.unique().tolist()) >= {0, 1, 2} and int(ref_lead.sum()) < int(stats[:, 1].sum())


@pytest.mark.parametrize("tq", [7, 1])
def test_fused_and_merged_attention_agree_with_the_dense_mask(tq):
    """Both kernels (SDPA over the masked union, used on GPU; causal block + log-sum-exp merge, used on
    CPU) equal the dense-mask reference, for training (Tq = T0) and the eval's last row (Tq = 1)."""
    g = torch.Generator().manual_seed(3)
    t0, steps = 7, 4
    q = torch.randn(2, 4, tq, 8, generator=g, dtype=torch.double, requires_grad=True)
    keys = [torch.randn(2, 2, t0 if j == 0 else tq, 8, generator=g, dtype=torch.double) for j in range(steps)]
    vals = [torch.randn(2, 2, t0 if j == 0 else tq, 8, generator=g, dtype=torch.double) for j in range(steps)]
    for i in range(1, steps + 1):
        ref = DenseMaskAttention()
        if tq == t0:
            for k, v in zip(keys[:i], vals[:i]):
                want = ref(q, k, v)
        else:  # only the last row of the reference's full-width answer
            full_q = torch.cat([torch.zeros(2, 4, t0 - tq, 8, dtype=torch.double), q], dim=2)
            pad = [torch.cat([torch.zeros(2, 2, t0 - tq, 8, dtype=torch.double), x], 2) if j else x
                   for j, x in enumerate(keys[:i])]
            padv = [torch.cat([torch.zeros(2, 2, t0 - tq, 8, dtype=torch.double), x], 2) if j else x
                    for j, x in enumerate(vals[:i])]
            for k, v in zip(pad, padv):
                want = ref(full_q, k, v)
            want = want[:, :, -tq:]
        merged = ttt_attention(q, keys[:i], vals[:i], fused=False)
        fused = ttt_attention(q, keys[:i], vals[:i], fused=True)
        assert torch.allclose(merged, want, atol=1e-12) and torch.allclose(fused, want, atol=1e-12), i
        gm, = torch.autograd.grad(merged.square().sum(), q)
        gf, = torch.autograd.grad(fused.square().sum(), q)
        assert torch.allclose(gm, gf, atol=1e-10)


def test_padding_does_not_leak_into_real_rows():
    """A sample's loss is the same alone and next to a longer, padded neighbour."""
    steps = 3
    draft = tiny()
    ids, aux, p, top, mask = batch(lengths=(9, 5))
    both, stats = UnrolledLoss(draft, steps)(ids, aux, p, top, mask, torch.ones(steps))
    alone, stats_alone = UnrolledLoss(draft, steps)(ids[1:, :5], aux[1:, :5], p[1:, :5], top[1:, :5], mask[1:, :5],
                                                    torch.ones(steps))
    first, _ = UnrolledLoss(draft, steps)(ids[:1], aux[:1], p[:1], top[:1], mask[:1], torch.ones(steps))
    assert torch.allclose(both, alone + first, rtol=1e-10)


def test_eval_chain_equals_ttt_rows():
    """vLLM's way (first pass over the prefix, then one query per step over the cached keys) gives the
    same proposals as the TTT rows fed the same tokens: the TTT mask is the inference attention."""
    draft = tiny(seed=5)
    g = torch.Generator().manual_seed(7)
    n = 8
    ids = torch.randint(1, V, (n + 4,), generator=g)
    aux = torch.randn(n + 4, 48, generator=g, dtype=torch.double)
    for t in range(0, n - 1):
        chain = Eagle3.propose(draft, ids[: t + 2], aux[: t + 1], 3)
        # Rows past t hold the chain's proposals as tokens; TTT row t at step k must then propose chain[k].
        seq = torch.cat([ids[: t + 2], torch.tensor(chain[:2])])[None]
        attend, hidden = ChainAttention(), draft.fuse(aux[None, : seq.shape[1]])
        pos = torch.arange(seq.shape[1])[None]
        for k in range(3):
            hidden = draft.step(shift(seq, 1 + k), hidden, pos + k, attend)
            got = int(draft.to_target_ids(draft.logits(hidden)[0, t].argmax()))
            assert got == chain[k], (t, k)


# ------------------------------------------------------------------------------------------------
# vocabulary


def test_vocab_round_trip():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2000,), generator=g) ** 2 % 97     # skewed, some ids never seen
    mask = torch.rand(2000, generator=g) < 0.7
    counts = count_tokens(ids, mask, 100)
    assert torch.equal(counts, torch.bincount(ids[mask], minlength=100))
    vm = build_vocab(counts, 30)
    d2t_ids = vm.draft_to_target
    assert vm.d2t.dtype == torch.long and vm.t2d.dtype == torch.bool and vm.t2d.shape == (100,)
    assert torch.equal(torch.nonzero(vm.t2d).flatten(), d2t_ids)             # d2t and t2d agree
    assert torch.equal(vm.target_to_draft[d2t_ids], torch.arange(30))          # target -> draft -> target
    assert (vm.target_to_draft[~vm.t2d] == -1).all()
    assert torch.all(vm.d2t[1:] >= vm.d2t[:-1])
    # the kept ids are the 30 most frequent
    assert counts[d2t_ids].min() >= counts[~vm.t2d].max()
    assert vm.coverage == pytest.approx(float(counts[d2t_ids].sum() / counts.sum()))
    assert vm.distinct == int((counts > 0).sum())
    full = build_vocab(counts, 32000)                                         # capped at the target vocab
    assert full.d2t.numel() == 100 and not full.d2t.any() and full.t2d.all() and full.coverage == 1.0
    tie = build_vocab(torch.tensor([5, 3, 3, 3, 0]), 2)                        # ties go to the lower id
    assert tie.draft_to_target.tolist() == [0, 1]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_tokens(torch.tensor([100]), torch.tensor([1]), 100)


# ------------------------------------------------------------------------------------------------
# export

EXPECTED = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


def test_name_map_covers_the_module_exactly():
    draft = tiny().float()
    state = draft.state_dict()
    assert set(state) == set(NAME_MAP) | NOT_EXPORTED
    out = exported_tensors(state, torch.bfloat16)
    assert set(out) == EXPECTED and not any("embed" in k for k in out)
    assert out["fc.weight"].shape == (16, 48) and out["midlayer.self_attn.q_proj.weight"].shape == (32, 32)
    assert out["lm_head.weight"].shape == (VD, 16) and out["lm_head.weight"].dtype == torch.bfloat16
    assert out["d2t"].dtype == torch.int64 and out["t2d"].dtype == torch.bool and out["t2d"].shape == (V,)
    assert set(imported_state(out)) == set(NAME_MAP)
    # the identity map (draft vocabulary = target vocabulary) is left out: vLLM refuses a d2t then
    ident = {**state, "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool),
             "lm_head.weight": torch.zeros(V, 16)}
    assert set(exported_tensors(ident, torch.float32)) == EXPECTED - {"d2t", "t2d"}
    with pytest.raises(KeyError, match="unknown"):
        exported_tensors({**state, "layer.extra.weight": torch.zeros(1)}, torch.float32)
    with pytest.raises(KeyError, match="missing"):
        exported_tensors({k: v for k, v in state.items() if k != "fc.weight"}, torch.float32)


def test_config_keys(tmp_path):
    draft = tiny().float()
    target = {"dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    write_draft(tmp_path, draft.state_dict(), draft.cfg, [2, 4, 5], target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == hf_config(draft.cfg, [2, 4, 5], target, torch.float32)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V and cfg["draft_vocab_size"] == VD
    assert cfg["target_hidden_size"] == 16 and cfg["head_dim"] == 8 and cfg["num_key_value_heads"] == 2
    assert cfg["norm_before_residual"] is False and "norm_before_residual" in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    assert set(load_file(str(tmp_path / "model.safetensors"))) == EXPECTED


def test_exported_draft_loads_back_identically(tmp_path):
    """export -> load_draft (the eval's path) reproduces the module, embedding from the target's files."""
    from safetensors.torch import save_file

    from eyas_train.export import load_draft

    draft = tiny(seed=3).float()
    target = tmp_path / "target"
    target.mkdir()
    save_file({"model.embed_tokens.weight": draft.embed.weight.detach().clone()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"vocab_size": V, "dtype": "float32"}))
    write_draft(tmp_path / "d", draft.state_dict(), draft.cfg, [2, 4, 5], {"dtype": "float32"})
    back, aux_ids = load_draft(tmp_path / "d", target)
    assert aux_ids == [2, 4, 5] and back.cfg == draft.cfg
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(1, V, (9,), generator=g), torch.randn(8, 48, generator=g)
    assert Eagle3.propose(back, ids, aux, 3) == Eagle3.propose(draft, ids, aux, 3)
