"""eyas-train: train an EAGLE-3 draft from a hidden dataset, export it, measure its acceptance offline."""

from __future__ import annotations

import json
from pathlib import Path

import click

from eyas_common.cli_errors import EyasGroup, Finite
from eyas_common.methods import METHODS
from eyas_common.prompts import PROMPTS_HELP
from eyas_train.config import MAX_TTT_STEPS, TEACHER_TOP, TrainConfig
from eyas_train.recipe import SAMPLED_FROM, SAMPLED_NEGATIVES

D = TrainConfig.__dataclass_fields__  # defaults shown in --help come from the config itself


@click.group(cls=EyasGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main() -> None:
    """Datasets live under $EYAS_DATA (default ./data). Under torchrun, `run` trains data-parallel."""


@main.command()
@click.option("--hidden", required=True, help="Input hidden dataset (hidden/NAME or NAME).")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Target folder: tokenizer, config.json and safetensors (embedding and lm_head are read alone).")
@click.option("--name", required=True, help="Output draft dataset (drafts/NAME or NAME); rerun to resume it.")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=D["draft_vocab"].default,
              help="Draft vocabulary size in tokens (capped at the target's).")
@click.option("--ttt-steps", type=click.IntRange(min=1, max=MAX_TTT_STEPS), default=D["ttt_steps"].default,
              help="Unrolled draft steps per position (training-time test); memory grows with it, since every "
                   f"step keeps its activations for the backward pass (at most {MAX_TTT_STEPS}).")
@click.option("--head-negatives", type=click.IntRange(min=0), default=None,
              help=f"EAGLE-3 training steps: the lm_head's loss over each row's {TEACHER_TOP} likeliest teacher tokens plus this "
                   "many drawn columns per chunk of rows, not the whole draft vocabulary; 0: exact. Validation "
                   f"stays exact.  [default: {SAMPLED_NEGATIVES} on a draft vocabulary of {SAMPLED_FROM:,} tokens or "
                   "more, else 0]")
@click.option("--step-decay", type=Finite(0, 1, min_open=True), default=D["step_decay"].default, help="Loss weight of TTT step k is DECAY**k.")
@click.option("--epochs", type=Finite(min=0), default=None,
              help="Passes over the training samples (may be fractional); 0 exports the untrained draft. "
                   "[default: from the rule: 1 to --max-epochs, at least --min-steps steps]")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per optimiser step, summed over all processes. [default: from the rule: about "
                   "--batch-tokens tokens, fewer on small data, never under 256 tokens]")
@click.option("--max-len", type=click.IntRange(min=2), default=D["max_len"].default, help="Tokens kept per sample; longer samples are cut.")
@click.option("--batching", type=click.Choice(["packed", "padded"]), default=D["batching"].default,
              help="Rows of a step: its samples packed end to end (attention kept within each sample, no "
                   "padding computed) or one right-padded sample per row. Same samples and loss either way.")
@click.option("--lr", type=Finite(min=0, min_open=True), default=None,
              help="AdamW peak learning rate. [default: from the rule: 3e-3 x 128/width, lower below 256 tokens "
                   "a step]")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=None,
              help="Optimiser steps of linear warm-up; cosine decay to 0 after. [default: 3% of the steps, "
                   "at most 500]")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=D["batch_tokens"].default,
              help="Rule: tokens per optimiser step once the data is large.")
@click.option("--min-steps", type=click.IntRange(min=1), default=D["min_steps"].default,
              help="Rule: floor on optimiser steps for small data (as far as --max-epochs allows).")
@click.option("--max-epochs", type=click.IntRange(min=1), default=D["max_epochs"].default,
              help="Rule: most passes over small data.")
@click.option("--token-budget", type=click.IntRange(min=1), default=D["token_budget"].default,
              help="Rule: tokens trained on when the data is large (at least one pass).")
@click.option("--val-samples", type=click.IntRange(min=0), default=None,
              help="Samples held out of the hidden dataset (by sample id) to validate on; 0: none. "
                   "[default: 1 in 20, at least 32 (an eighth of a small dataset), at most 1000]")
@click.option("--eval-every", type=click.IntRange(min=1), default=None,
              help="Optimiser steps between validations. [default: 20 validations over the run]")
