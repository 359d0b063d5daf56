"""The conformance matrix: every thinking style a target comes in, against every way a server splits its text.

Each cell runs `eyas-synth run` with its defaults and must end complete and token-exact, checked independently
of eyas (the prompt ids are transformers' own rendering, and each answer re-rendered as an assistant turn through
the chat template is the text of its ids), or be refused in one line before the run spends more than a handful
of requests. Real vLLM serves every cell it can (`vllm` marker); the stub plays the servers it cannot (no token
ids, a parser that calls a whole answer reasoning) and every cell once more in the fast tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas_common.chat import THINK_CLOSE, THINK_OPEN, ChatTokens, load_tokenizer
from eyas_common.contract import Dataset, DatasetError, iter_jsonl
from eyas_common.samples import SAMPLES
from eyas_synth.run import run as synth
from eyas_testing.fixture import fixture_prompts
from eyas_testing.servers import running_vllm
from eyas_testing.stub import start_stub, vllm_body
from eyas_testing.styles import STYLES, build_style
from helpers import assert_refused

# A prompt file of single-turn questions and multi-turn conversations whose earlier answers carry reasoning.
HISTORY = [{"role": "user", "content": "Reverse the word: apple"},
           {"role": "assistant", "content": "elppa", "reasoning_content": "a-p-p-l-e backwards"}]
N_SINGLE, MAX_TOKENS = 6, 192
# style -> the switch values synth is run with (None: its default, nothing sent)
THINKING = {"qwen3": (None, False)}
# style -> (vLLM's matching parser, a parser for another family); "plain" has no thinking tokens for a parser
PARSERS = {"kimi": ("kimi_k2", "qwen3"), "qwen3": ("qwen3", "kimi_k2"), "opens": ("qwen3", "kimi_k2"),
           "r1": ("deepseek_r1", "kimi_k2"), "plain": (None, None)}
VLLM_CELLS = [(style, parser) for style, (match, other) in PARSERS.items()
              for parser in dict.fromkeys((None, match, other)) if style != "plain" or parser is None]


def write_prompts(path: Path) -> Path:
    rows = [{"messages": p["messages"]} for p in fixture_prompts(N_SINGLE, seed=11)]
    rows += [{"messages": HISTORY + [{"role": "user", "content": q}]} for q in ("What is 12+30?", "Sort: 3 1 2")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def squash(text: str) -> str:
    return "".join(text.split())


def check_exact(ds: Dataset, model: Path, thinking: bool | None) -> dict[str, int]:
    """The dataset is complete and every sample is what the target saw and said, checked without eyas's own
    renderer: transformers renders the prompt, and the answer as an assistant turn renders the text of its ids."""
    manifest = ds.read_manifest()
    assert manifest["status"] == "complete" and manifest["stats"]["rejected"] == 0, manifest["stats"]
    tok = load_tokenizer(model)
    tokens, kw = ChatTokens.of(tok), ({} if thinking is None else {"thinking": thinking, "enable_thinking": thinking})
    seen = {"samples": 0, "thinking": 0, "multi_turn": 0}
    for _, s in iter_jsonl(ds.path / SAMPLES):
        p = s["loss_mask"].index(1)
        prompt, completion = s["input_ids"][:p], s["input_ids"][p:]
        assert sum(s["loss_mask"]) == len(completion) and s["source"] == "server"  # the last answer only
        assert prompt == list(tok.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=True,
                                                      return_dict=False, **kw))
        turn = {"role": "assistant", "content": s["content"], "reasoning_content": s["reasoning"]}
        rendered = tok.apply_chat_template(s["messages"] + [turn], tokenize=False, **kw)
        said = tok.decode(s["input_ids"], skip_special_tokens=False)
        if s["finish_reason"] == "stop" and tokens.think_open is not None:
            assert squash(said) == squash(rendered)[:len(squash(said))], (said, rendered)
        elif s["finish_reason"] == "stop":  # a template that rebuilds the turn from fields the target lacks
            assert tok.decode(completion[:-1], skip_special_tokens=False).strip() == s["content"]
        if len(s["messages"]) > 1:
            seen["multi_turn"] += 1
            assert "a-p-p-l-e" not in tok.decode(prompt)  # earlier reasoning: dropped, as the template does
        seen["thinking"] += bool(s["reasoning"])
        seen["samples"] += 1
    assert seen["samples"] == N_SINGLE + 2 and seen["multi_turn"] == 2
    return seen


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("conformance") / "prompts.jsonl")


# --- the stub plays each server style, in the fast tier ------------------------------------------------------
def stub_answer(model: Path, split: str, truth: dict[str, list[int]]):
    """A server on MODEL answering `<think>reasoning</think>answer` in the style's own ids (kept in TRUTH by
    question), its text split as SPLIT says: 'parser' (a reasoning field), 'none' (wrappers left in content, as
    no parser or another family's leaves them), 'all_reasoning' (a parser that calls the whole answer reasoning),
    'no_ids' (text only, split by a parser), 'no_ids_bare' (text only, the wrappers dropped)."""
    tok = load_tokenizer(model)
    tokens = ChatTokens.of(tok)

    def answer(payload):
        prompt = list(tok.apply_chat_template(payload["messages"], add_generation_prompt=True, tokenize=True,
                                              return_dict=False, **(payload.get("chat_template_kwargs") or {})))
        text = tok.decode(prompt).rstrip()
        q = payload["messages"][-1]["content"]
        completion = tok.encode(f" The answer to {q}", add_special_tokens=False)
        if tokens.think_open is not None and not text.endswith(THINK_CLOSE):  # thinking not switched off
            think = tok.encode(f"I think about {q}", add_special_tokens=False)
            opened = text.endswith(THINK_OPEN)
            completion = ([] if opened else [tokens.think_open]) + think + [tokens.think_close] + completion
        completion += [tokens.end_of_turn]
        truth[q] = prompt + completion
        whole = tok.decode(completion[:-1], skip_special_tokens=True)
        reasoning, content = None, whole
        if split in ("parser", "no_ids") and THINK_CLOSE in whole:
            head, _, content = whole.partition(THINK_CLOSE)
            reasoning = head.replace(THINK_OPEN, "").strip()
        elif split == "all_reasoning":
            reasoning, content = whole, ""
        elif split == "no_ids_bare":
            content = whole.replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
        out = vllm_body(content.strip(), prompt, completion, reasoning=reasoning)
        if split.startswith("no_ids"):
            out.pop("prompt_token_ids")
            out["choices"][0].pop("token_ids")
        return out
    return answer


STUB_SPLITS = ("parser", "none", "all_reasoning", "no_ids", "no_ids_bare")


@pytest.mark.parametrize("split", STUB_SPLITS)
@pytest.mark.parametrize("style", list(STYLES))
def test_stub_cell(style, split, prompts, tmp_path):
    """Every style x server split: complete and exact with the defaults, or refused in one line early."""
    model = build_style(style)
    for thinking in THINKING.get(style, (None,)):
        name, truth = f"{style}-{split}-{thinking}", {}
        with start_stub(answer=stub_answer(model, split, truth)) as stub:
            run = dict(prompts=prompts, name=name, model=model, servers=[stub.url], max_tokens=MAX_TOKENS,
                       thinking=thinking, served_model="fixture", data_root=tmp_path, progress=False)
            if split == "no_ids_bare" and style in ("kimi", "r1"):
                # text only, and nothing in it says where the block the prompt opens ends: refused after the
                # first 8 requests, though 64 were asked for at 128 in flight
                with pytest.raises(DatasetError) as e:
                    synth(**{**run, "n": 64})
                assert_refused(e.value, "SYNTH_NOT_EXACT", stub.url)
                assert stub.counts()["ok"] == 8
                continue
            if split == "no_ids_bare":
                continue  # the wrappers are plain text to these tokenizers: no server drops them
            synth(**run)
        samples = {s["messages"][-1]["content"]: s for _, s in iter_jsonl(tmp_path / "synth" / name / SAMPLES)}
        if split.startswith("no_ids"):  # rendered from text: the same tokens, but for whitespace the text lost
            tok = load_tokenizer(model)
            assert {s["source"] for s in samples.values()} == {"rendered"}
            assert all(squash(tok.decode(s["input_ids"])) == squash(tok.decode(truth[q])) for q, s in samples.items())
            continue
        assert all(s["input_ids"] == truth[q] for q, s in samples.items())  # token-exact
        seen = check_exact(Dataset.parse(name, "synth", tmp_path), model, thinking)
        assert seen["thinking"] == (0 if style == "plain" or thinking is False else seen["samples"])


# --- real vLLM, each cell it can serve ------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("style,parser", VLLM_CELLS, ids=[f"{s}-{p or 'none'}" for s, p in VLLM_CELLS])
def test_vllm_cell(style, parser, prompts, tmp_path):
    """A style served by real vLLM with no reasoning parser, its own, or another family's."""
    model = build_style(style)
    args = ["--enforce-eager", *(["--reasoning-parser", parser] if parser else [])]
    with running_vllm(model, log_path=tmp_path / "vllm.log", timeout_s=600, extra_args=args) as server:
        for thinking in THINKING.get(style, (None,)):
            name = f"{style}-{parser}-{thinking}"
            synth(prompts=prompts, name=name, model=model, servers=[server.url], max_tokens=MAX_TOKENS,
                  temperature=0.0, thinking=thinking, concurrency=8, data_root=tmp_path, progress=False)
            seen = check_exact(Dataset.parse(name, "synth", tmp_path), model, thinking)
            print(json.dumps({"cell": [style, parser, thinking], **seen}))


# --- what synth kept, taken by the stages after it ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("style", list(STYLES))
def test_extract_and_train_take_every_style(style, prompts, tmp_path):
    """Extraction stores each kept sample's ids and loss mask as synth wrote them (the answer tokens as the
    template renders them, the last turn only), and a draft trains on them."""
    import torch
    from safetensors.torch import load_file

    from eyas_common.hidden import open_hidden
    from eyas_extract.run import run as extract
    from eyas_train.train import run as train

    model = build_style(style)
    with start_stub(answer=stub_answer(model, "none", {})) as stub:
        synth(prompts=prompts, name=style, model=model, servers=[stub.url], max_tokens=MAX_TOKENS,
              served_model="fixture", data_root=tmp_path, progress=False)
    kept = {s["id"]: s for _, s in iter_jsonl(tmp_path / "synth" / style / SAMPLES)}
    extract(synth=f"synth/{style}", model=model, name=style, data_root=tmp_path, progress=False)
    shards = open_hidden(f"hidden/{style}", tmp_path)
    assert sorted(shards.sample_ids) == sorted(kept)
    for ref in shards.samples:
        row = shards.read(ref, max_len=10_000)
        assert row["input_ids"].tolist() == kept[ref.sample_id]["input_ids"]
        assert row["loss_mask"].tolist() == kept[ref.sample_id]["loss_mask"]
    draft = train(hidden=f"hidden/{style}", model=model, name=style, data_root=tmp_path, draft_vocab=256,
                  batch_size=4, epochs=1, ttt_steps=2, lr=3e-3, val_samples=0, log_every=10, ckpt_every=1000)
    assert Dataset.parse(style, "drafts", tmp_path).read_manifest()["status"] == "complete"
    weights = load_file(Path(draft) / "model.safetensors")
    assert weights["lm_head.weight"].shape[0] == 256 and all(torch.isfinite(w.float()).all() for w in weights.values())
