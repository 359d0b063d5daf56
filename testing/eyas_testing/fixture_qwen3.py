"""A second tiny thinking target, of another kind than fixture.py's: Qwen3 architecture (q/k norms), a
ChatML template whose generation prompt does NOT open the thinking block (the model emits `<think>`
itself, as Qwen3 does), another vocabulary size and another depth. The tasks, the training loop and the
cache are fixture.py's; this module adds only what differs, so the Llama fixture's cache key (a hash of
fixture.py) does not change when this one does. Its own key covers this file's bytes.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from eyas_testing import fixture as base

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# Qwen3's layout: every turn `<|im_start|>role\n...<|im_end|>\n`; reasoning only for the assistant turn
# after the last user turn; `enable_thinking=False` writes an empty thinking block into the prompt (`thinking`,
# fixture.py's switch, is taken too, so its training conversations render here unchanged).
CHAT_TEMPLATE = base.LAST_USER + """\
{%- for m in messages -%}
  {%- if m['role'] in ('system', 'user') -%}
    {{ '<|im_start|>' ~ m['role'] ~ '\n' ~ (m['content'] or '') ~ '<|im_end|>\n' }}
  {%- elif m['role'] == 'assistant' -%}
    {{ '<|im_start|>assistant\n' }}
    {%- if loop.index0 > ns.last_user -%}
      {{ '<think>\n' ~ (m['reasoning_content'] or m['reasoning'] or '') ~ '\n</think>\n\n' }}
    {%- endif -%}
    {{ (m['content'] or '') ~ '<|im_end|>\n' }}
  {%- else -%}
    {{ raise_exception('fixture chat template: unsupported role ' ~ m['role']) }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ '<|im_start|>assistant\n' }}
  {%- if (enable_thinking is defined and enable_thinking is false) or (thinking is defined and thinking is false) -%}
    {{ '<think>\n\n</think>\n\n' }}
  {%- endif -%}
{%- endif -%}
"""

QWEN3_CONFIG: dict[str, Any] = {
    **base.LLAMA_CONFIG,
    "vocab_size": 4000,       # the Llama fixture has 3000
    "num_hidden_layers": 10,  # and 8: aux layers [2, 5, 7] instead of [2, 4, 5]
    "rope_theta": 1_000_000.0,
}


def _source_key() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _build_tokenizer(seed: int, vocab_size: int) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=[PAD, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(base._tokenizer_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (base.THINK, base.UNTHINK)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                   clean_up_tokenization_spaces=False,
                                   model_max_length=QWEN3_CONFIG["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_qwen3(out: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = QWEN3_CONFIG
    t0 = time.monotonic()
    torch.manual_seed(seed)
    tokenizer = _build_tokenizer(seed, cfg["vocab_size"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IM_END, PAD)}
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"],
        tie_word_embeddings=False, eos_token_id=ids[IM_END], bos_token_id=None, pad_token_id=ids[PAD],
        dtype="float32")
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=ids[IM_END], pad_token_id=ids[PAD])
    info = base.train_fixture(model, tokenizer, cfg, seed, t0, kind="qwen3")
    model.save_pretrained(out)
    base._save_tokenizer(tokenizer, out)
    (out / "eyas_fixture.json").write_text(json.dumps(info, indent=2) + "\n")


def build_qwen3_fixture(out: Path | None = None, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """The trained tiny Qwen3-style thinking target (cached; a first build takes a few minutes on CPU)."""
    return base._cached("qwen3", {**QWEN3_CONFIG, "source": _source_key()}, seed, cache_dir, _build_qwen3, out)


if __name__ == "__main__":
    print(build_qwen3_fixture())
