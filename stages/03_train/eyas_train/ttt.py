"""Training-time test (TTT): the draft unrolled over its own outputs, its attention mask and its loss.

Notation. A sample is target tokens x_0..x_{T-1}; the stored row t holds the target's states computed
AT position t: aux_t (the n_aux aux layers stage 02 stored, `params.layers`; three by default) and its
distribution P_t = p(. | x_0..x_t) over x_{t+1}.

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

Loss: sum over steps k of decay**k (--step-decay, 0.8 by default) * (sum over counted rows of H(P_{t+1+k}|draft, q_k[t])) / (number of
counted rows at step k in the global batch), H(p, q) = -sum_v p_v log q_v over the draft vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eyas_train.model import Eagle3Draft, upcast


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def ttt_mask(tq: int, t0: int, steps: int, device: torch.device | None = None) -> torch.Tensor:
    """Which keys a query may see, [Tq, T0 + (steps-1) Tq] bool, for keys laid out as [step-0 rows ;
    step-1 rows ; ...]: query r (row T0-Tq+r) sees step-0 rows <= its own, and row r of every later step."""
    rows = torch.arange(t0 - tq, t0, device=device)[:, None]
    causal = torch.arange(t0, device=device)[None, :] <= rows
    own = torch.eye(tq, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * (steps - 1), dim=1)


def _merged(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """O(T^2 + kT): the causal step-0 block, then the diagonal keys merged in by log-sum-exp,
    softmax over the union = exp(lse0 - lse) * out0 + sum_j exp(s_j - lse) * v_j."""
    heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
    tq, t0 = q.shape[2], keys[0].shape[2]
    k0, v0 = _expand_kv(keys[0], heads), _expand_kv(values[0], heads)
    scores = upcast(q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~ttt_mask(tq, t0, 1, q.device), float("-inf"))
    lse0 = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse0[..., None]).to(v0.dtype) @ v0
    if len(keys) == 1:
        return out
    s = torch.stack([upcast((q * _expand_kv(k, heads)).sum(-1)) * scale for k in keys[1:]], dim=-1)  # [B, H, Tq, i]
    lse = torch.logaddexp(lse0, torch.logsumexp(s, dim=-1))
    out = torch.exp(lse0 - lse)[..., None] * upcast(out)
    w = torch.exp(s - lse[..., None])
    for j, v in enumerate(values[1:]):
        out = out + w[..., j, None] * upcast(_expand_kv(v, heads))
    return out.to(q.dtype)


def _fused(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """One SDPA call over all steps' keys with the explicit TTT mask: the memory-efficient kernel on GPU
    never materialises the scores. flash-attn is not used: its backward drops the log-sum-exp gradient
    that merging the diagonal keys into a causal block would need."""
    mask = ttt_mask(q.shape[2], keys[0].shape[2], len(keys), q.device)
    return F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                          enable_gqa=q.shape[1] != keys[0].shape[1])


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  fused: bool | None = None) -> torch.Tensor:
    """Step i = len(keys) - 1 of a chain: queries [B, H, Tq, D] see keys[0] [B, Hkv, T0, D] causally (query r
    is row T0-Tq+r) and keys[j] (j >= 1, [B, Hkv, Tq, D]) on their own row only. `fused` (default: on
    GPU) picks the SDPA kernel over the masked union; otherwise the exact math of `_merged`."""
    return (_fused if (q.is_cuda if fused is None else fused) else _merged)(q, keys, values)


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
                loss_mask: torch.Tensor, denom: torch.Tensor, leads: list[torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, target_top, loss_mask [B, T]; aux [B, T, 3H]; target_p [B, T, Vd] (P_t restricted and
        renormalised); denom [steps] counted rows per step over the global batch.
        Returns the weighted loss and per-step (loss sum, top-1 hits, counted rows) [steps, 3], detached.
        `leads`, when given, receives lead [B, T]: at row t, how many steps 0, 1, ... in a row were counted
        and right, i.e. how many of the chain's proposals from root t a greedy verifier accepts."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        hidden = self.draft.fuse(aux)
        attend = ChainAttention()
        mask_f = loss_mask.to(aux.dtype if aux.dtype == torch.float64 else torch.float32)
        loss = mask_f.new_zeros(())
        stats = []
        chain = torch.ones((b, t), dtype=torch.bool, device=input_ids.device)  # steps 0..k all right at row t
        lead = torch.zeros((b, t), dtype=torch.long, device=input_ids.device)
        for k in range(self.steps):
            out = self.draft.step(shift(input_ids, 1 + k), hidden, positions + k, attend)
            # Rows t < n have a teacher row t+1+k; the last 1+k rows of this step have none (mask 0), so the
            # teachers are views target_p[:, 1+k:], never shifted copies of the [B, T, Vd] tensor.
            n = max(0, t - 1 - k)
            logits = upcast(self.draft.logits(out[:, :n]))
            m = shift(mask_f, 2 + k)[:, :n]
            ce = soft_cross_entropy(logits, target_p[:, 1 + k:])
            ce_sum = (ce * m).sum()
            loss = loss + self.decay**k * ce_sum / denom[k].clamp(min=1)
            hits = (self.draft.to_target_ids(logits.argmax(-1)) == target_top[:, 1 + k:]).to(m.dtype)
            stats.append(torch.stack([ce_sum.detach(), (hits * m).sum(), m.sum()]))
            if leads is not None:
                chain[:, :n] &= (hits * m).bool()
                chain[:, n:] = False
                lead += chain
            hidden = out
        if leads is not None:
            leads.append(lead)
        return loss, torch.stack(stats)
