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

Rows whose shifted index runs past the sample end have mask 0.

Packed rows (data.collate). A batch row holds one or more samples end to end, then padding. Every
slot carries seg(t), 1 + its sample's index in the batch (0 on padding), and pos(t), its position in its
own sample (0 at each sample's first slot). With t a slot of the row, the table above becomes

                    input token   x[t+1+k] if seg(t+1+k) == seg(t), else 0 (the pad id, as past a row's end)
                    position      pos(t) + k
                    counts when   loss_mask[t+2+k] == 1 and seg(t+2+k) == seg(t)
                    keys seen     step-0 keys at t' <= t with seg(t') == seg(t) (block-diagonal causal), and
                                  the chain's own keys at t (already confined to the sample)

so every slot of a sample computes what it computes with the sample alone in a row: the packed loss,
its gradients, the stats and the leads are the one-by-one ones summed (tests/test_train_packing.py).
(RoPE scores depend on position differences only, which an offset per sample keeps; restarting at 0
keeps the rotations, and their rounding, those of the sample alone and of vLLM.)
A padded batch is the same thing with one sample per row. A padding slot sees the padding slots before
it and itself, so no query has an empty softmax.

Loss: sum over steps k of decay**k (--step-decay, 0.8 by default) * (sum over counted rows of H(P_{t+1+k}|draft, q_k[t])) / (number of
counted rows at step k in the global batch), H(p, q) = -sum_v p_v log q_v over the draft vocabulary.

Only counted rows reach the lm_head, all steps at once (`draft_vocab_loss`). Over those N rows i (every
step's), with h_i = norm(out_k[t]), w_i = decay**k / denom_k, p_i = P_{t+1+k}, m_i = sum_v p_iv, W the
lm_head [Vd, H]:
    z_i = W h_i,   ce_i = m_i lse(z_i) - <p_i, z_i>,   L = sum_i w_i ce_i
    G_i := dL/dz_i = w_i (m_i softmax(z_i) - p_i),   dL/dh_i = W^T G_i,   dL/dW = sum_i G_i h_i^T
are all computed in the forward pass over chunks of rows, so at most one chunk's [rows, Vd] logits exist
at a time and none is kept for the backward pass, which only scales the stored dL/dh and dL/dW by the
incoming gradient (L is a scalar). The lm_head's FLOPs stay those of autograd (one product forward,
two backward), with no recomputation.

Sampled head (--head-negatives S > 0, training steps only). Per chunk of rows, the columns are T, the union of
each row's TEACHER_TOP most likely teacher tokens, and S columns drawn uniformly from the other R = Vd - |T|,
each standing for R / S of them: with z'_v = z_v, plus log(R / S) on a drawn column,
    ce_i ~ m_i lse(z'_i) - <p_i|T, z_i>,   G_i = w_i (m_i softmax(z'_i) - p_i|T) on those columns only,
the teacher's mass outside T dropped (m_i its mass on T). The products shrink from Vd to |T| + S columns
(dL/dW touches only them); the training log's loss and top-1 hits are those of the columns drawn. Validation,
the predicted acceptance and the manifest's stats always use the exact loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eyas_train.config import TEACHER_TOP
from eyas_train.model import Eagle3Draft, upcast

