"""The EAGLE-3 draft module: fc over the target's aux states, one Llama decoder layer with a 2H-wide
attention input, a final norm and an lm_head over the reduced draft vocabulary.

Only the module lives here. How its attention is masked across unrolled steps (training-time test)
is passed in as `attend` (see ttt.py); training, parallelism and export live elsewhere. Internal
parameter names are short; export.py maps them to the names vLLM and SGLang load.

One draft step, as vLLM's `llama_eagle3.py` runs it (norm_before_residual=False, the EAGLE-3 layout):
    residual = h                                   # h: fc(aux) at step 0, the previous step's output after
    x   = [embed_norm(e) ; hidden_norm(h)]         # e: target embedding of the input token; 2H wide
    h1  = residual + o_proj(attn(q, k, v from x))
    out = h1 + mlp(mlp_norm(h1))                   # pre-norm output: fed back as the next step's h
    logits = lm_head(norm(out))                    # over the draft vocabulary
With norm_before_residual=True the residual is hidden_norm(h) instead of h.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# attend(q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]) -> [B, Hq, T, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerShape:
    """The shape of a Llama-style decoder layer, as both draft methods build theirs (fields by keyword)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int


@dataclass(frozen=True)
class DraftConfig(LayerShape):
    """Shape of the draft; every field is written to the exported config.json."""

    vocab_size: int                 # the target's vocabulary (input tokens are target ids)
    draft_vocab_size: int           # rows of lm_head
    hidden_size: int                # draft width; equals the target's, since the embedding is the target's
    target_hidden_size: int         # width of each aux state
    num_aux: int                    # aux states concatenated into fc's input (3 for EAGLE-3)
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    norm_before_residual: bool = False


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 -> fp32; fp64 stays, for exact reference tests)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics whatever the compute dtype, as HF and vLLM do.
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * upcast(self.weight)).to(x.dtype)


class Rotary(nn.Module):
    """RoPE (neox layout) with the target's rope parameters; scaled variants come from transformers' table."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        params = dict(cfg.rope_parameters)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
            scale = 1.0
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                             head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                             rope_parameters=params)
            inv, scale = ROPE_INIT_FUNCTIONS[kind](hf, None)
        self.scale = float(scale)
        # A plain attribute, not a buffer: Module.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv.float()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] (fp32) for integer positions [B, T]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos() * self.scale, emb.sin() * self.scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (upcast(x) * cos + upcast(rotated) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size  # [embedding ; fused hidden]
        self.wq = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Layer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h = residual + self.attn(torch.cat([self.embed_norm(embeds), normed], dim=-1), cos, sin, attend)
        return h + self.mlp(self.mlp_norm(h))


class Eagle3Draft(nn.Module):
    """The draft. `embed` is the target's embedding, frozen (the servers share the target's own)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layer = Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        # target id = draft id + d2t[draft id]; t2d marks target ids inside the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the target's concatenated aux states [.., num_aux * target_hidden]: step 0's hidden input.
        Later steps feed back the draft's own output, which never goes through fc (as in vLLM)."""
        return self.fc(aux)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One draft step over tokens [B, T] (target ids), hidden [B, T, H] and positions [B, T]:
        returns the pre-norm output [B, T, H] (the next step's hidden input)."""
        cos, sin = self.rotary(positions)
        return self.layer(self.embed(tokens).to(hidden.dtype), hidden, cos, sin, attend)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a step's output."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def init_weights(self, seed: int) -> None:
        """Deterministic init (same weights on every rank and every run with the same seed)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
