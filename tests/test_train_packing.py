"""Stage 03 packed batches and the chunked draft-vocabulary loss: a packed batch gives the loss, gradients,
stats and leads of its samples run one by one; the chunked loss equals the plain one and keeps no
[tokens, draft vocabulary] tensor for the backward pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from helpers import VD, tiny
from eyas_train import ttt
from eyas_train.data import collate, per_sample, row_plan
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.ttt import UnrolledLoss, draft_vocab_loss, step_counts
from eyas_train.vocab import build_vocab

KERNELS = ttt.ttt_attention  # unpatched: the test below picks its kernel through it
LENGTHS = (9, 6, 1, 4, 7, 2, 3)  # packs 7 samples into 4 rows of 9; one sample too short to count anything


def samples(lengths=LENGTHS, seed: int = 0, dtype=torch.float32) -> list[dict[str, torch.Tensor]]:
    """One dict per sample, as the shards give them, plus the teacher fields the loss takes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3:] = 1
        out.append({"input_ids": torch.randint(1, 40, (n,), generator=g), "loss_mask": mask,
                    "aux": torch.randn(n, 48, generator=g, dtype=dtype),
                    "p": torch.softmax(3 * torch.randn(n, VD, generator=g, dtype=dtype), -1),
                    "top": torch.randint(0, 40, (n,), generator=g)})
    return out


def run(draft: Eagle3Draft, batch: dict[str, torch.Tensor], steps: int, denom: torch.Tensor, **kw):
    leads: list[torch.Tensor] = []
    loss, stats = UnrolledLoss(draft, steps, chunk_rows=kw.pop("chunk_rows", None))(
        batch["input_ids"], batch["aux"], batch["p"], batch["top"], batch["loss_mask"], denom, leads=leads, **kw)
    grads = torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad])
    return loss.detach(), stats, leads[0], grads


@pytest.mark.parametrize("fused", [False, True])  # the CPU kernel (merged) and the GPU one (SDPA, masked union)
@pytest.mark.parametrize("packed", [True, False])
def test_a_batch_gives_what_its_samples_give_one_by_one(monkeypatch, fused, packed):
    """fp32, CPU: loss, every gradient, per-step stats and every sample's leads of a packed (or padded) batch
    equal the sums over its samples run alone, each in a row of its own length, with the same global
    denominators (the rows counted per step over the whole batch)."""
    monkeypatch.setattr(ttt, "ttt_attention", lambda *a, **kw: KERNELS(*a, fused=fused, **kw))
    steps, draft = 4, tiny().float()
    rows = samples()
    batch = collate(rows, packed)
    assert batch["input_ids"].shape == ((4, 9) if packed else (7, 9))
    denom = step_counts(batch["loss_mask"], steps, batch["segment"])
    alone = [collate([r]) for r in rows]
    assert torch.equal(denom, sum(step_counts(a["loss_mask"], steps) for a in alone))
    loss, stats, lead, grads = run(draft, batch, steps, denom, positions=batch["positions"],
                                   segment=batch["segment"], chunk_rows=5)
    ref = [run(draft, a, steps, denom) for a in alone]
    assert torch.allclose(loss, sum(r[0] for r in ref), rtol=1e-5)
    assert torch.allclose(stats, sum(r[1] for r in ref), rtol=1e-5)
    assert [x.tolist() for x in per_sample(lead, batch["spans"])] == [r[2][0].tolist() for r in ref]
    for got, *want in zip(grads, *(r[3] for r in ref)):
        want = sum(want)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), got.shape


