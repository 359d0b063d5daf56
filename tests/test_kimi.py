"""The Kimi-K2.5-shaped fixture (eyas_testing.fixture_kimi) and the whole chain on it: remote code only
with --trust-remote-code, the tiktoken tokenizer and K2.5 template, the wrapper found by structure,
synth from eyas_testing.hf_server, validate, extract, train (embedding and lm_head from
`language_model.*`), eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from eyas_common.chat import ChatTokens, load_tokenizer, render_prompt
from eyas_common.contract import Dataset, DatasetError
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.fixture_kimi import KIMI_CONFIG, build_kimi_fixture
from eyas_testing.servers import running_hf_server

# its fixture is a model trained on first use (about 3 minutes here): not in `make test-fast`
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kimi() -> Path:
    return build_kimi_fixture()


@pytest.fixture(scope="module")
def tok(kimi: Path):
    return load_tokenizer(kimi, trust_remote_code=True)


def test_layout_is_kimi_k25s(kimi: Path) -> None:
    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k25.KimiK25ForConditionalGeneration"
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and cfg["text_config"]["n_routed_experts"] == 8
    with safe_open(kimi / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert {k.split(".")[0] for k in names} == {"language_model", "vision_tower", "mm_projector"}
    assert any(k.startswith("language_model.model.layers.7.mlp.experts.") for k in names)  # MoE layer
    assert "language_model.lm_head.weight" in names and "language_model.model.embed_tokens.weight" in names
    assert (kimi / "tiktoken.model").is_file() and (kimi / "tokenization_kimi.py").is_file()


def test_remote_code_only_when_trusted(kimi: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers 5 knows a `kimi_k25` config of its own, but no causal-LM class for it: the model
    # loads only through the folder's code, and then with the folder's config class.
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(str(kimi), trust_remote_code=False)
    assert type(AutoConfig.from_pretrained(str(kimi), trust_remote_code=True)).__module__.endswith(
        "configuration_kimi_k25") and "transformers_modules" in type(
        AutoConfig.from_pretrained(str(kimi), trust_remote_code=True)).__module__
    with pytest.raises(DatasetError, match="pass --trust-remote-code"):
        load_tokenizer(kimi)


@pytest.mark.parametrize("text", ["What is 347+38?", "  spaces  \n\n\ttabs\r\n", "naïve café 東京 🙂 — done",
                                  "<|im_user|>user<|im_middle|>hi<|im_end|><think>a</think>b", ""])
def test_tiktoken_tokenizer_round_trips(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and tok.encode(text) == ids


def test_special_tokens_and_template(tok) -> None:
    assert type(tok).__name__ == "TikTokenTokenizer" and len(tok) == KIMI_CONFIG["base_vocab"] + 256
    for t in ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>", "<think>", "</think>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] >= KIMI_CONFIG["base_vocab"], t
    ids = tok.encode("<think>x</think>y<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>y"
    user = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    head = "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False) == head + "<think>"
    assert tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False, thinking=False) == head + "<think></think>"
    past = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
            {"role": "user", "content": "c"}]
    assert "<think></think>b" in tok.apply_chat_template(past, tokenize=False)  # earlier reasoning is dropped


def test_trained_to_answer_in_its_format(kimi: Path, tok) -> None:
    info = json.loads((kimi / "eyas_fixture.json").read_text())
    print(f"kimi fixture: {info}")
    assert info["format_rate"] >= 0.5


def test_chain_end_to_end(kimi: Path, tmp_path: Path) -> None:
    from eyas_extract.run import run as extract
    from eyas_synth.cli import main as synth_cli
    from eyas_synth.run import run as synth
    from eyas_synth.validate import validate
    from eyas_train.eval import evaluate
    from eyas_train.train import run as train

    torch.set_num_threads(2)
    root = tmp_path / "data"
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 24, seed=11, split="train")
    r = CliRunner().invoke(synth_cli, ["run", "--prompts", str(prompts), "--name", "k", "--model", str(kimi),
                                       "--server", "http://127.0.0.1:9"], env={"EYAS_DATA": str(root)})
    assert r.exit_code != 0 and "pass --trust-remote-code" in r.output and "Traceback" not in r.output
    with running_hf_server(kimi, log_path=tmp_path / "server.log", trust_remote_code=True) as server:
        stats = synth(prompts=prompts, name="k", model=kimi, servers=[server.url], max_tokens=160, temperature=0.0,
                      concurrency=2, trust_remote_code=True, allow_rejected="8", data_root=root, progress=False)
    print(f"synth: {stats['samples']} samples, {stats['rejected']} rejected, {stats['completion_tokens']} tokens")
    assert stats["samples"] >= 16 and stats["failed"] == 0
    synth_m = Dataset.parse("k", "synth", root).read_manifest()
    assert synth_m["params"]["trust_remote_code"] is True
    report = validate("k", model=kimi, trust_remote_code=True, data_root=root)
    assert report["bad"] == [] and report["samples"] == stats["samples"]

    extract(synth="synth/k", model=kimi, name="k", trust_remote_code=True, data_root=root, progress=False,
            shard_samples=8, batch_tokens=1024)
    hidden_m = Dataset.parse("k", "hidden", root).read_manifest()
    assert hidden_m["status"] == "complete" and hidden_m["params"]["trust_remote_code"] is True
    assert hidden_m["params"]["layers"] == [2, 4, 5] and hidden_m["params"]["hidden_size"] == 128

    train(hidden="hidden/k", model=kimi, name="k", data_root=root, trust_remote_code=True, epochs=4,
          draft_vocab=512, ttt_steps=3, batch_size=4, lr=3e-3, log_every=4)
    drafts_m = Dataset.parse("k", "drafts", root).read_manifest()
    assert drafts_m["status"] == "complete" and drafts_m["params"]["config"]["trust_remote_code"] is True
    # Eval on prompts of its synth set (all but 3 validation samples trained on): the target's greedy answers there
    # are the synth answers (temperature 0), so a draft that learnt through the Kimi wrapper's embedding and lm_head
    # is accepted there and a miswired one is not.
    # An untrained draft scores about 1.0 (step-0 accuracy 0.05 at a fresh start, tests/test_init_draft.py); this
    # recipe on 24 samples of the Llama fixture ends at step-0 accuracy 0.38 there, worth about 1.4.
    result = evaluate(draft="drafts/k", model=kimi, prompts=prompts, limit=6, max_tokens=48, trust_remote_code=True,
                      data_root=root)
    print(f"eval: acceptance length {result['acceptance_length']:.2f}, per position {result['per_position']}")
    assert result["drafts"] > 0 and result["acceptance_length"] >= 1.15, result


def test_prompt_rendering_matches_what_the_server_sends(kimi: Path, tok) -> None:
    msgs = [{"role": "user", "content": "What is 12+30?"}]
    ids = render_prompt(tok, msgs)
    assert ids[-1] == tok.convert_tokens_to_ids("<think>") and ChatTokens.of(tok).end_of_turn == tok.eos_token_id


def test_checkpoint_size_counts_routed_experts(kimi: Path) -> None:
    from eyas_common.checkpoint import read_checkpoint_size

    size = read_checkpoint_size(kimi)
    text = size.text
    per_expert = 3 * text["hidden_size"] * text["moe_intermediate_size"]
    moe_layers = text["num_hidden_layers"] - text["first_k_dense_replace"]
    assert size.expert_params == moe_layers * text["n_routed_experts"] * per_expert
    assert size.active_params() == size.params - size.expert_params + moe_layers * 2 * per_expert
