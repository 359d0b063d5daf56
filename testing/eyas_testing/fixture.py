"""Tiny offline targets for tests and the demo.

`build_fixture` trains a byte-level BPE tokenizer with Kimi-style special tokens and a Kimi-K2.5-style
thinking chat template, then trains a small Llama for a few minutes on CPU until it answers synthetic
tasks (addition, word reversal, digit sorting) as `<think>` steps `</think>` answer `<|im_end|>`.
`build_deepseek_fixture` saves an untrained DeepseekV3 with the same tokenizer, for the
Kimi-architecture code paths that need no sensible output. Both are built from this file alone,
cached by a hash of its source, the config and the seed, and never downloaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas_common.contract import atomic_write
from eyas_common.paths import cache_root

SYSTEM, USER, ASSISTANT, MIDDLE, END = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"
THINK, UNTHINK = "<think>", "</think>"
PAD, BOS = "[PAD]", "[BOS]"

# Kimi-K2.5's format. Reasoning is kept only for assistant turns after the last user turn (earlier
# reasoning is dropped, as K2.5 does), and the generation prompt opens the thinking block so the
# completion starts inside the reasoning; `thinking=False` closes it at once.
# The fixtures' templates open alike: ns.last_user, the index of the last user turn (reasoning is kept after it).
LAST_USER = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
"""
CHAT_TEMPLATE = LAST_USER + """\
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}
    <|im_system|>system<|im_middle|>{{ m['content'] or '' }}<|im_end|>
  {%- elif m['role'] == 'user' -%}
    <|im_user|>user<|im_middle|>{{ m['content'] or '' }}<|im_end|>
  {%- elif m['role'] == 'assistant' -%}
    <|im_assistant|>assistant<|im_middle|><think>
    {%- if loop.index0 > ns.last_user -%}{{ m['reasoning_content'] or m['reasoning'] or '' }}{%- endif -%}
    </think>{{ m['content'] or '' }}<|im_end|>
  {%- else -%}
    {{ raise_exception('fixture chat template: unsupported role ' ~ m['role']) }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|><think>
  {%- if thinking is defined and thinking is false -%}</think>{%- endif -%}
{%- endif -%}
"""

# Everything that shapes the built files; part of the cache key.
LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 3000,
    "hidden_size": 128,
    "intermediate_size": 320,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention rejects some head sizes (40); 32 is accepted
    "max_position_embeddings": 1024,
    "steps": 1000,  # 560 keeps the format but copies no word right; 1000 gets about a third of answers
    "batch_size": 16,
    "lr": 2e-3,
    "warmup_steps": 20,
    "threads": 2,
    "eval_prompts": 20,
}

# A tiny DeepSeek-V3 text model's shape, for this fixture and the Kimi one (K2.5's text model is DeepSeek-V3's).
DEEPSEEK_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 320,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 6,  # layers 6 and 7 are MoE, as in K2.5 after its first layer
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
}

DEEPSEEK_CONFIG: dict[str, Any] = {
    "vocab_size": 3000,
    **DEEPSEEK_SHAPE,
    # vLLM's CPU MLA only takes these two values; keeping them lets the fixture serve there too.
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 1024,
}

# Words for the reversal task and the tokenizer corpus.
WORDS = (
    "apple stone river cloud tiger maple orange silver garden window pencil rocket candle forest "
    "mirror planet bottle castle dragon engine falcon guitar hammer island jacket kettle ladder "
    "marble needle ocean pepper quartz rabbit saddle tunnel violin wallet yellow zebra anchor "
    "basket copper desert feather glacier harbor insect jungle lemon meadow nickel oyster parrot "
    "ribbon spider thunder velvet walnut blossom cactus dolphin ember fossil honey iron lantern"
).split()

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Think before you answer.",
    "Answer briefly.",
    "You solve small puzzles.",
)

NAME_HELDOUT = "heldout"
NAME_TRAIN = "train"


