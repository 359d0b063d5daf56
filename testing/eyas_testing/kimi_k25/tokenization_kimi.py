"""A tiktoken-based tokenizer in the shape of Kimi-K2.5's (shipped with the model as remote code).

Written for eyas's offline fixture target. The base vocabulary is a tiktoken BPE file (`tiktoken.model`:
one `base64(token bytes) rank` per line); 256 special slots follow it, as in Kimi's layout, named in
tokenizer_config.json's `added_tokens_decoder`. Base tokens are shown as byte-level strings (GPT-2's
byte-to-unicode map), so `convert_tokens_to_string` recovers the exact bytes of any text.
"""

from __future__ import annotations

import base64
import os
import shutil
from functools import lru_cache

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
NUM_SPECIAL_SLOTS = 256
# Slots of the named special tokens after the base vocabulary (Kimi's order; the rest are reserved).
NAMED_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                  10: "<|im_system|>", 17: "<|im_middle|>", 22: "<think>", 23: "</think>",
                  254: "[UNK]", 255: "[PAD]"}
# Kept in decoded text even with skip_special_tokens (servers decode that way): reasoning wrappers.
NOT_SKIPPED = frozenset({"<think>", "</think>"})
# Words, single digits (small models learn column arithmetic on them), punctuation runs, whitespace.
PAT_STR = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(visible, chars)}


def special_names(num_base: int) -> dict[int, str]:
    return {num_base + i: NAMED_SPECIALS.get(i, f"<|reserved_token_{i}|>") for i in range(NUM_SPECIAL_SLOTS)}


def load_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 unk_token: str = "[UNK]", pad_token: str = "[PAD]", added_tokens_decoder: dict | None = None,
                 **kwargs):
        self.vocab_file = vocab_file
        ranks = load_ranks(vocab_file)
        self.num_base_tokens = len(ranks)
        names = special_names(self.num_base_tokens)
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens={name: i for i, name in names.items()})
        to_char = byte_to_char()
        self.decoder = {rank: "".join(to_char[b] for b in token) for token, rank in ranks.items()}
        self.encoder = {s: i for i, s in self.decoder.items()}
        self.char_to_byte = {c: b for b, c in to_char.items()}
        if not added_tokens_decoder:
            added_tokens_decoder = {i: AddedToken(name, special=name not in NOT_SKIPPED, normalized=False)
                                    for i, name in names.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + NUM_SPECIAL_SLOTS

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self.encoder)
        vocab.update({t.content: i for i, t in self._added_tokens_decoder.items()})
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # Special tokens were split off by the base class; what is left is ordinary text.
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        if index in self.decoder:
            return self.decoder[index]
        return self._added_tokens_decoder[index].content

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for t in tokens:
            if t in self.encoder:
                data += bytes(self.char_to_byte[c] for c in t)
            else:
                data += t.encode()
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