@click.option("--patience", type=click.IntRange(min=0), default=D["patience"].default,
              help="Stop after this many validations without a better predicted acceptance length (the "
                   "validation samples replayed as vLLM decodes them); 0: never stop early. The best validated "
                   "draft is the one exported.")
@click.option("--weight-decay", type=Finite(min=0), default=D["weight_decay"].default, help="AdamW weight decay.")
@click.option("--grad-clip", type=Finite(min=0, min_open=True), default=D["grad_clip"].default, help="Max global gradient norm.")
@click.option("--norm-before-residual/--norm-after-residual", default=D["norm_before_residual"].default,
              help="Residual of the draft layer: hidden_norm(h) (before) or h (after, EAGLE-3/SGLang layout).")
@click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), default=D["seed"].default,
              help="Init and data-order seed (32 bits: every epoch's order is seeded from it).")
@click.option("--order", type=click.Choice(["random", "shards"]), default=None,
              help="Data order. random: every epoch a seeded permutation of all samples; shards: the first pass "
                   "walks the shards in order, --window-shards at a time, shuffled within each (later passes "
                   "random).  [default: shards with --follow, else random]")
@click.option("--window-shards", type=click.IntRange(min=1), default=D["window_shards"].default,
              help="--order shards: shards shuffled together; the first window also gives the validation "
                   "samples, the recipe's tokens per sample and the draft vocabulary.")
@click.option("--follow", is_flag=True,
              help="Train while `eyas-extract run --follow` still writes the hidden dataset, taking each shard "
                   "once it is final (implies --order shards).")
@click.option("--poll-seconds", type=Finite(min=0, min_open=True), default=D["poll_seconds"].default,
              help="--follow: seconds between looks at the hidden manifest.")
@click.option("--consume", is_flag=True,
              help="--order shards: delete each hidden shard at the first checkpoint after its last use, marked "
                   "in the hidden manifest (which then serves this draft alone); with a one-pass recipe this "
                   "bounds the disk with `eyas-extract run --follow --disk-budget`.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default=D["parallel"].default,
              help="Data parallelism under torchrun (FSDP2 shards parameters and optimiser state).")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default=D["precision"].default,
              help="Matmul precision of the forward pass: bf16 autocast (weights and optimiser stay fp32) or fp32; "
                   "auto: bf16 on a GPU and on a CPU with native bf16 (AVX512-BF16 or AMX: about 2x fp32 there), "
                   "else fp32.")
@click.option("--ckpt-every", type=click.IntRange(min=1), default=D["ckpt_every"].default, help="Optimiser steps between checkpoints.")
@click.option("--keep-ckpts", type=click.IntRange(min=1), default=D["keep_ckpts"].default, help="Newest checkpoints kept.")
@click.option("--allow-code-change", is_flag=True,
              help="Resume a draft started by another eyas version (git sha / image tag); recorded in the manifest.")
@click.option("--log-every", type=click.IntRange(min=1), default=D["log_every"].default, help="Optimiser steps between progress lines.")
@click.option("--trust-remote-code", is_flag=True, help="Run the tokenizer code shipped with the target (explicit opt-in).")
@click.option("--init-draft", default=None,
              help="Start from this draft: drafts/NAME, or a folder in the eyas, vLLM/speculators or SpecForge "
                   "EAGLE-3 layout; its vocabulary is kept (or remapped, with a coverage report).")
@click.option("--init-vocab", type=click.Choice(["keep", "remap"]), default=D["init_vocab"].default,
              help="With --init-draft: keep its draft vocabulary, or remap to this data's most frequent tokens "
                   "(--draft-vocab of them; rows of tokens in both carried over).")
@click.option("--method", type=click.Choice(list(METHODS)), default=D["method"].default,
              help="eagle3: one layer unrolled over its own outputs (--ttt-steps); dflash: a block-diffusion draft "
                   "filling --block-size - 1 masked slots in one pass (needs a hidden dataset extracted with "
                   "--method dflash, or any with layer ids >= 1).")
@click.option("--block-size", type=click.IntRange(min=2), default=None,
              help="DFlash: the anchor and BLOCK_SIZE - 1 masked slots; serve with num_speculative_tokens = "
                   "BLOCK_SIZE - 1.  [default: 16 for targets of width >= 2048, else 8]")