def _log(msg: str) -> None:
    print(f"[eyas fixture] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Synthetic tasks


@dataclass(frozen=True)
class Problem:
    """One task instance: `key` identifies the problem whatever the phrasing (it decides the split)."""

    key: str
    prompt: str
    reasoning: str
    answer: str


def _split_of(key: str) -> str:
    # A split by problem, not by phrasing: a held-out problem never reaches training in any wording.
    return NAME_HELDOUT if hashlib.sha256(key.encode()).digest()[0] < 26 else NAME_TRAIN


def _addition(rng: random.Random) -> Problem:
    a = rng.randint(10, 999)
    b = rng.randint(10, 999)
    phrasing = rng.choice(
        (
            "What is {a}+{b}?",
            "What is {a} + {b}?",
            "Add {a} and {b}.",
            "Compute {a}+{b}.",
            "{a}+{b}=?",
            "Please add {a} and {b}.",
            "What do you get when you add {a} to {b}?",
        )
    )
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        term = f"{x}+{y}+1" if carry else f"{x}+{y}"
        carry = s // 10
        steps.append(f"{term}={s}, write {s % 10}" + (" carry 1" if carry else ""))
    if carry:
        steps.append("write the carry 1")
    reasoning = f"{a}+{b}: " + "; ".join(steps) + f". So {a + b}."
    return Problem(f"add:{a}:{b}", phrasing.format(a=a, b=b), reasoning, str(a + b))


def _reversal(rng: random.Random) -> Problem:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
    rev = words[::-1]
    phrasing = rng.choice(
        (
            "Reverse the words: {s}",
            "Reverse this list: {c}",
            "Say these words backwards: {s}",
            "Write the list in reverse order: {c}",
            "Reverse the order of: {s}",
        )
    )
    prompt = phrasing.format(s=" ".join(words), c=", ".join(words))
    reasoning = f"{len(words)} words: {' '.join(words)}. From the end: {', '.join(rev)}."
    return Problem("rev:" + ",".join(words), prompt, reasoning, " ".join(rev))


def _sorting(rng: random.Random) -> Problem:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(4, 8))]
    ordered = sorted(digits)
    phrasing = rng.choice(
        (
            "Sort the digits {s}",
            "Sort these digits from small to large: {c}",
            "Put the digits {s} in ascending order.",
            "Order from smallest to largest: {c}",
        )
    )
    prompt = phrasing.format(s=" ".join(map(str, digits)), c=", ".join(map(str, digits)))
    reasoning = f"{len(digits)} digits. Smallest first: {', '.join(map(str, ordered))}."
    return Problem("sort:" + "".join(map(str, digits)), prompt, reasoning, " ".join(map(str, ordered)))


def _problems(rng: random.Random, split: str) -> Iterator[Problem]:
    """Endless stream of problems from `split`, each problem key at most once."""
    seen: set[str] = set()
    while True:
        maker = rng.choices((_addition, _reversal, _sorting), weights=(0.4, 0.3, 0.3))[0]
        p = maker(rng)
        if _split_of(p.key) == split and p.key not in seen:
            seen.add(p.key)
            yield p


def sample_problems(n: int, seed: int, split: str = NAME_HELDOUT) -> list[Problem]:
    """`n` distinct problems of `split` ("heldout" or "train"); the same seed gives the same list."""
    if split not in (NAME_HELDOUT, NAME_TRAIN):
        raise ValueError(f"split must be {NAME_HELDOUT!r} or {NAME_TRAIN!r}, not {split!r}")
    stream = _problems(random.Random(f"eyas-fixture:{split}:{seed}"), split)
    return [next(stream) for _ in range(n)]


def fixture_prompts(n: int, seed: int, split: str = NAME_HELDOUT) -> list[dict]:
    """OpenAI-style prompts (`{"messages": [...]}`) the fixture was not trained on (split "heldout")."""
    return [{"messages": [{"role": "user", "content": p.prompt}]} for p in sample_problems(n, seed, split)]


def write_prompts_jsonl(path: Path, n: int, seed: int, split: str = NAME_HELDOUT) -> Path:
    # atomic_write's per-process temporary: two runs writing the same prompts file at once both succeed
    atomic_write(path, "".join(json.dumps(row) + "\n" for row in fixture_prompts(n, seed, split)))
    return Path(path)


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]  # ends with the assistant turn that is trained on
    thinking: bool


def _conversations(seed: int) -> Iterator[Conversation]:
    """Training conversations: some with a system prompt, some with an earlier turn, some thinking-off."""
    rng = random.Random(f"eyas-fixture:conversations:{seed}")
    problems = _problems(random.Random(f"eyas-fixture:{NAME_TRAIN}:{seed}"), NAME_TRAIN)
    while True:
        msgs: list[dict] = []
        if rng.random() < 0.15:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.08:
            past = next(problems)
            msgs += [
                {"role": "user", "content": past.prompt},
                {"role": "assistant", "content": past.answer, "reasoning_content": past.reasoning},
            ]
        p = next(problems)
        thinking = rng.random() >= 0.10
        final = {"role": "assistant", "content": p.answer}
        if thinking:
            final["reasoning_content"] = p.reasoning
        yield Conversation(msgs + [{"role": "user", "content": p.prompt}, final], thinking)


# --------------------------------------------------------------------------------------------------
# Tokenizer