# Elements of one chunk's [rows, Vd] logits in the draft-vocabulary loss, by device: on a CPU 8 MiB (fp32), which
# stays in cache (on 2 cores, 4x the rows was 5% slower at Vd 8,192 and 3,000); on a GPU 128 MiB, rows enough
# to keep its kernels large. Never under LOSS_CHUNK_ROWS rows: dL/dW adds a [Vd, H] product over the chunk's
# rows, which is memory-bound with fewer (measured on a CPU at Vd 32,000: 64 rows a chunk took 1.6x the time
# of 256; 512 and 1,024 rows gained 3-4% more there).
LOSS_CHUNK_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 25}
LOSS_CHUNK_ROWS = 256


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def first_pass_mask(tq: int, t0: int, segment: torch.Tensor | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """Which step-0 keys each query sees: query r (row T0-Tq+r) sees rows <= its own, [Tq, T0] bool; with
    `segment` [B, T0] (packed rows), only those of its own sample as well, [B, 1, Tq, T0]."""
    rows = torch.arange(t0 - tq, t0, device=device)[:, None]
    causal = torch.arange(t0, device=device)[None, :] <= rows
    if segment is None:
        return causal
    return causal & (segment[:, None, -tq:, None] == segment[:, None, None, :])


def ttt_mask(first: torch.Tensor, steps: int) -> torch.Tensor:
    """Which keys a query may see, for keys laid out as [step-0 rows ; step-1 rows ; ...]: the step-0 keys
    that `first` (first_pass_mask) allows, and row r of every later step. [.., Tq, T0 + (steps-1) Tq] bool."""
    tq = first.shape[-2]
    own = torch.eye(tq, dtype=torch.bool, device=first.device).expand(*first.shape[:-1], tq)
    return torch.cat([first] + [own] * (steps - 1), dim=-1)


def _merged(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
            first: torch.Tensor) -> torch.Tensor:
    """O(T^2 + kT): the masked step-0 scores [Tq, T0] and the diagonal keys' scores s_j [Tq, i] side by side,
    one softmax over both (the union's), then out = P0 @ v0 + sum_j p_j v_j. One softmax, whose backward
    needs only its output, keeps the passes over [Tq, T0] few (they, not the products, bound a CPU)."""
    heads = q.shape[1]
    q = q * (1.0 / math.sqrt(q.shape[-1]))  # scaling the [Tq, D] queries, not the [Tq, T0] scores
    k0, v0 = _expand_kv(keys[0], heads), _expand_kv(values[0], heads)
    scores = upcast(q @ k0.transpose(-1, -2)).masked_fill(~first, float("-inf"))
    if len(keys) == 1:
        return (torch.softmax(scores, dim=-1).to(v0.dtype) @ v0).to(q.dtype)
    # The diagonal keys and values [B, H, Tq, i, D]: per-row dot products, elementwise (as tiny batched
    # matrix products they cost more than the [Tq, T0] block).
    kd = torch.stack([_expand_kv(k, heads) for k in keys[1:]], dim=-2)
    vd = torch.stack([_expand_kv(v, heads) for v in values[1:]], dim=-2)
    s = upcast((q.unsqueeze(-2) * kd).sum(-1))                           # s_j, [B, H, Tq, i]
    # One split, not a slice per key: each slice's backward would allocate a whole [Tq, T0 + i] gradient.
    p0, pd = torch.softmax(torch.cat([scores, s], dim=-1), dim=-1).split([k0.shape[2], len(keys) - 1], dim=-1)
    out = upcast(p0.to(v0.dtype) @ v0) + (pd.unsqueeze(-1) * upcast(vd)).sum(-2)
    return out.to(q.dtype)


def _fused(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], first: torch.Tensor) -> torch.Tensor:
    """One SDPA call over all steps' keys with the explicit TTT mask. On an H200 (torch 2.11) SDPA runs it in
    cuDNN's kernel, grouped KV heads and mask included, without materialising the scores: measured at 32/8
    heads, one packed row of 4,096 tokens and 7 steps, 22 ms forward + backward in 0.5 GiB, against 194 ms and
    57 GiB for the math kernel (the memory-efficient one refuses grouped heads). flash-attn is not used: its
    backward drops the log-sum-exp gradient that merging the diagonal keys into a causal block would need."""
    return F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                          attn_mask=ttt_mask(first, len(keys)),
                                          enable_gqa=q.shape[1] != keys[0].shape[1])


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  fused: bool | None = None, segment: torch.Tensor | None = None) -> torch.Tensor:
    """Step i = len(keys) - 1 of a chain: queries [B, H, Tq, D] see keys[0] [B, Hkv, T0, D] causally (query r
    is row T0-Tq+r), within their own sample when `segment` [B, T0] is given, and keys[j] (j >= 1,
    [B, Hkv, Tq, D]) on their own row only. `fused` (default: on GPU) picks the SDPA kernel over the masked
    union; otherwise the exact math of `_merged`."""
    first = first_pass_mask(q.shape[2], keys[0].shape[2], segment, q.device)
    return (_fused if (q.is_cuda if fused is None else fused) else _merged)(q, keys, values, first)


