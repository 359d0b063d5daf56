"""DFlash: a block-diffusion draft (arXiv 2602.06036), its attention and its training loss.

Notation. A sample is target tokens x_0..x_{T-1}; stored row t holds the target's states AT position t:
aux_t, the n feature layers concatenated ([n H]). B is the block size, K = B - 1 the draft tokens a block
proposes, M the mask token id, W_e / W_o the target's embedding and lm_head (frozen, shared: the servers
use the target's own).

What vLLM runs (v1/spec_decode/dflash.py, models/qwen3_dflash.py), once the target has verified up to
position p - 1 and produced x_p (the bonus token):

    context    c_t = hidden_norm(fc(aux_t))                       for t < p (each stored once, in the KV cache)
               layer l's context keys / values:  K_t = rope_t(k_norm(Wk_l c_t)),  V_t = Wv_l c_t
    block      tokens [x_p, M, ..., M] at positions p .. p + K;  r^0 = W_e[token]
               (W_e[M] = 0 would make every masked slot's query 0 and all slots alike: usable_mask_rows)
    layer l    a = input_layernorm(r);  q, k, v = rope(q_norm(Wq a)), rope(k_norm(Wk a)), Wv a
               r = r + Wo attn(q; keys = [context keys t < p ; the block's own B keys])   (bidirectional)
               r = r + mlp(post_attention_layernorm(r))
    output     slot j (1..K) proposes argmax W_o norm(r_j) as x_{p+j}: the token at its own position.

Training (the paper's recipe). Per sample, anchors p are drawn among completion tokens (loss_mask[p] = 1,
with a completion token after it); every anchor's block is built as above, all blocks of the sample in one
pass, each seeing the context rows t < p of its sample and its own block, never another block. Slot j of
the block at anchor p learns x_{p+j} where p + j < T and loss_mask[p+j] = 1 (counted), with weight

    w_j = exp(-(j - 1) / gamma)        (early slots matter most: a rejection ends the block)

    L = sum over counted slots (a, j) of w_j * CE(W_o norm(r_{a,j}), x_{p_a + j})  /  denom,
    denom = sum of w_j over the global batch's counted slots.

The context is not run through the draft's layers, so the only quadratic term is block x context:
scores are [anchors * B, T] for the context part and [anchors, B, B] for the block part, joined in one
softmax (`block_attention`). A block at anchor p sees exactly what vLLM's draft sees at that step, so the
per-anchor lead (how many leading slots are right) is the number of tokens vLLM accepts there, and the
validation replay (recipe.replay_acceptance) predicts the acceptance length without approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eyas_train.model import MLP, Eagle3Draft, LayerShape, RMSNorm, Rotary, apply_rope, upcast

# Rows of [rows, vocabulary] logits computed at once in the loss (each chunk recomputed in the backward pass).
CE_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class DFlashConfig(LayerShape):
    """Shape of a DFlash draft; every field is written to the exported config.json (dflash_export.py)."""

    vocab_size: int                 # the target's vocabulary (inputs and outputs are target ids)
    hidden_size: int                # the target's width: the embedding and lm_head are the target's
    target_hidden_size: int         # width of each feature layer
    num_features: int               # target layers concatenated into fc's input
    num_hidden_layers: int          # draft decoder layers
    block_size: int                 # B: the anchor token and B - 1 masked slots
    mask_token_id: int
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})


def default_block_size(hidden_size: int) -> int:
    """The paper's 16 for full-size targets (hidden >= 2048); 8 below, where a draft layer is as costly
    as a target layer and a long block of a weak draft mostly gets rejected."""
    return 16 if hidden_size >= 2048 else 8


def default_draft_layers(num_target_layers: int) -> int:
    """One draft layer per eight target layers (rounded up), between 3 and 5 (the paper's drafts: 5 for
    36-layer targets). Never fewer than 3: on the 8-layer fixture (200 answers, 860 steps) the replayed
    acceptance at 7 draft tokens went 3.70, 3.95, 4.57, 4.63, 4.66 for 1 to 5 layers, and per unit of cost
    (acceptance / (1 + draft layers / target layers), a pass being about as dear as its layers) 3 is the
    best (3.32 against 3.29, 3.16, 3.09, 2.87). One layer has a single attention to fetch the anchor token
    and the context rows and mix them (stages/03_train/README.md, DFlash)."""
    return max(3, min(5, math.ceil(num_target_layers / 8)))


def default_gamma(block_size: int) -> float:
    """The paper's decay constants: 7 for blocks of 16, 5 for 10, 4 for 8 (and below)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_j = exp(-(j - 1) / gamma) for slots j = 1 .. B - 1, [B - 1]."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float) / gamma)