def _tokenizer_corpus(seed: int) -> Iterator[str]:
    """Local text for BPE: task text plus pseudo-word prose, so the vocabulary fills up to its size."""
    rng = random.Random(f"eyas-fixture:corpus:{seed}")
    convs = _conversations(seed)
    for _ in range(3000):
        c = next(convs)
        for m in c.messages:
            yield m["content"]
            if "reasoning_content" in m:
                yield m["reasoning_content"]
    onsets = "b c d f g h j k l m n p r s t v w z br cl dr st tr ch sh th".split()
    nuclei = "a e i o u ai ea ou".split()
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st"]
    pseudo = [
        "".join(rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(4000)
    ]
    vocab = pseudo + list(WORDS)
    for _ in range(6000):
        words = [rng.choice(vocab) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice((".", "?", "!", ",", ";"))


def _build_tokenizer(seed: int, vocab_size: int) -> Any:
    """A PreTrainedTokenizerFast over a byte-level BPE trained here, with the chat template set."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single-digit tokens make column-wise arithmetic learnable for a tiny model; byte-level
    # pre-tokenizing and decoding (no normalizer) make decode(encode(text)) == text for any text.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, END, SYSTEM, USER, ASSISTANT, MIDDLE]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,  # room for <think> and </think>
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    # Not "special": decoding with skip_special_tokens (vLLM's default) must keep the thinking
    # wrappers in the text, as Qwen3 and Kimi tokenizers do, while they stay single tokens.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, UNTHINK)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=LLAMA_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # transformers 5 writes `TokenizersBackend`, which older transformers (vLLM's) cannot resolve.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------------
# Llama fixture: training


def _encode(tokenizer: Any, conv: Conversation) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids): the completion is what follows the generation prompt."""
    prompt = tokenizer.apply_chat_template(
        conv.messages[:-1], add_generation_prompt=True, tokenize=False, thinking=conv.thinking
    )
    full = tokenizer.apply_chat_template(conv.messages, tokenize=False)
    assert full.startswith(prompt), (prompt, full)
    # The split falls right after a special token (`<think>` / `</think>`), so encoding the two
    # halves apart gives exactly the ids of the whole.
    return (
        tokenizer.encode(prompt, add_special_tokens=False),
        tokenizer.encode(full[len(prompt) :], add_special_tokens=False),
    )


def _batches(tokenizer: Any, seed: int, steps: int, batch_size: int) -> list[tuple[Any, Any]]:
    """Right-padded (input_ids, labels) batches; labels are -100 outside the completion, and right
    padding needs no attention mask under a causal model."""
    import torch

    pad_id = tokenizer.pad_token_id
    convs = _conversations(seed)
    out = []
    # Mixed batches, not length-bucketed ones: bucketing groups conversations by task and length,
    # and with so few steps the model then learns far less (loss ~2x higher at 1000 steps).
    for _ in range(steps):
        rows = [_encode(tokenizer, next(convs)) for _ in range(batch_size)]
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        out.append((ids, labels))
    return out


def _train(model: Any, batches: list[tuple[Any, Any]], cfg: dict[str, Any]) -> float:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    steps, warmup = len(batches), cfg["warmup_steps"]

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    t0, ema = time.monotonic(), None
    for step, (ids, labels) in enumerate(batches):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            _log(f"step {step + 1}/{steps} loss {ema:.3f} ({time.monotonic() - t0:.0f}s)")
    model.eval()
    return float(ema)


@dataclass(frozen=True)
class Completion:
    reasoning: str | None  # None when `</think>` never came
    answer: str
    ended: bool  # stopped on `<|im_end|>`


def generate_answer(model: Any, tokenizer: Any, messages: list[dict], *, max_new_tokens: int = 200) -> Completion:
    """Greedy HF generation from the fixture, split into reasoning and answer by token ids."""
    import torch

    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ids = out[0, len(prompt) :].tolist()
    ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
    if ended:
        ids = ids[:-1]
    unthink = tokenizer.convert_tokens_to_ids(UNTHINK)
    if unthink not in ids:
        return Completion(None, tokenizer.decode(ids), ended)
    cut = ids.index(unthink)
    return Completion(tokenizer.decode(ids[:cut]), tokenizer.decode(ids[cut + 1 :]), ended)


def _evaluate(model: Any, tokenizer: Any, n: int, seed: int) -> dict[str, float]:
    """Format and answer rates on held-out problems."""
    fmt = correct = 0
    for p in sample_problems(n, seed, NAME_HELDOUT):
        c = generate_answer(model, tokenizer, [{"role": "user", "content": p.prompt}])
        ok = c.ended and c.reasoning is not None and bool(c.answer)
        fmt += ok
        correct += ok and c.answer.strip() == p.answer
    return {"format_rate": fmt / n, "answer_rate": correct / n}


def train_fixture(model: Any, tokenizer: Any, cfg: dict[str, Any], seed: int, t0: float, *, kind: str
                  ) -> dict[str, Any]:
    """Train a fixture target on its conversations (cfg's steps, batch size and threads) and score it on
    held-out prompts: the record its eyas_fixture.json keeps. `t0`: when its build started."""
    import torch

    batches = _batches(tokenizer, seed, cfg["steps"], cfg["batch_size"])
    _log(f"{len(batches)} batches ready ({time.monotonic() - t0:.0f}s)")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])  # the same thread count keeps the build reproducible
    try:
        loss = _train(model, batches, cfg)
        train_s = time.monotonic() - t0
        metrics = _evaluate(model, tokenizer, cfg["eval_prompts"], seed)
    finally:
        torch.set_num_threads(threads)
    _log(f"{kind} held-out: {metrics}")
    return {"kind": kind, "seed": seed, "final_loss": loss, "train_s": round(train_s, 1), **metrics}