class ChainAttention:
    """The key/value store of one unrolled chain; called once per step by the draft's attention.
    `segment` [B, T] confines the step-0 keys to each packed sample."""

    def __init__(self, segment: torch.Tensor | None = None) -> None:
        self.segment = segment
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values, segment=self.segment)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at row t, zero past the end (dim 1 is time)."""
    if n == 0:
        return x
    pad = torch.zeros((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def ahead(x: torch.Tensor, n: int, segment: torch.Tensor | None = None) -> torch.Tensor:
    """x[:, t + n] at row t, zero past the row's end and, in packed rows, where t + n is another sample's."""
    y = shift(x, n)
    return y if segment is None else y.masked_fill(shift(segment, n) != segment, 0)


def step_counts(loss_mask: torch.Tensor, steps: int, segment: torch.Tensor | None = None) -> torch.Tensor:
    """Rows counted at each step k (loss_mask[t+2+k] == 1 within the sample), [steps], for the loss denominators."""
    return torch.stack([ahead(loss_mask, 2 + k, segment).sum() for k in range(steps)]).float()


def _shifted_ce(z: torch.Tensor, p: torch.Tensor, row_weight: torch.Tensor, scratch: torch.Tensor,
                want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row ce = m lse(z) - <p, z> (m = sum p) of logits z already shifted by their row max, and, when wanted,
    G = w (m softmax(z) - p) written over z (z is consumed either way; `scratch` is z's shape)."""
    m = p.sum(-1)
    dot = torch.mul(p, z, out=scratch).sum(-1)                 # <p, z - max z>
    e = z.exp_()                                               # exp(z - max z): cannot overflow
    total = e.sum(-1)
    ce = m * total.log() - dot                                 # = m lse(z) - <p, z>
    return ce, e.mul_((m / total)[:, None]).sub_(p).mul_(row_weight[:, None]) if want_grad else None


def _vocab_loss_chunks(h: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor, teacher_rows: torch.Tensor,
                       row_weight: torch.Tensor, chunk_rows: int, want_grad: bool):
    """The loop of _DraftVocabLoss.forward: (ce [N], best [N], dL/dh, dL/dW), the gradients None unless wanted.
    Products run in h's dtype (bf16 under autocast; the weight cast once, not per chunk), sums in fp32 (fp64
    stays). Every [rows, Vd] or [Vd, H] block is a buffer made once: on a CPU a fresh block that large is
    mapped anew and faulted in page by page, which cost more than the arithmetic (Vd 32,000 on 2 cores)."""
    n, real = h.shape[0], upcast(h).dtype
    rows, vocab = min(n, chunk_rows), weight.shape[0]
    w = weight.to(h.dtype)
    low = h.dtype != real                                      # bf16 products, fp32 sums
    p_buf = target_p.new_empty(rows, vocab)                    # the chunk's teacher rows
    z_buf, scratch = h.new_empty(rows, vocab, dtype=real), h.new_empty(rows, vocab, dtype=real)
    low_buf = h.new_empty(rows, vocab) if low else None        # bf16 logits, then bf16 G
    ce = row_weight.new_zeros(n)
    best = torch.zeros(n, dtype=torch.long, device=h.device)
    grad_h = torch.zeros_like(h, dtype=real) if want_grad else None
    # dL/dW summed transposed, [H, Vd]: the bf16 product comes out that way fastest, and an fp32 sum of a bf16
    # block needs a converted copy, kept in a buffer too.
    grad_wt = weight.new_zeros(weight.shape[1], vocab, dtype=upcast(weight).dtype) if want_grad else None
    product = w.new_empty(w.shape[1], vocab) if want_grad and low else None
    converted = torch.empty_like(grad_wt) if want_grad and low else None
    for lo in range(0, n, chunk_rows):
        part = slice(lo, lo + chunk_rows)
        hc = h[part]
        r = hc.shape[0]
        p = torch.index_select(target_p, 0, teacher_rows[part], out=p_buf[:r])
        if low:
            z = z_buf[:r].copy_(torch.mm(hc, w.t(), out=low_buf[:r]))
        else:
            z = torch.mm(hc, w.t(), out=z_buf[:r])             # the chunk's logits [rows, Vd]
        top, best[part] = z.max(-1)
        z.sub_(top[:, None])                                   # z - max z: exp cannot overflow
        ce[part], g = _shifted_ce(z, p, row_weight[part], scratch[:r], want_grad)
        if not want_grad:
            continue
        if low:
            g = low_buf[:r].copy_(g)
        grad_h[part] = g @ w                                   # W^T G
        if low:                                                # (sum_i G_i h_i^T)^T: a bf16 product, fp32 sum
            grad_wt += converted.copy_(torch.mm(hc.t().contiguous(), g, out=product))
        else:
            grad_wt.addmm_(hc.t(), g)                          # accumulated in the product (no temporary)
    return ce, best, grad_h, None if grad_wt is None else grad_wt.t().contiguous()


