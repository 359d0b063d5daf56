"""Training speed of the EAGLE-3 draft, measured side by side in one run.

    TTT       the training step as eyas-train runs it: the draft unrolled --ttt-steps times, forward + backward
    bare      one forward + backward of the same draft module over the same tokens (a plain causal step)
Prints training tokens/s, bare tokens/s and their ratio (the cost of unrolling: ideally 1 / ttt-steps),
and, on CUDA only, the TTT step's model FLOPs utilisation against the GPU's dense bf16 peak.

    .venv/bin/python bench/train.py                     # the fixture draft's shape, CPU
    python bench/train.py --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 \
        --draft-vocab 32000 --seq 2048 --batch 4        # a Llama-3-8B-sized draft, on a GPU
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.ttt import ChainAttention, UnrolledLoss, soft_cross_entropy, step_counts

# Dense bf16 peaks (FLOP/s) by device-name fragment; --peak-tflops overrides.
PEAKS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "RTX PRO 6000": 500e12,
         "5090": 210e12, "4090": 165e12}


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    p.add_argument("--ffn", type=int, default=320)
    p.add_argument("--vocab", type=int, default=3000)
    p.add_argument("--draft-vocab", type=int, default=3000)
    p.add_argument("--seq", type=int, default=128, help="tokens per sample")
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--iters", type=int, default=5, help="timed iterations (after 2 warm-up ones)")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU dense bf16 peak, TFLOP/s")
    return p.parse_args()


def timed(fn, iters: int, device: torch.device) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def ttt_flops(cfg: DraftConfig, seq: int, steps: int) -> float:
    """Model FLOPs of one TTT training token (forward + backward = 3x forward; the frozen embedding is a lookup)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_step = 2 * cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size \
        + cfg.hidden_size * cfg.draft_vocab_size
    attn = 2 * q * (seq / 2 + steps)  # QK^T and PV over the causal first pass plus the chain's own keys
    fc = cfg.num_aux * cfg.target_hidden_size * cfg.hidden_size
    return 3 * 2 * (fc + steps * (per_step + attn))


def main() -> None:
    a = args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DraftConfig(vocab_size=a.vocab, draft_vocab_size=a.draft_vocab, hidden_size=a.hidden,
                      target_hidden_size=a.hidden, num_aux=3, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, head_dim=a.head_dim or a.hidden // a.heads,
                      intermediate_size=a.ffn, rms_norm_eps=1e-6, max_position_embeddings=a.seq + a.ttt_steps + 1)
    draft = Eagle3Draft(cfg)
    draft.init_weights(0)
    draft.to(device)
    g = torch.Generator().manual_seed(0)
    b, t = a.batch, a.seq
    ids = torch.randint(0, a.vocab, (b, t), generator=g).to(device)
    aux = torch.randn(b, t, 3 * a.hidden, generator=g).to(device)
    target_p = torch.softmax(torch.randn(b, t, a.draft_vocab, generator=g), -1).to(device)
    top = torch.randint(0, a.vocab, (b, t), generator=g).to(device)
    mask = torch.ones(b, t, dtype=torch.long, device=device)
    ttt = UnrolledLoss(draft, a.ttt_steps)
    denom = step_counts(mask, a.ttt_steps)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def ttt_step() -> None:
        with autocast:
            loss, _ = ttt(ids, aux, target_p, top, mask, denom)
        loss.backward()
        draft.zero_grad(set_to_none=True)

    def bare_step() -> None:
        with autocast:
            out = draft.step(ids, draft.fuse(aux), torch.arange(t, device=device).expand(b, t), ChainAttention())
            loss = soft_cross_entropy(draft.logits(out).float(), target_p).mean()
        loss.backward()
        draft.zero_grad(set_to_none=True)

    s_ttt, s_bare = timed(ttt_step, a.iters, device), timed(bare_step, a.iters, device)
    tok_ttt, tok_bare = b * t / s_ttt, b * t / s_bare
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else f'cpu ({torch.get_num_threads()} threads)'}; "
          f"draft H={a.hidden} heads={a.heads}/{a.kv_heads} ffn={a.ffn} draft_vocab={a.draft_vocab}; "
          f"batch {b} x {t} tokens, {a.ttt_steps} TTT steps")
    print(f"TTT training   {tok_ttt:12,.0f} tokens/s")
    print(f"bare fwd+bwd   {tok_bare:12,.0f} tokens/s")
    print(f"ratio TTT/bare {tok_ttt / tok_bare:12.3f}   (1/ttt-steps = {1 / a.ttt_steps:.3f}; "
          f"per unrolled step {a.ttt_steps * tok_ttt / tok_bare:.3f} of a bare step)")
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = a.peak_tflops * 1e12 if a.peak_tflops else next((v for k, v in PEAKS.items() if k in name), None)
        if peak is None:
            print(f"MFU: unknown peak for {name!r}; pass --peak-tflops")
        else:
            mfu = tok_ttt * ttt_flops(cfg, t, a.ttt_steps) / peak
            print(f"MFU            {mfu:12.1%}   ({peak / 1e12:.0f} TFLOP/s dense bf16 peak)")


if __name__ == "__main__":
    main()