@click.option("--draft-layers", type=click.IntRange(min=1), default=None,
              help="DFlash: decoder layers of the draft.  [default: target layers / 8, rounded up, 3 to 5]")
@click.option("--anchors", type=click.IntRange(min=1), default=D["anchors"].default,
              help="DFlash: most blocks drawn per sample and step (anchors among its completion tokens).")
@click.option("--gamma", type=Finite(min=0, min_open=True), default=None,
              help="DFlash: slot j's loss weight is exp(-(j-1)/GAMMA).  [default: 7 for blocks of 16, 5 for 10, 4 "
                   "for 8 and below]")
@click.option("--mask-token-id", type=click.IntRange(min=0), default=None,
              help="DFlash: the token id filling masked slots (served with the target's embedding of it).  "
                   "[default: the tokenizer's mask token, else a special token no completion uses]")
def run(**kw) -> None:
    """Train drafts/NAME on hidden/HIDDEN; an interrupted run resumes from its last checkpoint."""
    from eyas_train.methods import unsupported
    from eyas_train.train import run as train_run

    if kw["follow"] and kw["order"] == "random":
        raise click.UsageError("--follow trains in shard order: drop --order random (or --follow)")
    if kw["consume"] and not (kw["follow"] or kw["order"] == "shards"):
        raise click.UsageError("--consume deletes shards after their last use in shard order: add --order shards "
                               "(or --follow)")
    refusal = unsupported(kw["method"], kw, TrainConfig.defaults())
    if refusal:
        raise click.UsageError(refusal.line)
    if kw["order"] is None:
        kw.pop("order")
    click.echo(train_run(**kw))


@main.command()
@click.argument("name")
@click.option("--step", type=click.IntRange(min=0), default=None, help="Checkpoint step to export [default: the newest].")
@click.option("--out", default=None, help="Write a complete snapshot as drafts/OUT instead of into NAME.")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None, show_default=False,
              help="The target's folder where it is now (its config gives the token ids and dtype written).  "
                   "[default: where it was at training time, from the draft's manifest]")
def export(name: str, step: int | None, out: str | None, model: str | None) -> None:
    """Write config.json + model.safetensors of drafts/NAME from one of its checkpoints."""
    from eyas_train.export_ckpt import export_checkpoint

    click.echo(export_checkpoint(name, step=step, out=out, model=model))


@main.command("eval")
@click.option("--draft", required=True, help="Draft dataset (drafts/NAME).")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Target folder (HF).")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Held-out prompts: " + PROMPTS_HELP)
@click.option("--spec-tokens", type=click.IntRange(min=1), default=None, show_default=False,
              help="Draft tokens proposed per verification (vLLM's num_speculative_tokens).  [default: the "
                   "draft's own: EAGLE-3 3, DFlash its block size - 1, the block it was trained for]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, help="Max generated tokens per prompt.")
@click.option("--limit", type=click.IntRange(min=1), default=None, show_default=False,
              help="Use only the first N prompts.  [default: all]")
@click.option("--thinking/--no-thinking", default=None,
              help="Chat-template thinking switch.  [default: on where the target has <think>/</think> and its "
                   "template takes the switch]")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              help="Target and draft dtype: the serving dtype, to reproduce a server's acceptance; auto: bfloat16 on GPU, float32 on CPU.")
@click.option("--device-map", default=None,
              help="transformers device_map for the target: auto, balanced, balanced_low_0, sequential or a device "
                   "(cpu, cuda:0).  [default: auto on GPUs, none on CPU]")
@click.option("--trust-remote-code", is_flag=True, help="Run the model/tokenizer code shipped with the target (explicit opt-in).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the JSON here.")
def eval_cmd(**kw) -> None:
    """Speculative decoding with greedy verification, chains (EAGLE-3) or blocks (DFlash) as vLLM drafts them:
    acceptance length and per-position acceptance."""
    from eyas_train.eval import evaluate

    click.echo(json.dumps(evaluate(**kw), indent=2))


if __name__ == "__main__":  # `torchrun -m eyas_train.cli run ...` (also `-m eyas_train`)
    main()
