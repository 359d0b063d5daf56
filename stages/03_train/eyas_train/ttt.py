"""Training-time test (TTT): the draft unrolled over its own outputs, its attention mask and its loss.

Notation. A sample is target tokens x_0..x_{T-1}; the stored row t holds the target's states computed
AT position t: aux_t (the 3 aux layers) and its distribution P_t = p(. | x_0..x_t) over x_{t+1}.

What vLLM runs (v1/spec_decode/llm_base_proposer.py): after the target has verified up to token
x_{t+1}, the first draft pass puts at every position t the input token x_{t+1} (`input_ids` shifted left
by one) with fc(aux_t), and the output at position t proposes x_{t+2}. Each further draft step k feeds
the proposed token at position t+k with the previous step's pre-norm output as its hidden state; its
query sees the first pass's keys at positions <= t (the KV cache) and the keys this chain wrote at
t+1..t+k. So, with the rows of every step indexed by the root t:

    step k, row t:  input token   x_{t+1+k}          (teacher forcing: the token the target produced)
                    hidden        fc(aux_t) if k == 0, else out_{k-1}[t]
                    position      t + k              (RoPE, as vLLM advances positions)
                    predicts      x_{t+2+k}; teacher P_{t+1+k} restricted to the draft vocabulary
                    counts when   loss_mask[t+2+k] == 1 (the predicted token is a completion token)
                    keys seen     step-0 keys at rows t' <= t, and step-j keys (1 <= j <= k) at row t only

Rows whose shifted index runs past the sample end have mask 0. Padding sits after a sample's last row,
so the causal step-0 block never shows it to a real row and no extra padding mask is needed.

Loss: sum over steps k of 0.8**k * (sum over counted rows of H(P_{t+1+k}|draft, q_k[t])) / (number of
counted rows at step k in the global batch), H(p, q) = -sum_v p_v log q_v over the draft vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eyas_train.model import Eagle3Draft, upcast

try:  # optional, CUDA only: the causal first-pass block through flash-attn (it returns the log-sum-exp)
    from flash_attn import flash_attn_func as _flash
except ImportError:
    _flash = None


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries [B, H, Tq, D] over step-0 keys [B, Hkv, T0, D], query r being row T0-Tq+r and
    seeing rows <= its own. Returns the output and the log-sum-exp of its scores (fp32, [B, H, Tq])."""
    if q.is_cuda and _flash is not None:
        # flash-attn aligns the causal mask to the bottom right, the same convention when Tq < T0.
        out, lse, _ = _flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                             return_attn_probs=True)
        return out.transpose(1, 2), lse.float()
    tq, t0 = q.shape[2], k.shape[2]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = upcast(q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    rows = torch.arange(t0 - tq, t0, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(t0, device=q.device)[None, :] > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse[..., None]).to(v.dtype)) @ v
    return out, lse


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step i = len(keys) - 1 of a chain: queries see keys[0] causally and keys[j] (j >= 1) on their own row.

    The diagonal keys are merged into the causal block by log-sum-exp, so the step-0 block can be any
    causal kernel: softmax over the union = exp(lse0 - lse) * out0 + sum_j exp(s_j - lse) * v_j.
    """
    heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
    out0, lse0 = _causal_block(q, keys[0], values[0])
    if len(keys) == 1:
        return out0
    diag_k = [_expand_kv(k, heads) for k in keys[1:]]
    diag_v = [_expand_kv(v, heads) for v in values[1:]]
    s = torch.stack([upcast((q * k).sum(-1)) * scale for k in diag_k], dim=-1)   # [B, H, Tq, i]
    lse = torch.logaddexp(lse0, torch.logsumexp(s, dim=-1))
    out = torch.exp(lse0 - lse)[..., None] * upcast(out0)
    w = torch.exp(s - lse[..., None])
    for j, v in enumerate(diag_v):
        out = out + w[..., j, None] * upcast(v)
    return out.to(q.dtype)


class ChainAttention:
    """The key/value store of one unrolled chain; called once per step by the draft's attention."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at row t, zero past the end (dim 1 is time)."""
    if n == 0:
        return x
    pad = torch.zeros((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def step_counts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Rows counted at each step k (loss_mask[t+2+k] == 1), [steps], for the loss denominators."""
    return torch.stack([shift(loss_mask, 2 + k).sum() for k in range(steps)]).float()


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """H(p, softmax(logits)) per row = sum(p) * logsumexp(logits) - <p, logits>; a row with no teacher
    mass (top-K entirely outside the draft vocabulary) contributes 0."""
    return p.sum(-1) * torch.logsumexp(logits, dim=-1) - (upcast(p) * logits).sum(-1)


class UnrolledLoss(nn.Module):
    """The draft unrolled `steps` times over a padded batch; what DDP/FSDP wrap (one forward per step)."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float = 0.8):
        super().__init__()
        self.draft, self.steps, self.decay = draft, steps, decay

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, target_p: torch.Tensor, target_top: torch.Tensor,
                loss_mask: torch.Tensor, denom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, target_top, loss_mask [B, T]; aux [B, T, 3H]; target_p [B, T, Vd] (P_t restricted and
        renormalised); denom [steps] counted rows per step over the global batch.
        Returns the weighted loss and per-step (loss sum, top-1 hits, counted rows) [steps, 3], detached."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        hidden = self.draft.fuse(aux)
        attend = ChainAttention()
        mask_f = loss_mask.to(aux.dtype if aux.dtype == torch.float64 else torch.float32)
        loss = mask_f.new_zeros(())
        stats = []
        for k in range(self.steps):
            out = self.draft.step(shift(input_ids, 1 + k), hidden, positions + k, attend)
            # Rows t < n have a teacher row t+1+k; the last 1+k rows of this step have none (mask 0), so the
            # teachers are views target_p[:, 1+k:], never shifted copies of the [B, T, Vd] tensor.
            n = t - 1 - k
            logits = upcast(self.draft.logits(out[:, :n]))
            m = shift(mask_f, 2 + k)[:, :n]
            ce = soft_cross_entropy(logits, target_p[:, 1 + k:])
            ce_sum = (ce * m).sum()
            loss = loss + self.decay**k * ce_sum / denom[k].clamp(min=1)
            hits = (self.draft.to_target_ids(logits.argmax(-1)) == target_top[:, 1 + k:]).to(m.dtype)
            stats.append(torch.stack([ce_sum.detach(), (hits * m).sum(), m.sum()]))
            hidden = out
        return loss, torch.stack(stats)