# ------------------------------------------------------------------------------------------------
# attention


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def context_visible(anchors: torch.Tensor, length: int, segment: torch.Tensor | None = None) -> torch.Tensor:
    """Which context rows each block's queries see: row t < p of its anchor p, and in packed rows (segment
    [R, T]: 1 + the sample's index, data.collate) only rows of the anchor's own sample. [R, A] -> [R, A, T]."""
    visible = torch.arange(length, device=anchors.device)[None, None, :] < anchors[..., None]
    if segment is None:
        return visible
    return visible & (segment[:, None, :] == segment.gather(1, anchors)[..., None])


def block_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor,
                    blk_v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Queries q [R, H, A, B, D] see the context keys ctx_k/ctx_v [R, Hkv, T, D] where visible [R, A, T], and
    the keys of their own block blk_k/blk_v [R, Hkv, A, B, D], all of them (bidirectional); one softmax over
    both. Returns [R, H, A, B, D]."""
    r, heads, a, b, d = q.shape
    q = q * (1.0 / math.sqrt(d))
    k0, v0 = _expand_kv(ctx_k, heads), _expand_kv(ctx_v, heads)
    kb, vb = _expand_kv(blk_k, heads), _expand_kv(blk_v, heads)
    s_ctx = upcast(q.reshape(r, heads, a * b, d) @ k0.transpose(-1, -2)).view(r, heads, a, b, -1)
    s_ctx = s_ctx.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    s_blk = upcast(q @ kb.transpose(-1, -2))                                    # [R, H, A, B, B]
    p_ctx, p_blk = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).split([k0.shape[2], b], dim=-1)
    out = (p_ctx.reshape(r, heads, a * b, -1).to(v0.dtype) @ v0).view(r, heads, a, b, d)
    return (upcast(out) + upcast(p_blk.to(vb.dtype) @ vb)).to(q.dtype)


class BlockAttention(nn.Module):
    """Qwen3-style attention (per-head q_norm / k_norm) whose keys are the context's and the block's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.wq = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[..., n * D] -> [..., n, D]."""
        return x.view(*x.shape[:-1], n, self.head_dim)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the fused context ctx [R, T, H] at its positions (cos/sin [R, 1, T, D]):
        [R, Hkv, T, D] each."""
        k = self.k_norm(self._heads(self.wk(ctx), self.kv_heads)).transpose(1, 2)
        v = self._heads(self.wv(ctx), self.kv_heads).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor) -> torch.Tensor:
        """x [R, A, B, H] (the blocks' normed states), cos/sin [R, 1, A*B, D] -> [R, A, B, H]."""
        r, a, b, _ = x.shape

        def split(t: torch.Tensor, n: int) -> torch.Tensor:  # [R, A, B, n D] -> [R, n, A, B, D], roped
            t = self._heads(t, n).permute(0, 3, 1, 2, 4)
            return apply_rope(t.reshape(r, n, a * b, self.head_dim), cos, sin).view(r, n, a, b, self.head_dim)

        q = split(self.q_norm(self._heads(self.wq(x), self.heads)).flatten(-2), self.heads)
        k = split(self.k_norm(self._heads(self.wk(x), self.kv_heads)).flatten(-2), self.kv_heads)
        v = self._heads(self.wv(x), self.kv_heads).permute(0, 3, 1, 2, 4)
        out = block_attention(q, ctx_kv[0], ctx_kv[1], k, v, visible)
        return self.wo(out.permute(0, 2, 3, 1, 4).reshape(r, a, b, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = BlockAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, r: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: torch.Tensor,
                ctx_rope: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor) -> torch.Tensor:
        kv = self.attn.context_kv(ctx, *ctx_rope)
        r = r + self.attn(self.input_norm(r), cos, sin, kv, visible)
        return r + self.mlp(self.mlp_norm(r))


def frozen(module: nn.Module) -> nn.Module:
    """`module` with its parameters out of training (the target's own tensors)."""
    module.requires_grad_(False)
    return module


class DFlashDraft(nn.Module):
    """The draft. `embed` and `lm_head` are the target's, frozen (never exported)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = frozen(nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.lm_head = frozen(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.fc = nn.Linear(cfg.num_features * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def block_tokens(self, input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
        """[x_p, M, ..., M] (block_size long) for every anchor p: input_ids [R, T], anchors [R, A] -> [R, A, B]."""
        first = input_ids.gather(1, anchors)
        rest = torch.full((*anchors.shape, block_size - 1), self.cfg.mask_token_id,
                          dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([first[..., None], rest], dim=-1)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
                positions: torch.Tensor | None = None, segment: torch.Tensor | None = None,
                block_size: int | None = None) -> torch.Tensor:
        """The blocks' final states norm(r) [R, A, B, H] for input_ids [R, T], aux [R, T, n H] and anchors
        [R, A]; a block sees the context rows before its anchor (of its own sample, with `segment` [R, T] of
        packed rows, whose `positions` [R, T] restart at every sample). `block_size` (default: the trained
        one) is K + 1 when a server drafts K tokens: vLLM runs exactly K + 1 queries."""
        r_, a, b = *anchors.shape, block_size or self.cfg.block_size
        length = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(length, device=aux.device).expand(r_, length)
        ctx = self.hidden_norm(self.fc(aux))
        ctx_rope = self.rotary(positions)
        block_pos = positions.gather(1, anchors)[..., None] + torch.arange(b, device=anchors.device)
        cos, sin = self.rotary(block_pos.view(r_, a * b))
        r = self.embed(self.block_tokens(input_ids, anchors, b)).to(ctx.dtype)
        visible = context_visible(anchors, length, segment)
        for layer in self.layers:
            r = layer(r, cos, sin, ctx, ctx_rope, visible)
        return self.norm(r)

    # Deterministic init of the trained parameters, as EAGLE-3's (norms at 1, the rest N(0, 0.02)).
    init_weights = Eagle3Draft.init_weights


# ------------------------------------------------------------------------------------------------
# anchors, labels and the loss


def valid_anchors(loss_mask: torch.Tensor, segment: torch.Tensor | None = None) -> torch.Tensor:
    """Positions p of one row that can anchor a block: a completion token followed by one of the same sample,
    [n] long."""
    m = loss_mask.bool()
    ok = m[:-1] & m[1:]
    if segment is not None:
        ok &= segment[:-1] == segment[1:]
    return ok.nonzero().squeeze(1)


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None,
                   segment: torch.Tensor | None = None) -> torch.Tensor:
    """Up to `max_anchors` valid anchors per sample of one row, drawn without replacement, ascending."""
    valid = valid_anchors(loss_mask, segment)
    owner = torch.zeros_like(valid) if segment is None else segment[valid]
    kept = []
    for s in owner.unique():
        mine = valid[owner == s]
        if mine.numel() > max_anchors:
            mine = mine[torch.randperm(mine.numel(), generator=generator)[:max_anchors]]
        kept.append(mine)
    return torch.cat(kept).sort().values if kept else valid


def pad_anchors(per_row: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' anchor lists -> anchors [R, A] (padding: position 0) and which are real [R, A] bool."""
    width = max(1, max(x.numel() for x in per_row))
    anchors = torch.zeros(len(per_row), width, dtype=torch.long)
    real = torch.zeros(len(per_row), width, dtype=torch.bool)
    for i, x in enumerate(per_row):
        anchors[i, :x.numel()], real[i, :x.numel()] = x, True
    return anchors, real


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, real: torch.Tensor,
                 block_size: int, segment: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot j of the block at anchor p learns x_{p+j}: labels [R, A, B-1] and counted [R, A, B-1] (inside the
    row and the anchor's sample, a completion token, a real anchor)."""
    length = input_ids.shape[1]
    at = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    inside = at < length
    at = at.clamp(max=length - 1)
    rows = torch.arange(input_ids.shape[0], device=anchors.device)[:, None, None]
    counted = inside & loss_mask[rows, at].bool() & real[..., None]
    if segment is not None:
        counted &= segment[rows, at] == segment.gather(1, anchors)[..., None]
    return input_ids[rows, at], counted


def _chunk_ce(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = upcast(F.linear(h, weight))
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def vocab_ce(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             chunk_rows: int = CE_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy [N] and argmax [N] of rows h [N, H] through the full-vocabulary lm_head `weight`; the
    [rows, V] logits of one chunk at a time exist, recomputed in the backward pass (checkpointing)."""
    ces, best = [], []
    for lo in range(0, h.shape[0], chunk_rows):
        part = slice(lo, lo + chunk_rows)
        if torch.is_grad_enabled() and h.requires_grad:
            ce, top = checkpoint(_chunk_ce, h[part], weight, labels[part], use_reentrant=False)
        else:
            ce, top = _chunk_ce(h[part], weight, labels[part])
        ces.append(ce)
        best.append(top)
    if not ces:
        return h.new_zeros(0, dtype=torch.float), labels.new_zeros(0)
    return torch.cat(ces), torch.cat(best)


def slot_stats(ce: torch.Tensor, hits: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Per slot j: (CE sum, hits, counted) over the counted slots, [B-1, 3], detached."""
    c = counted.flatten(0, -2).to(ce.dtype)
    ce, hits = ce.detach().flatten(0, -2), hits.flatten(0, -2).to(ce.dtype)
    return torch.stack([(ce * c).sum(0), (hits * c).sum(0), c.sum(0)], dim=-1)


def leads(hits: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Per anchor, how many slots from slot 1 on are counted and right before the first that is not:
    the tokens a greedy verifier accepts from that block. [R, A, B-1] -> [R, A]."""
    return (hits & counted).long().cumprod(-1).sum(-1)


class BlockLoss(nn.Module):
    """The weighted block loss over a batch of rows (one sample per row); what DDP/FSDP wrap."""

    def __init__(self, draft: DFlashDraft, gamma: float, chunk_rows: int = CE_CHUNK_ROWS):
        super().__init__()
        self.draft, self.chunk_rows = draft, chunk_rows
        self.register_buffer("weights", slot_weights(draft.cfg.block_size, gamma), persistent=False)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                real: torch.Tensor, denom: torch.Tensor, positions: torch.Tensor | None = None,
                segment: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, loss_mask [R, T]; aux [R, T, n H]; anchors, real [R, A]; denom: the global batch's sum of
        w_j over counted slots; positions, segment [R, T] for packed rows (DFlashDraft.forward). Returns the
        loss, per-slot stats [B-1, 3] and per-anchor leads [R, A]."""
        b = self.draft.cfg.block_size
        labels, counted = block_labels(input_ids, loss_mask, anchors, real, b, segment)
        states = self.draft(input_ids, aux, anchors, positions, segment)[:, :, 1:]  # the masked slots
        flat = counted.flatten()
        ce_rows, best_rows = vocab_ce(states.flatten(0, 2)[flat], self.draft.lm_head.weight, labels.flatten()[flat],
                                      self.chunk_rows)
        ce = ce_rows.new_zeros(flat.shape).masked_scatter(flat, ce_rows).view(counted.shape)
        best = labels.new_zeros(flat.shape).masked_scatter(flat, best_rows).view(counted.shape)
        w = self.weights.to(ce.dtype).expand_as(ce)
        loss = (ce * w * counted).sum() / denom.to(ce.dtype).clamp(min=1e-9)
        hits = best == labels
        return loss, slot_stats(ce, hits, counted), leads(hits, counted)

    def denominator(self, loss_mask: torch.Tensor, anchors: torch.Tensor, real: torch.Tensor,
                    segment: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's sum of w_j over counted slots (the caller sums it over ranks). Only `counted` matters
        here, so the mask stands in for the token ids."""
        _, counted = block_labels(loss_mask, loss_mask, anchors, real, self.draft.cfg.block_size, segment)
        return (counted.float() * self.weights.to(counted.device)).sum()
