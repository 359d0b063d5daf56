"""DFlash: a block-diffusion draft (dflash.py: the model, its attention and BlockLoss) filling block size - 1
masked slots in one pass, over the target's whole vocabulary through the target's own lm_head.

The knobs default from the target (dflash.py: block size, draft layers, gamma) and from the data (the mask
token: one the completions never use, whose embedding row is a real one); the resolved values are in the
manifest's params.draft.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from eyas_common.chat import load_tokenizer
from eyas_common.contract import REMAKE, DatasetError
from eyas_train import parallel
from eyas_train.data import per_sample, prefetch, rank_share, token_counts
from eyas_train.dflash import (BlockLoss, DFlashConfig, DFlashDraft, default_block_size, default_draft_layers,
                               default_gamma, pad_anchors, sample_anchors, valid_anchors)
from eyas_train.dflash_export import load_dflash_draft, write_dflash_draft
from eyas_train.methods.base import Built, Inputs, validation_record
from eyas_train.recipe import replay_acceptance
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


def _anchors(batch: dict[str, torch.Tensor], limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's anchors: `limit` drawn per sample (training), or all valid ones (limit None)."""
    rows = []
    for mask, seg in zip(batch["loss_mask"].cpu(), batch["segment"].cpu()):
        rows.append(valid_anchors(mask, seg) if limit is None else sample_anchors(mask, limit, segment=seg))
    return pad_anchors(rows)


class DFlash:
    name: ClassVar[str] = "dflash"
    streams: ClassVar[bool] = False
    own_options: ClassVar[tuple[str, ...]] = ("block_size", "draft_layers", "gamma", "mask_token_id")

    def __init__(self, gamma: float, mask_token: str | None, block_size: int):
        self.gamma, self.mask_token, self.slots = gamma, mask_token, block_size - 1
        self.decay = math.exp(-1.0 / gamma)  # slot j's weight exp(-(j-1)/gamma) = decay**(j-1): the log's weighting

    @classmethod
    def build(cls, x: Inputs) -> Built:
        cfg = x.cfg
        if min(x.aux_layers) < 1:
            raise DatasetError(f"{x.hidden_ds.ref}: layer id 0 (the embedding) cannot feed a DFlash draft; rerun "
                               f"{REMAKE['hidden']} with --method dflash")
        counts = token_counts(x.shards, x.target["vocab_size"])
        try:
            mask_id, mask_text = pick_mask_token(load_tokenizer(cfg.model, cfg.trust_remote_code), counts,
                                                 cfg.mask_token_id, load_embedding(cfg.model))
        except ValueError as e:  # names --mask-token-id and the fix
            raise DatasetError(str(e)) from None
        dcfg = dflash_config(x.target, x.hidden_size, len(x.aux_layers), cfg, mask_id)
        gamma = cfg.gamma or default_gamma(dcfg.block_size)
        module = BlockLoss(new_dflash_draft(dcfg, cfg.model, cfg.seed), gamma).to(x.d.device)
        vocab = VocabMap(torch.zeros(dcfg.vocab_size, dtype=torch.long), torch.ones(dcfg.vocab_size, dtype=torch.bool),
                         1.0, int((counts > 0).sum()))  # DFlash drafts over the target's whole vocabulary
        return Built(parallel.wrap(module, x.d, cfg.parallel), vocab, dcfg, cls(gamma, mask_text, dcfg.block_size))

    def forward(self, s: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The block loss of this rank's share of a global batch and its per-slot stats [B-1, 3]."""
        return self._blocks(s, batch)[:2]

    def _blocks(self, s: Any, batch: dict[str, torch.Tensor], anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block loss, per-slot stats [B-1, 3] and per-anchor leads [R, A] (anchors: drawn per sample)."""
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
        slots, bs = self.slots, s.recipe.batch_size
        chunks = (s.val_idx[i:i + bs] for i in range(0, len(s.val_idx), bs))
        plan = (rank_share(c, s.lengths, s.d.rank, s.d.world) for c in chunks)
        window = torch.zeros(slots, 3, device=s.d.device)
        replay = torch.zeros(slots, 2, device=s.d.device)  # per draft-token count: drafts, accepted tokens
        for batch in prefetch(s.shards, plan, s.cfg.max_len, s.cfg.batching == "packed"):
            window += self._replay_batch(s, batch, replay)
        s.module.train()
        return validation_record(s.step, parallel.all_sum(window, s.d).cpu(), parallel.all_sum(replay, s.d).cpu(),
                                 self.decay)

    def _replay_batch(self, s: Any, batch: dict[str, torch.Tensor], replay: torch.Tensor) -> torch.Tensor:
        """One validation batch: its per-slot stats, and its samples replayed into `replay` (added in place).
        Anchors go through in groups of --anchors per row, which bounds the block x context scores."""
        anchors, real = _anchors(batch, None)
        by_slot = torch.zeros(*batch["loss_mask"].shape, dtype=torch.long)  # lead of the anchor at each slot
        stats = torch.zeros(self.slots, 3, device=s.d.device)
        for lo in range(0, anchors.shape[1], s.cfg.anchors):
            a, m = anchors[:, lo:lo + s.cfg.anchors], real[:, lo:lo + s.cfg.anchors]
            _, part, lead = self._blocks(s, batch, (a, m))
            stats += part
            by_slot.scatter_(1, a, torch.where(m, lead.cpu(), by_slot.gather(1, a)))
        # replay_acceptance counts from EAGLE-style roots t = p - 1 (the last verified row before anchor p)
        root = torch.cat([by_slot[:, 1:], torch.zeros_like(by_slot[:, :1])], dim=1)
        for lead, mask in zip(per_sample(root, batch["spans"]), per_sample(batch["loss_mask"], batch["spans"])):
            for k in range(self.slots):
                replay[k] += torch.tensor(replay_acceptance(lead.tolist(), mask.tolist(), k + 1), device=replay.device)
        return stats

    def export(self, s: Any, state: dict[str, torch.Tensor]) -> None:
        write_dflash_draft(s.out.path, state, s.dcfg, s.aux_layers, s.target, self.mask_token)

    @staticmethod
    def reexport(folder: Path, state: dict[str, torch.Tensor], params: dict[str, Any],
                 target: dict[str, Any]) -> None:
        write_dflash_draft(folder, state, DFlashConfig(**params["draft"]), params["aux_layers"], target)

    @staticmethod
    def load(folder: Path, model: str | Path) -> tuple[torch.nn.Module, list[int]]:
        return load_dflash_draft(folder, model)

    @staticmethod
    @torch.no_grad()
    def propose(draft: DFlashDraft, ids: torch.Tensor, aux: torch.Tensor, k: int) -> list[int]:
        """k proposals from one DFlash pass, as vLLM's DFlash proposer makes them: x_p = ids[-1] (p = n - 1, the
        target's bonus token) and k mask tokens at positions p .. p + k, seeing the context rows t < p (aux
        [n-1, n H]) and each other; slot j proposes x_{p+j} (its own position)."""
        p = ids.numel() - 1
        context = torch.cat([aux, aux.new_zeros(1, aux.shape[-1])])  # row p: never visible to its own block
        anchor = torch.tensor([[p]], device=ids.device)
        states = draft(ids[None], context[None], anchor, block_size=k + 1)[0, 0, 1:]
        return draft.lm_head(states).argmax(-1).tolist()

    @staticmethod
    def reported_k(n_predicted: int) -> int:
        return n_predicted  # block size - 1: the K a DFlash draft is served at
