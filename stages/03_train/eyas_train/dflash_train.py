"""`eyas-train run --method dflash`: the DFlash draft trained by train.py's run (same data, recipe, loop,
checkpoints, validation schedule and manifest); this module supplies what differs from EAGLE-3: the draft's
shape and set-up, a step's forward (anchors drawn per sample, BlockLoss), the validation (per-slot accuracy
and the replayed acceptance length) and the export.

The knobs default from the target (dflash.py: block size, draft layers, gamma) and from the data (the mask
token: one the completions never use, whose embedding row is a real one); the resolved values are in the
manifest's params.draft.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from eyas_common.chat import load_tokenizer
from eyas_common.checkpoint import read_text_config
from eyas_common.contract import REMAKE, Dataset, DatasetError
from eyas_common.hidden import HiddenShards
from eyas_train import parallel
from eyas_train.data import per_sample, prefetch, rank_share, refuse_no_targets, token_counts
from eyas_train.dflash import (BlockLoss, DFlashConfig, DFlashDraft, default_block_size, default_draft_layers,
                               default_gamma, pad_anchors, sample_anchors, valid_anchors)
from eyas_train.dflash_export import write_dflash_draft
from eyas_train.recipe import predicted_acceptance, replay_acceptance, resolve, split_by_sample, val_count
from eyas_train.state import RunState, optimiser, resumed
from eyas_train.target import attention_shape, load_embedding, load_lm_head, load_weight
from eyas_train.vocab import VocabMap

MASK_NAMES = ("<|MASK|>", "<mask>", "[MASK]", "<|mask|>")
# A mask row whose RMS is under this fraction of a typical used token's is degenerate (see usable_mask_rows).
MIN_MASK_RMS_FRACTION = 0.25


def usable_mask_rows(embedding: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Which target embedding rows may embed the masked slots, [V] bool.

    The masked slots' only input is W_e[M]: the first layer sees a = input_layernorm(W_e[M]) and
    q = rope(q_norm(Wq a)). A zero row (a padding token's, as [PAD]'s usually is) gives a = 0, q = 0, a
    uniform softmax over every visible key, and the same output at every masked slot, whatever its
    position: all slots then propose one token (measured: slot accuracies all ~0.25, vLLM per position
    0.30, 0.02, 0.02 ...). A row far below the others is nearly as bad, because RMSNorm's eps then
    dominates mean(a^2). So a usable row has RMS >= MIN_MASK_RMS_FRACTION x the median RMS of the rows of
    the tokens the data uses."""
    rms = embedding.float().pow(2).mean(-1).sqrt()
    used = rms[: counts.numel()][counts > 0]
    typical = used.median() if used.numel() else rms.median()
    return rms >= MIN_MASK_RMS_FRACTION * typical


def pick_mask_token(tokenizer: Any, counts: torch.Tensor, requested: int | None,
                    embedding: torch.Tensor) -> tuple[int, str | None]:
    """The mask token: `requested`; else the tokenizer's mask token or a token named like one; else the first
    special token, then the last id, that no completion of the data uses (a block's anchor is always a
    completion token, so the mask must never look like one). Every candidate needs a usable embedding row
    (usable_mask_rows: [PAD] has none). Returns (id, its text)."""
    usable = usable_mask_rows(embedding, counts)
    if requested is not None:
        if not 0 <= requested < counts.numel():
            raise ValueError(f"--mask-token-id {requested} is outside the target vocabulary of {counts.numel()}: "
                             f"pass an id below {counts.numel()}, or leave it out to pick one")
        if not usable[requested]:
            raise ValueError(f"--mask-token-id {requested}: its embedding row is (nearly) zero, so every masked "
                             f"slot would propose the same token; pick a token with a trained embedding")
        return requested, tokenizer.convert_ids_to_tokens(requested)
    vocab = tokenizer.get_vocab()
    named = [getattr(tokenizer, "mask_token_id", None)] + [vocab.get(n) for n in MASK_NAMES]
    special = sorted(set(getattr(tokenizer, "all_special_ids", [])))
    unused = [i for i in special if i < counts.numel() and not counts[i]]
    for i in [n for n in named if n is not None] + unused:
        if usable[i]:
            return i, tokenizer.convert_ids_to_tokens(i)
    free = ((counts == 0) & usable[: counts.numel()]).nonzero()
    if not free.numel():
        raise ValueError("every token id with a usable embedding occurs in the completions: pass --mask-token-id")
    i = int(free[-1])
    return i, tokenizer.convert_ids_to_tokens(i)


