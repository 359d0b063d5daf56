"""A tiny offline Kimi-K2.5-shaped target: remote code, a tiktoken tokenizer, a multimodal wrapper.

What a Kimi-K2.5 checkpoint makes a pipeline face, at fixture size:
- config.json with `model_type` `kimi_k25`, architecture `KimiK25ForConditionalGeneration` and an
  `auto_map` to modeling/configuration files inside the folder (kimi_k25/ here): it loads only with
  `trust_remote_code`;
- the text model under `language_model.*` (a DeepseekV3: MLA, dense then MoE layers), a placeholder
  `vision_tower.*` and `mm_projector.*`;
- a tiktoken-based tokenizer class, also remote code, with Kimi's special tokens after the base
  vocabulary, and a K2.5-shaped chat template (thinking on by default, `thinking` switch through
  `chat_template_kwargs`, content as a string or a list of text parts).
The language model is trained briefly on fixture.py's tasks (same conversations, same loss) so it
really answers as `<think>` steps `</think>` answer `<|im_end|>`. Cached like fixture.py's targets;
the key also covers this file and the remote-code files, so changing either rebuilds only this one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from eyas_testing.fixture import CHAT_TEMPLATE as LLAMA_TEMPLATE
from eyas_testing.fixture import DEEPSEEK_SHAPE, _cached, _log, _tokenizer_corpus, train_fixture

REMOTE_CODE = Path(__file__).with_name("kimi_k25")
REMOTE_FILES = ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py")
KIND = "kimi_k25"

# K2.5's layout, which the Llama fixture's template already is (turns as <|im_role|>role<|im_middle|>...<|im_end|>;
# the generation prompt opens the reasoning, or closes it at once when `thinking` is false; reasoning of turns
# before the last user turn is dropped), here with list content too: text parts are joined, others refused.
TEXT_OF_CONTENT = """\
{%- macro text(c) -%}
  {%- if c is string -%}{{ c }}
  {%- elif c is none -%}
  {%- else -%}{%- for p in c -%}
    {%- if p['type'] == 'text' -%}{{ p['text'] }}
    {%- else -%}{{ raise_exception('this target takes text parts only, not ' ~ p['type']) }}{%- endif -%}
  {%- endfor -%}{%- endif -%}
{%- endmacro -%}
"""
CHAT_TEMPLATE = TEXT_OF_CONTENT + LLAMA_TEMPLATE.replace("m['content'] or ''", "text(m['content'])")

# Everything that shapes the built files (with the source digest, the cache key).
KIMI_CONFIG: dict[str, Any] = {
    "base_vocab": 2800,  # tiktoken ranks; 256 special slots follow (Kimi: 163584 + 256)
    "text": {
        **DEEPSEEK_SHAPE,
        "kv_lora_rank": 32,  # small MLA ranks: this target is served by HF generation, not vLLM's CPU MLA
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "max_position_embeddings": 1024,
    },
    "vision": {"hidden_size": 64, "patch_size": 14, "num_layers": 2},
    "steps": 300,  # ~0.6 s a step on 2 idle cores: about 3 minutes
    "batch_size": 16,
    "lr": 3e-3,
    "warmup_steps": 20,
    "threads": 2,
    "eval_prompts": 10,
}


def source_digest() -> str:
    """sha256 of this file and the remote-code files: part of the cache key."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for name in REMOTE_FILES:
        h.update((REMOTE_CODE / name).read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Tokenizer


def _train_ranks(seed: int, base_vocab: int) -> list[bytes]:
    """Byte-level BPE on fixture.py's corpus, pre-split by the tokenizer's own pattern; tokens in merge
    order, which is the rank order tiktoken merges by."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from eyas_testing.kimi_k25.tokenization_kimi import PAT_STR, byte_to_char

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=base_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    to_byte = {c: b for b, c in byte_to_char().items()}
    ordered = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [bytes(to_byte[c] for c in s) for s, _ in ordered]
    singles = {t for t in tokens if len(t) == 1}
    assert len(singles) == 256, f"BPE alphabet has {len(singles)} of 256 bytes"
    return tokens


def write_tokenizer(out: Path, seed: int) -> None:
    """tiktoken.model, tokenizer_config.json (remote-code auto_map, specials) and the chat template."""
    from eyas_testing.kimi_k25.tokenization_kimi import NOT_SKIPPED, special_names

    ranks = _train_ranks(seed, KIMI_CONFIG["base_vocab"])
    with (out / "tiktoken.model").open("w") as f:
        for rank, token in enumerate(ranks):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    specials = {str(i): {"content": name, "special": name not in NOT_SKIPPED, "lstrip": False, "rstrip": False,
                         "normalized": False, "single_word": False}
                for i, name in special_names(len(ranks)).items()}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "added_tokens_decoder": specials,
        "model_max_length": KIMI_CONFIG["text"]["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def copy_remote_code(out: Path) -> None:
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_CODE / name, out / name)


# --------------------------------------------------------------------------------------------------
# Model


def model_config(tokenizer: Any) -> dict[str, Any]:
    """config.json: the wrapper, its DeepseekV3 text config, and the auto_map to the folder's code."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "[BOS]", "[PAD]")}
    special = {"eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["[BOS]"], "pad_token_id": ids["[PAD]"]}
    text = {**KIMI_CONFIG["text"], **special, "vocab_size": len(tokenizer), "tie_word_embeddings": False,
            # Kimi K2's routing, under the names vLLM reads (HF's DeepseekV3 always routes this way).
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"], "dtype": "float32"}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": KIND,
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "text_config": text,
        "vision_config": dict(KIMI_CONFIG["vision"]),
        "media_placeholder_token_id": tokenizer.convert_tokens_to_ids("<|reserved_token_5|>"),
        "tie_word_embeddings": False,
        "dtype": "float32",
        **special,
    }


def _build_kimi(out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.monotonic()
    torch.manual_seed(seed)
    copy_remote_code(out)
    write_tokenizer(out, seed)
    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    _log(f"tokenizer: {len(tokenizer)} tokens ({time.monotonic() - t0:.0f}s)")
    (out / "config.json").write_text(json.dumps(model_config(tokenizer), indent=2) + "\n")
    config = AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)
    ids = config.text_config
    model.generation_config = GenerationConfig(eos_token_id=ids.eos_token_id, bos_token_id=ids.bos_token_id,
                                               pad_token_id=ids.pad_token_id)
    info = train_fixture(model, tokenizer, KIMI_CONFIG, seed, t0, kind=KIND)
    model.save_pretrained(out)
    # save_pretrained rewrites config.json without the auto_map of a class it did not load by it.
    (out / "config.json").write_text(json.dumps(model_config(tokenizer), indent=2) + "\n")
    (out / "eyas_fixture.json").write_text(json.dumps(info, indent=2) + "\n")


def build_kimi_fixture(out: Path | None = None, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """The trained tiny Kimi-K2.5-shaped target (cached; a first build takes about 3 minutes on CPU)."""
    return _cached(KIND, {**KIMI_CONFIG, "source_sha256": source_digest()}, seed, cache_dir, _build_kimi, out)


if __name__ == "__main__":
    print(build_kimi_fixture())