def _sampled_columns(p: torch.Tensor, negatives: int, top: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The chunk's columns (T first, then the drawn ones), their log weights, and |T| (the module doc)."""
    vocab = p.shape[1]
    kept = torch.zeros(vocab, dtype=torch.bool, device=p.device)
    kept[p.topk(min(top, vocab), dim=-1).indices.flatten()] = True
    teacher_cols, rest = kept.nonzero().squeeze(1), (~kept).nonzero().squeeze(1)
    drawn = rest[torch.randperm(rest.numel(), device=p.device)[:negatives]]
    log_w = torch.zeros(teacher_cols.numel() + drawn.numel(), dtype=p.dtype, device=p.device)
    if drawn.numel():
        log_w[teacher_cols.numel():] = math.log(rest.numel() / drawn.numel())
    return torch.cat([teacher_cols, drawn]), log_w, teacher_cols.numel()


def _sampled_loss_chunks(h: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor, teacher_rows: torch.Tensor,
                         row_weight: torch.Tensor, chunk_rows: int, negatives: int, top: int = TEACHER_TOP):
    """_vocab_loss_chunks' results, over the sampled head's columns (the module doc); always with gradients."""
    n, real = h.shape[0], upcast(h).dtype
    w = weight.to(h.dtype)
    ce = row_weight.new_zeros(n)
    best = torch.zeros(n, dtype=torch.long, device=h.device)
    grad_h = torch.zeros_like(h, dtype=real)
    grad_w = torch.zeros_like(weight, dtype=upcast(weight).dtype)
    for lo in range(0, n, chunk_rows):
        part = slice(lo, lo + chunk_rows)
        hc, p = h[part], target_p[teacher_rows[part]]
        cols, log_w, n_teacher = _sampled_columns(p, negatives, top)
        wc = w[cols]                                           # [C, H]
        z = torch.mm(hc, wc.t()).to(real)                      # the chunk's logits on its columns [rows, C]
        best[part] = cols[z[:, :n_teacher].argmax(-1)]
        z += log_w.to(real)
        z -= z.max(-1, keepdim=True).values
        pc = p[:, cols].to(real)
        pc[:, n_teacher:] = 0                                  # the teacher on T only
        ce[part], g = _shifted_ce(z, pc, row_weight[part], torch.empty_like(z), True)  # G on the columns
        gl = g.to(h.dtype)
        grad_h[part] = gl @ wc
        grad_w.index_add_(0, cols, (gl.t() @ hc).to(grad_w.dtype))
    return ce, best, grad_h, grad_w


class _DraftVocabLoss(torch.autograd.Function):
    """L = sum_i w_i ce_i over rows h [N, H] through lm_head `weight` [Vd, H], chunked (the math: module doc).
    Returns L, and per row ce [N] and the draft argmax [N] (no gradient)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor, teacher_rows: torch.Tensor,
                row_weight: torch.Tensor, chunk_rows: int, want_grad: bool, negatives: int):
        with torch.autocast(h.device.type, enabled=False):    # the dtypes are chosen in the loop
            if want_grad and negatives:
                ce, best, grad_h, grad_w = _sampled_loss_chunks(h, weight, target_p, teacher_rows, row_weight,
                                                                chunk_rows, negatives)
            else:
                ce, best, grad_h, grad_w = _vocab_loss_chunks(h, weight, target_p, teacher_rows, row_weight,
                                                              chunk_rows, want_grad)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.mark_non_differentiable(ce, best)
        return (ce * row_weight).sum(), ce, best

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _ce: torch.Tensor, _best: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is None:
            return (None,) * 8
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h.mul(grad_loss).to(h_dtype), grad_w.mul(grad_loss).to(w_dtype)) + (None,) * 6


def draft_vocab_loss(h: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor, teacher_rows: torch.Tensor,
                     row_weight: torch.Tensor, chunk_rows: int | None = None, negatives: int = 0,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_i row_weight[i] * H(target_p[teacher_rows[i]], softmax(weight @ h[i])) over the rows of h [N, H], with
    its gradients to h and weight, never holding more than `chunk_rows` rows of logits (default: about
    LOSS_CHUNK_ELEMENTS of them, at least LOSS_CHUNK_ROWS rows); with `negatives`, the sampled head's estimate
    when gradients are wanted (the module doc).
    Returns (loss, ce per row [N], draft argmax per row [N])."""
    budget = LOSS_CHUNK_ELEMENTS.get(h.device.type, LOSS_CHUNK_ELEMENTS["cpu"])
    chunk_rows = chunk_rows or max(LOSS_CHUNK_ROWS, budget // weight.shape[0])
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _DraftVocabLoss.apply(h, weight, target_p, teacher_rows, row_weight, chunk_rows, want_grad, negatives)


class UnrolledLoss(nn.Module):
    """The draft unrolled `steps` times over a batch of rows (packed or padded); what DDP/FSDP wrap
    (one forward per step). `chunk_rows`, `negatives`: see draft_vocab_loss."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float = 0.8, chunk_rows: int | None = None,
                 negatives: int = 0):
        super().__init__()
        self.draft, self.steps, self.decay, self.chunk_rows, self.negatives = draft, steps, decay, chunk_rows, negatives

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, target_p: torch.Tensor, target_top: torch.Tensor,
                loss_mask: torch.Tensor, denom: torch.Tensor, *, positions: torch.Tensor | None = None,
                segment: torch.Tensor | None = None, leads: list[torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, target_top, loss_mask [B, T]; aux [B, T, 3H]; target_p [B, T, Vd] (P_t restricted and
        renormalised); denom [steps] counted rows per step over the global batch; positions and segment
        [B, T] (pos and seg of the module doc; default: one sample per row, from position 0).
        Returns the weighted loss and per-step (loss sum, top-1 hits, counted rows) [steps, 3], detached.
        `leads`, when given, receives lead [B, T]: at row t, how many steps 0, 1, ... in a row were counted
        and right, i.e. how many of the chain's proposals from root t a greedy verifier accepts."""
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        hidden, attend = self.draft.fuse(aux), ChainAttention(segment)
        states, rows = [], []  # per step: the counted rows' pre-norm outputs, and those rows' flat indices
        for k in range(self.steps):
            hidden = self.draft.step(ahead(input_ids, 1 + k, segment), hidden, positions + k, attend)
            rows.append(ahead(loss_mask, 2 + k, segment).flatten().nonzero().squeeze(1))
            states.append(hidden.flatten(0, 1)[rows[-1]])
        real = aux.dtype if aux.dtype == torch.float64 else torch.float32
        sizes = [r.numel() for r in rows]
        # Row t of step k learns from teacher row t+1+k of the same sample (counted rows never run past it).
        teacher = torch.cat([r + 1 + k for k, r in enumerate(rows)])
        weight = torch.cat([(self.decay**k / denom[k].to(real).clamp(min=1)).expand(n) for k, n in enumerate(sizes)])
        loss, ce, best = draft_vocab_loss(self.draft.norm(torch.cat(states)), self.draft.lm_head.weight,
                                          target_p.flatten(0, 1), teacher, weight, self.chunk_rows, self.negatives)
        hits = self.draft.to_target_ids(best) == target_top.flatten()[teacher]
        stats = torch.stack([torch.stack([c.sum(), h.to(real).sum(), c.new_tensor(float(n), dtype=real)])
                             for c, h, n in zip(ce.to(real).split(sizes), hits.split(sizes), sizes)])
        if leads is not None:
            leads.append(self._lead(rows, hits.split(sizes), (b, t)))
        return loss, stats

    @staticmethod
    def _lead(rows: list[torch.Tensor], hits: tuple[torch.Tensor, ...], shape: tuple[int, int]) -> torch.Tensor:
        """Per row, how many steps from step 0 on were counted and right before the first that was not."""
        chain = torch.ones(shape[0] * shape[1], dtype=torch.bool, device=rows[0].device)
        lead = torch.zeros_like(chain, dtype=torch.long)
        for r, hit in zip(rows, hits):
            right = torch.zeros_like(chain)
            right[r] = hit
            lead += chain.logical_and_(right)
        return lead.view(shape)