def dflash_config(target: dict[str, Any], hidden_size: int, n_features: int, cfg: Any,
                  mask_token_id: int) -> DFlashConfig:
    """The draft's shape: layers like the target's own (width, heads, FFN, RoPE), the knobs from the target."""

    heads, head_dim, rope = attention_shape(target, hidden_size)
    return DFlashConfig(
        vocab_size=target["vocab_size"], hidden_size=hidden_size, target_hidden_size=hidden_size,
        num_features=n_features,
        num_hidden_layers=cfg.draft_layers or default_draft_layers(target["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=target.get("num_key_value_heads", heads), head_dim=head_dim,
        intermediate_size=target["intermediate_size"], rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        max_position_embeddings=target.get("max_position_embeddings", 4096),
        block_size=cfg.block_size or default_block_size(hidden_size), mask_token_id=mask_token_id,
        rope_parameters=rope)


def new_dflash_draft(dcfg: DFlashConfig, model: str | Path, seed: int) -> DFlashDraft:
    """A seeded draft with the target's embedding, lm_head and final norm (its output goes through the
    target's lm_head, so it starts from the norm that head was trained behind)."""
    torch.manual_seed(seed)
    draft = DFlashDraft(dcfg)
    draft.init_weights(seed)
    with torch.no_grad():
        draft.embed.weight.copy_(load_embedding(model))
        draft.lm_head.weight.copy_(load_lm_head(model))
        draft.norm.weight.copy_(load_weight(model, "model.norm.weight"))
    return draft


def setup_dflash(cfg: Any, d: parallel.Dist, hidden_ds: Dataset, hidden_m: dict[str, Any], out: Dataset,
                 ckpt: dict[str, Any] | None) -> Any:
    """train._setup for --method dflash: the RunState the shared loop runs (resumed from `ckpt`)."""

    params = hidden_m["params"]
    target = read_text_config(cfg.model)
    hidden_size, aux_layers = int(params["hidden_size"]), list(params["layers"])
    if min(aux_layers) < 1:
        raise DatasetError(f"{hidden_ds.ref}: layer id 0 (the embedding) cannot feed a DFlash draft; rerun "
                           f"{REMAKE['hidden']} with --method dflash")
    shards = HiddenShards(hidden_ds, hidden_m)
    lengths = [min(x.length, cfg.max_len) for x in shards.samples]
    if ckpt is None:  # checked when the run began
        refuse_no_targets(hidden_ds, shards, cfg.max_len)
    try:
        n_val = val_count(len(shards), cfg.val_samples, d.world)
        train_idx, val_idx = split_by_sample([x.sample_id for x in shards.samples], n_val, cfg.seed)
        recipe = resolve(cfg, lengths=[lengths[i] for i in train_idx], n_val=n_val, width=hidden_size, world=d.world)
    except ValueError as e:
        raise DatasetError(f"{hidden_ds.ref}: {e}") from None
    counts = token_counts(shards, target["vocab_size"])
    try:
        mask_id, mask_text = pick_mask_token(load_tokenizer(cfg.model, cfg.trust_remote_code), counts,
                                             cfg.mask_token_id, load_embedding(cfg.model))
    except ValueError as e:  # names --mask-token-id and the fix
        raise DatasetError(str(e)) from None
    dcfg = dflash_config(target, hidden_size, len(aux_layers), cfg, mask_id)
    gamma = cfg.gamma or default_gamma(dcfg.block_size)
    module = parallel.wrap(BlockLoss(new_dflash_draft(dcfg, cfg.model, cfg.seed), gamma).to(d.device), d, cfg.parallel)
    opt, sched = optimiser(cfg, module, recipe)
    vocab = VocabMap(torch.zeros(dcfg.vocab_size, dtype=torch.long), torch.ones(dcfg.vocab_size, dtype=torch.bool),
                     1.0, int((counts > 0).sum()))  # DFlash drafts over the target's whole vocabulary
    return resumed(RunState(cfg, d, out, shards, recipe, train_idx, val_idx, lengths, vocab, dcfg, aux_layers,
                            target, None, module, opt, sched, method=DFlashMethod(gamma, mask_text)), ckpt)


def _anchors(batch: dict[str, torch.Tensor], limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's anchors: `limit` drawn per sample (training), or all valid ones (limit None)."""
    rows = []
    for mask, seg in zip(batch["loss_mask"].cpu(), batch["segment"].cpu()):
        rows.append(valid_anchors(mask, seg) if limit is None else sample_anchors(mask, limit, segment=seg))
    return pad_anchors(rows)


class DFlashMethod:
    """The hooks train.py's loop calls for a DFlash run (RunState.method)."""

    def __init__(self, gamma: float, mask_token: str | None):
        self.gamma, self.mask_token = gamma, mask_token
        self.decay = math.exp(-1.0 / gamma)  # slot j's weight exp(-(j-1)/gamma) = decay**(j-1): the log's weighting

    @staticmethod
    def slots(s: Any) -> int:
        return s.dcfg.block_size - 1

    def forward(self, s: Any, batch: dict[str, torch.Tensor], anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block loss of this rank's share of a global batch, its per-slot stats [B-1, 3] and per-anchor
        leads [R, A]."""
        anchors, real = anchors or _anchors(batch, s.cfg.anchors)
        batch = {k: v.to(s.d.device, non_blocking=True) for k, v in batch.items()}
        anchors, real = anchors.to(s.d.device), real.to(s.d.device)
        inner = getattr(s.module, "module", s.module)  # DDP keeps the module inside
        denom = parallel.all_sum(inner.denominator(batch["loss_mask"], anchors, real, batch["segment"]), s.d)
        with parallel.autocast(s.cfg.precision, s.d.device):
            return s.module(batch["input_ids"], batch["aux"].float(), batch["loss_mask"], anchors, real, denom,
                            positions=batch["positions"], segment=batch["segment"])

    @torch.no_grad()
    def validate(self, s: Any) -> dict[str, Any]:
        """Per-slot loss and accuracy on the validation slice, and the acceptance length replayed from every
        anchor's lead for 1..B-1 draft tokens (exact for B-1: a block sees what vLLM's draft sees)."""
        s.module.eval()
        slots, bs = self.slots(s), s.recipe.batch_size
        chunks = (s.val_idx[i:i + bs] for i in range(0, len(s.val_idx), bs))
        plan = (rank_share(c, s.lengths, s.d.rank, s.d.world) for c in chunks)
        window = torch.zeros(slots, 3, device=s.d.device)
        replay = torch.zeros(slots, 2, device=s.d.device)  # per draft-token count: drafts, accepted tokens
        for batch in prefetch(s.shards, plan, s.cfg.max_len, s.cfg.batching == "packed"):
            window += self._replay_batch(s, batch, replay)
        s.module.train()
        w, r = parallel.all_sum(window, s.d).cpu(), parallel.all_sum(replay, s.d).cpu()
        counted = w[:, 2].clamp(min=1)
        acc = (w[:, 1] / counted).tolist()
        return {"step": s.step,
                "val_loss": round(sum(self.decay**j * v for j, v in enumerate((w[:, 0] / counted).tolist())), 5),
                "val_step_acc": [round(a, 5) for a in acc],
                "val_predicted": [round(1 + float(a / max(1.0, float(n))), 4) for n, a in r.tolist()],
                "val_chain_product": [round(predicted_acceptance(acc, k), 4) for k in range(1, slots + 1)]}

    def _replay_batch(self, s: Any, batch: dict[str, torch.Tensor], replay: torch.Tensor) -> torch.Tensor:
        """One validation batch: its per-slot stats, and its samples replayed into `replay` (added in place).
        Anchors go through in groups of --anchors per row, which bounds the block x context scores."""
        anchors, real = _anchors(batch, None)
        by_slot = torch.zeros(*batch["loss_mask"].shape, dtype=torch.long)  # lead of the anchor at each slot
        stats = torch.zeros(self.slots(s), 3, device=s.d.device)
        for lo in range(0, anchors.shape[1], s.cfg.anchors):
            a, m = anchors[:, lo:lo + s.cfg.anchors], real[:, lo:lo + s.cfg.anchors]
            _, part, lead = self.forward(s, batch, (a, m))
            stats += part
            by_slot.scatter_(1, a, torch.where(m, lead.cpu(), by_slot.gather(1, a)))
        # replay_acceptance counts from EAGLE-style roots t = p - 1 (the last verified row before anchor p)
        root = torch.cat([by_slot[:, 1:], torch.zeros_like(by_slot[:, :1])], dim=1)
        for lead, mask in zip(per_sample(root, batch["spans"]), per_sample(batch["loss_mask"], batch["spans"])):
            for k in range(self.slots(s)):
                replay[k] += torch.tensor(replay_acceptance(lead.tolist(), mask.tolist(), k + 1), device=replay.device)
        return stats

    def export(self, s: Any, state: dict[str, torch.Tensor]) -> None:
        write_dflash_draft(s.out.path, state, s.dcfg, s.aux_layers, s.target, self.mask_token)
