"""EAGLE-3: one decoder layer over the fused aux states, unrolled over its own outputs in training (ttt.py),
drafting over a reduced vocabulary (vocab.py) with its own lm_head rows. `--init-draft` starts it from an
existing draft (init_draft.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from eyas_train import parallel
from eyas_train.config import TrainConfig
from eyas_train.data import per_sample, prefetch, rank_share, token_counts
from eyas_train.export import load_draft, write_draft
from eyas_train.init_draft import check_fits, init_vocab, load_into, read_init_draft, run_config
from eyas_train.methods.base import Built, Inputs, validation_record
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.recipe import head_negatives, replay_acceptance
from eyas_train.target import Teacher, attention_shape, load_embedding, load_lm_head, load_weight
from eyas_train.ttt import ChainAttention, UnrolledLoss, step_counts
from eyas_train.vocab import VocabMap, build_vocab

SERVED_SPEC_TOKENS = 3  # the K EAGLE-3 drafts are usually served at: the run's last line predicts for it


def draft_config(target: dict[str, Any], hidden_size: int, vocab_size: int, n_aux: int, draft_vocab: int,
                 norm_before_residual: bool) -> DraftConfig:
    """The draft's shape from the target's config: same width, heads and FFN as one target layer."""
    heads, head_dim, rope = attention_shape(target, hidden_size)
    return DraftConfig(
        vocab_size=vocab_size, draft_vocab_size=draft_vocab, hidden_size=hidden_size,
        target_hidden_size=hidden_size, num_aux=n_aux, num_attention_heads=heads,
        num_key_value_heads=target.get("num_key_value_heads", heads), head_dim=head_dim,
        intermediate_size=target["intermediate_size"], rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        max_position_embeddings=target.get("max_position_embeddings", 4096), rope_parameters=rope,
        norm_before_residual=norm_before_residual)


def vocab_from(state: dict[str, Any]) -> VocabMap:
    return VocabMap(state["d2t"], state["t2d"], state["coverage"], state["distinct"])


def new_draft(cfg: TrainConfig, dcfg: DraftConfig, vocab: VocabMap) -> tuple[Eagle3Draft, torch.Tensor]:
    """A seeded draft with the target's embedding, and its final norm and lm_head rows as the output end
    (the layer then only has to produce a state like the target's last residual stream)."""
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    draft.init_weights(cfg.seed)
    lm_head = load_lm_head(cfg.model)
    with torch.no_grad():
        draft.embed.weight.copy_(load_embedding(cfg.model))
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        draft.norm.weight.copy_(load_weight(cfg.model, "model.norm.weight"))
        draft.lm_head.weight.copy_(lm_head[vocab.draft_to_target])
    return draft, lm_head


class Eagle3:
    name: ClassVar[str] = "eagle3"
    streams: ClassVar[bool] = True
    own_options: ClassVar[tuple[str, ...]] = ("head_negatives", "init_draft")

    def __init__(self, cfg: TrainConfig, teacher: Teacher):
        self.teacher, self.slots, self.decay = teacher, cfg.ttt_steps, cfg.step_decay

    @classmethod
    def build(cls, x: Inputs) -> Built:
        cfg = x.cfg
        vocab_size = int(x.shards.params.get("vocab_size") or x.target["vocab_size"])
        # A resumed run takes the init draft's weights and vocabulary from its checkpoint and its shape from the
        # draft's manifest: the init draft is read once, so moving or deleting it later does not block the resume.
        resumed_shape = (x.out.read_manifest().get("params") or {}).get("draft") if x.ckpt and cfg.init_draft else None
        init = read_init_draft(cfg.init_draft, x.data_root) if cfg.init_draft and not resumed_shape else None
        if init is not None:
            check_fits(init, vocab_size=vocab_size, hidden_size=x.hidden_size, aux_layers=x.aux_layers)
        counts = (lambda: token_counts(x.shards, vocab_size, x.vocab_shards))
        if x.ckpt is not None:
            vocab = vocab_from(x.ckpt["vocab"])
        elif init is not None:
            vocab, report = init_vocab(init, counts(), cfg.init_vocab, cfg.draft_vocab)
            if x.d.main:
                x.say(f"--init-draft {init.source} ({init.layout} layout): {report}")
        else:
            vocab = build_vocab(counts(), cfg.draft_vocab)
        if resumed_shape:
            dcfg = DraftConfig(**resumed_shape)
        elif init is not None:
            dcfg = run_config(init, vocab)
        else:
            dcfg = draft_config(x.target, x.hidden_size, vocab_size, len(x.aux_layers), vocab.d2t.numel(),
                                cfg.norm_before_residual)
        draft, lm_head = new_draft(cfg, dcfg, vocab)
        if init is not None:
            load_into(draft, init, vocab)  # a resumed run then loads its checkpoint over it
        teacher = Teacher(vocab, lm_head if x.shards.teacher == "final" else None, x.d.device)
        negatives = head_negatives(cfg.head_negatives, vocab.d2t.numel())
        if x.d.main and cfg.head_negatives is None:
            x.say(f"head: {f'sampled, {negatives} drawn columns' if negatives else 'exact'} on a "
                  f"{vocab.d2t.numel():,}-token draft vocabulary (--head-negatives sets it)")
        loss = UnrolledLoss(draft, cfg.ttt_steps, cfg.step_decay, negatives=negatives)
        return Built(parallel.wrap(loss.to(x.d.device), x.d, cfg.parallel), vocab, dcfg, cls(cfg, teacher))

    def forward(self, s: Any, batch: dict[str, torch.Tensor], leads: list[torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unrolled loss of one global batch (this rank's share) and its per-step stats [steps, 3]
        (`leads`: see UnrolledLoss)."""
        batch = {k: v.to(s.d.device, non_blocking=True) for k, v in batch.items()}
        target_p, target_top = self.teacher(batch)
        mask = batch["loss_mask"]
        denom = parallel.all_sum(step_counts(mask, self.slots, batch["segment"]), s.d)
        with parallel.autocast(s.cfg.precision, s.d.device):
            return s.module(batch["input_ids"], batch["aux"].float(), target_p, target_top, mask, denom,
                            positions=batch["positions"], segment=batch["segment"], leads=leads)

    @torch.no_grad()
    def validate(self, s: Any) -> dict[str, Any]:
        """Per-step TTT loss and top-1 accuracy on the validation slice (every rank a share of each batch), and
        the acceptance length predicted for 1..ttt_steps speculative tokens: the validation samples decoded
        again as a greedy verifier would accept the draft's chains (replay_acceptance), beside the chain
        product of the per-step accuracies."""
        s.module.eval()
        bs, steps = s.recipe.batch_size, self.slots
        chunks = (s.val_idx[i:i + bs] for i in range(0, len(s.val_idx), bs))
        plan = (rank_share(c, s.lengths, s.d.rank, s.d.world) for c in chunks)
        window = torch.zeros(steps, 3, device=s.d.device)
        replay = torch.zeros(steps, 2, device=s.d.device)  # per spec-token count: drafts, accepted tokens
        for batch in prefetch(s.shards, plan, s.cfg.max_len, s.cfg.batching == "packed"):
            leads: list[torch.Tensor] = []
            window += self.forward(s, batch, leads)[1]
            samples = zip(per_sample(leads[0].cpu(), batch["spans"]), per_sample(batch["loss_mask"], batch["spans"]))
            for lead, mask in ((a.tolist(), b.tolist()) for a, b in samples):
                for k in range(steps):
                    replay[k] += torch.tensor(replay_acceptance(lead, mask, k + 1), device=s.d.device)
        s.module.train()
        return validation_record(s.step, parallel.all_sum(window, s.d).cpu(), parallel.all_sum(replay, s.d).cpu(),
                                 self.decay)

    def export(self, s: Any, state: dict[str, torch.Tensor]) -> None:
        write_draft(s.out.path, state, s.dcfg, s.aux_layers, s.target)

    @staticmethod
    def reexport(folder: Path, state: dict[str, torch.Tensor], params: dict[str, Any],
                 target: dict[str, Any]) -> None:
        write_draft(folder, state, DraftConfig(**params["draft"]), params["aux_layers"], target)

    @staticmethod
    def load(folder: Path, model: str | Path) -> tuple[torch.nn.Module, list[int]]:
        return load_draft(folder, model)

    @staticmethod
    @torch.no_grad()
    def propose(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor, k: int) -> list[int]:
        """k chain proposals after `ids` [n] (target ids), given the target's aux states [n-1, 3H] of ids[:-1]."""
        t = ids.numel() - 2  # the root: the last position whose target states are known
        attend = ChainAttention()
        positions = torch.arange(t + 1, device=ids.device)[None]
        out = draft.step(ids[None, 1:], draft.fuse(aux[None]), positions, attend)[:, -1:]
        token = draft.to_target_ids(draft.logits(out).argmax(-1))
        chain = [int(token)]
        for j in range(1, k):
            out = draft.step(token, out, positions[:, -1:] + j, attend)
            token = draft.to_target_ids(draft.logits(out).argmax(-1))
            chain.append(int(token))
        return chain

    @staticmethod
    def reported_k(n_predicted: int) -> int:
        return min(SERVED_SPEC_TOKENS, n_predicted)