def test_rows_are_packed_first_fit_decreasing_and_cut_back():
    assert row_plan([5, 3, 3, 2, 1], packed=True) == [[0], [1, 3], [2, 4]]
    assert row_plan([5, 3, 3, 2, 1], packed=False) == [[0], [1], [2], [3], [4]]
    rows = [{"input_ids": torch.arange(n) + 10 * i, "x": torch.ones(n, 2)} for i, n in enumerate([5, 3, 3, 2, 1])]
    b = collate(rows, packed=True)
    assert b["input_ids"].tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 30, 31], [20, 21, 22, 40, 0]]
    assert b["segment"].tolist() == [[1] * 5, [2, 2, 2, 4, 4], [3, 3, 3, 5, 0]]
    assert b["positions"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    assert b["spans"].tolist() == [[0, 0, 5], [1, 0, 3], [2, 0, 3], [1, 3, 2], [2, 3, 1]]
    assert b["length"].tolist() == [5, 3, 3, 2, 1] and b["x"][2, 4].abs().sum() == 0
    assert [x.tolist() for x in per_sample(b["input_ids"], b["spans"])] == [r["input_ids"].tolist() for r in rows]


def test_chunked_loss_equals_the_plain_one():
    """Loss, per-row cross-entropy, argmax and both gradients, for every chunking (one row at a time to all
    rows at once), against autograd through the full logits; a row without teacher mass counts 0."""
    g = torch.Generator().manual_seed(0)
    n, h, vd = 11, 16, 37
    x = torch.randn(n, h, generator=g, dtype=torch.double, requires_grad=True)
    w = torch.randn(vd, h, generator=g, dtype=torch.double, requires_grad=True)
    p = torch.softmax(torch.randn(20, vd, generator=g, dtype=torch.double), -1) * (torch.rand(20, 1, generator=g) + 0.5)
    p[4] = 0
    teacher = torch.randint(0, 20, (n,), generator=g)
    teacher[2] = 4
    weight = torch.rand(n, generator=g, dtype=torch.double)
    z = F.linear(x, w)
    ce = p[teacher].sum(-1) * z.logsumexp(-1) - (p[teacher] * z).sum(-1)
    want = (weight * ce).sum()
    want_grads = torch.autograd.grad(want, [x, w])
    for chunk in (1, 3, n, None):
        loss, got_ce, best = draft_vocab_loss(x, w, p, teacher, weight, chunk)
        assert torch.allclose(loss, want, rtol=1e-12) and torch.allclose(got_ce, ce, rtol=1e-12)
        assert torch.equal(best, z.argmax(-1)) and got_ce[2] == 0
        for got, ref in zip(torch.autograd.grad(3 * loss, [x, w]), want_grads):
            assert torch.allclose(got, 3 * ref, rtol=1e-10, atol=1e-12), chunk
    with torch.no_grad():
        assert torch.allclose(draft_vocab_loss(x, w, p, teacher, weight, 4)[0], want, rtol=1e-12)
    # bf16 autocast (as on a GPU): bf16 products, fp32 softmax and dL/dW sum; within bf16 rounding of the above
    xb, wf = x.detach().bfloat16().requires_grad_(), w.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = draft_vocab_loss(xb, wf, p.float(), teacher, weight.float(), 3)
    gx, gw = torch.autograd.grad(loss, [xb, wf])
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    assert torch.allclose(loss.double(), want, rtol=2e-2)
    for got, ref in zip((gx, gw), want_grads):
        assert (got.double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_sampled_head_is_exact_on_all_columns_and_close_on_few():
    """The sampled head (--head-negatives): with every column among the teacher's, the exact loss and gradients;
    with a peaked teacher (its tail under 1%) over 2,000 columns and 256 drawn, dL/dh points where the exact one does, the loss
    (averaged over draws) is near the exact one, and no weight row outside the drawn columns moves."""
    from eyas_train.ttt import _sampled_loss_chunks, _vocab_loss_chunks

    g = torch.Generator().manual_seed(0)
    n, h, vd = 64, 16, 37
    x, w = torch.randn(n, h, generator=g, dtype=torch.double), torch.randn(vd, h, generator=g, dtype=torch.double)
    p = torch.softmax(3 * torch.randn(n, vd, generator=g, dtype=torch.double), -1)
    rows, weight = torch.arange(n), torch.rand(n, generator=g, dtype=torch.double)
    exact = _vocab_loss_chunks(x, w, p, rows, weight, 16, True)
    every = _sampled_loss_chunks(x, w, p, rows, weight, 16, negatives=5, top=vd)
    for got, want in zip(every, exact):
        assert torch.allclose(got.double(), want.double(), rtol=1e-10, atol=1e-12)
    vd = 2000
    w = torch.randn(vd, h, generator=g, dtype=torch.double) / 2
    logits = torch.randn(n, vd, generator=g, dtype=torch.double)
    logits.scatter_add_(1, torch.randint(0, 50, (n, 3), generator=g), torch.full((n, 3), 12.0, dtype=torch.double))
    p = torch.softmax(logits, -1)
    ce, _, gh, _ = _vocab_loss_chunks(x, w, p, rows, weight, 16, True)
    torch.manual_seed(0)
    draws = [_sampled_loss_chunks(x, w, p, rows, weight, 16, negatives=256) for _ in range(20)]
    mean_ce = torch.stack([d[0] for d in draws]).mean(0)
    assert ((mean_ce - ce).abs() / ce.abs()).mean() < 0.1
    cos = F.cosine_similarity(torch.stack([d[2] for d in draws]).mean(0).flatten(), gh.flatten(), dim=0)
    assert cos > 0.95, cos
    moved = (draws[0][3] != 0).any(-1).sum()
    assert 256 <= moved <= 4 * (256 + 16 * 8), moved  # 4 chunks of 16 rows: their top 8 each and 256 drawn


def test_no_draft_vocabulary_tensor_is_kept_for_backward():
    """What autograd saves for the backward pass of a whole TTT step: nothing as wide as the draft
    vocabulary but dL/dW itself ([Vd, H]), whatever the tokens; the plain loss kept [rows, Vd] per step."""
    vd = 64  # no other dimension of the draft is 64 wide
    cfg = DraftConfig(vocab_size=100, draft_vocab_size=vd, hidden_size=16, target_hidden_size=16, num_aux=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                      rms_norm_eps=1e-6, max_position_embeddings=64)
    draft = Eagle3Draft(cfg)
    draft.init_weights(0)
    draft.d2t.copy_(build_vocab(torch.arange(100).flip(0), vd).d2t)
    batch = collate(samples((9, 8, 7)), packed=True)
    p = torch.softmax(torch.randn(*batch["input_ids"].shape, vd), -1)
    saved: list[tuple[int, ...]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss, _ = UnrolledLoss(draft, 3, chunk_rows=2)(batch["input_ids"], batch["aux"], p, batch["top"],
                                                        batch["loss_mask"], torch.ones(3),
                                                        positions=batch["positions"], segment=batch["segment"])
    loss.backward()
    assert [s for s in saved if vd in s] == [(vd, 16)]


def test_batching_is_an_option_recorded_in_the_config():
    from eyas_common.contract import changed_params
    from eyas_train.cli import main
    from eyas_train.config import MAY_CHANGE, TrainConfig

    cfg = TrainConfig(hidden="h", model="m", name="n")
    assert cfg.batching == "packed" and cfg.to_dict()["batching"] == "packed"
    # resumable: same samples, same loss
    assert not changed_params({**cfg.to_dict(), "batching": "padded"}, cfg.to_dict(), may_change=MAY_CHANGE)
    out = CliRunner().invoke(main, ["run", "--help"]).output
    assert "--batching [packed|padded]" in out