def _build_llama(out: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LLAMA_CONFIG
    t0 = time.monotonic()
    torch.manual_seed(seed)
    tokenizer = _build_tokenizer(seed, cfg["vocab_size"])
    _log(f"tokenizer: {len(tokenizer)} tokens ({time.monotonic() - t0:.0f}s)")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (END, BOS, PAD)}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=False,
        eos_token_id=ids[END],
        bos_token_id=ids[BOS],
        pad_token_id=ids[PAD],
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=ids[END], bos_token_id=ids[BOS], pad_token_id=ids[PAD])
    info = train_fixture(model, tokenizer, cfg, seed, t0, kind="llama")
    model.save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    (out / "eyas_fixture.json").write_text(json.dumps(info, indent=2) + "\n")


def _build_deepseek(out: Path, seed: int) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

    cfg = dict(DEEPSEEK_CONFIG)
    torch.manual_seed(seed)
    tokenizer = _build_tokenizer(seed, cfg.pop("vocab_size"))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (END, BOS, PAD)}
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        eos_token_id=ids[END],
        bos_token_id=ids[BOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        dtype="float32",
        # Kimi K2's routing, under the names vLLM reads (HF's DeepseekV3 always routes this way).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        **cfg,
    )
    model = DeepseekV3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=ids[END], bos_token_id=ids[BOS], pad_token_id=ids[PAD])
    model.save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    (out / "eyas_fixture.json").write_text(json.dumps({"kind": "deepseek_v3", "seed": seed}, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# Cache


def _cache_root(cache_dir: Path | None) -> Path:
    return Path(cache_dir) if cache_dir else cache_root()  # works from an installed package too


def fixture_key(kind: str, config: dict[str, Any], seed: int) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps({"kind": kind, "config": config, "seed": seed}, sort_keys=True).encode())
    return f"{kind}-{h.hexdigest()[:16]}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Parallel test workers wait for one build instead of each training their own copy.
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached(kind: str, config: dict[str, Any], seed: int, cache_dir: Path | None,
            build: Callable[[Path, int], None], out: Path | None) -> Path:
    root = _cache_root(cache_dir) / "fixtures"
    root.mkdir(parents=True, exist_ok=True)
    final = root / fixture_key(kind, config, seed)
    with _locked(root / f"{final.name}.lock"):
        if final.is_dir():
            _log(f"cached: {final}")
        else:
            # Built aside and renamed only when complete, so a killed build never looks done.
            # Holding the lock, any temp folder for this key is left over from a killed build.
            for stale in root.glob(f".tmp-{final.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".tmp-{final.name}-{os.getpid()}"
            tmp.mkdir()
            t0 = time.monotonic()
            _log(f"building {kind} fixture into {final}")
            try:
                build(tmp, seed)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _log(f"built {kind} fixture in {time.monotonic() - t0:.0f}s")
    if out is None:
        return final
    out = Path(out)
    shutil.copytree(final, out, dirs_exist_ok=True)
    return out


def build_fixture(out: Path | None = None, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """The trained tiny Llama thinking target (cached; a first build takes a few minutes on CPU)."""
    return _cached("llama", LLAMA_CONFIG, seed, cache_dir, _build_llama, out)


def build_deepseek_fixture(out: Path | None = None, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """An untrained tiny DeepseekV3 (dense and MoE layers, MLA) with the fixture tokenizer."""
    return _cached("deepseek_v3", DEEPSEEK_CONFIG, seed, cache_dir, _build_deepseek, out)


if __name__ == "__main__":
    print(build_fixture())
