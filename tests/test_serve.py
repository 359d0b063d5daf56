"""Stage 04 without a running engine: the engine command lines against the flags each engine defines, the
metric parsers against recorded real responses, the bench dataset format, and the refusals that must
come before any server starts (a draft for another target, a taken port, a prompts file with nothing
usable in it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eyas_common.bench import PLOT, RESULTS, read_results, start, validate_results, write_results
from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import Dataset, DatasetError, finalize, new_manifest, write_json_atomic
from eyas_common.lock import remove
from helpers import assert_refused, refuses
from eyas_testing.servers import default_vllm_python
from eyas_serve.config import LaunchConfig
from eyas_serve.engines import engine_command
from eyas_serve.metrics import SpecCounters, parse_sglang_server_info, parse_vllm_metrics
from eyas_serve.plot import plot_results
from eyas_serve.report import table

DATA = Path(__file__).parent / "data"
EYAS_SERVE = str(Path(sys.executable).parent / "eyas-serve")

# SGLang's launch flags used here, as its ServerArgs dataclass defines them (python/sglang/srt/server_args.py:
# each field `x_y` is the flag `--x-y`). SGLang has no CPU build for this machine, so it cannot parse them here.
SGLANG_FLAGS = {"--model-path", "--host", "--port", "--tp-size", "--disable-custom-all-reduce",
                "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--mem-fraction-static"}


def cfg(**kw) -> LaunchConfig:
    return LaunchConfig(**{"engine": "vllm", "model": "/models/target", "python": "python3", **kw})


def test_sglang_command_uses_its_documented_flags():
    cmd = engine_command(cfg(engine="sglang", tp=8, spec_tokens=3, disable_custom_all_reduce=True,
                             engine_args=("--mem-fraction-static", "0.8")), Path("/data/drafts/d"))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = [c for c in cmd if c.startswith("--")]
    assert set(flags) <= SGLANG_FLAGS, set(flags) - SGLANG_FLAGS
    opts = dict(zip(cmd, cmd[1:]))
    assert opts["--speculative-algorithm"] == "EAGLE3" and opts["--speculative-draft-model-path"] == "/data/drafts/d"
    # a chain of 3 steps at top-k 1 verifies 3 + 1 tokens
    assert (opts["--speculative-num-steps"], opts["--speculative-eagle-topk"], opts["--speculative-num-draft-tokens"]) \
        == ("3", "1", "4")
    assert opts["--tp-size"] == "8" and cmd[-2:] == ["--mem-fraction-static", "0.8"]
    assert "--speculative-algorithm" not in engine_command(cfg(engine="sglang"), None)


@pytest.mark.vllm
def test_vllm_command_parses_with_vllms_own_parser():
    """vLLM's own argument parser (from .venv-vllm) reads the commands eyas builds, to the same values: a
    draft's, and prompt lookup's."""
    draft = engine_command(cfg(tp=2, spec_tokens=3, disable_custom_all_reduce=True,
                               engine_args=("--max-model-len", "1024")), Path("/data/drafts/d"))
    lookup = engine_command(cfg(prompt_lookup=True), None)
    assert draft[1:3] == lookup[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    probe = ("import json, sys\n"
             "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
             "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
             "for argv in json.loads(sys.argv[1]):\n"
             "    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
             "    print(json.dumps({k: getattr(a, k) for k in ('model', 'host', 'port', 'tensor_parallel_size',"
             " 'disable_custom_all_reduce', 'speculative_config', 'max_model_len')}, default=str))\n")
    out = subprocess.run([str(default_vllm_python()), "-c", probe, json.dumps([draft[3:], lookup[3:]])],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    parsed_draft, parsed_lookup = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert parsed_draft == {"model": "/models/target", "host": "127.0.0.1", "port": 8000, "tensor_parallel_size": 2,
                            "disable_custom_all_reduce": True, "max_model_len": 1024,
                            "speculative_config": {"method": "eagle3", "model": "/data/drafts/d",
                                                   "num_speculative_tokens": 3}}
    assert parsed_lookup["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _sample(text: str, name: str, position: int | None = None) -> float:
    """One counter read by hand from the recorded page (summed over its label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and (position is None or f'position="{position}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_vllm_metrics_recorded_from_a_real_server():
    text = (DATA / "vllm_metrics_eagle3.txt").read_text()
    c = parse_vllm_metrics(text)
    drafts = _sample(text, "vllm:spec_decode_num_drafts_total")
    assert drafts > 0 and c.drafts == drafts
    assert c.accepted == _sample(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert c.draft_tokens == _sample(text, "vllm:spec_decode_num_draft_tokens_total") == 3 * drafts
    assert c.per_position == tuple(_sample(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", i)
                                   for i in range(3))
    assert sum(c.per_position) == c.accepted
    s = c.summary()
    assert s["acceptance_length"] == pytest.approx(1 + c.accepted / c.drafts)
    assert s["per_position"] == pytest.approx([p / drafts for p in c.per_position])
    # the same server's page, read later: the difference is what happened in between
    later = SpecCounters(c.drafts + 10, c.draft_tokens + 30, c.accepted + 25, tuple(p + d for p, d in
                                                                                    zip(c.per_position, (10, 9, 6))))
    assert (later - c).summary()["acceptance_length"] == pytest.approx(3.5)
    assert (later - c).summary()["per_position"] == pytest.approx([1.0, 0.9, 0.6])
    # every step of the target, drafted or not: its first-token and later-token latencies, one a step each
    steps = _sample(text, "vllm:time_to_first_token_seconds_count") + _sample(
        text, "vllm:inter_token_latency_seconds_count")
    assert (c.tokens, c.steps) == (_sample(text, "vllm:generation_tokens_total"), steps)
    assert s["tokens_per_step"] == pytest.approx(c.tokens / steps)
    assert c.steps == c.drafts + _sample(text, "vllm:time_to_first_token_seconds_count")  # EAGLE-3 drafts every step
    # 40 more tokens in 20 steps of which 10 carried a draft (a proposer that drafts only on a match)
    sparse = SpecCounters(c.drafts + 10, c.draft_tokens + 30, c.accepted + 20, c.per_position, c.tokens + 40,
                          c.steps + 20)
    assert (sparse - c).summary()["acceptance_length"] == 3.0 and (sparse - c).summary()["tokens_per_step"] == 2.0
    older = "\n".join(line for line in text.splitlines() if "inter_token_latency" not in line)
    assert parse_vllm_metrics(older).summary()["tokens_per_step"] is None  # half the steps would be no figure


def test_a_server_without_a_draft_has_no_spec_metrics():
    text = (DATA / "vllm_metrics_no_draft.txt").read_text()
    assert "vllm:" in text and parse_vllm_metrics(text) is None
    assert SpecCounters(0, 0, 0, (0.0, 0.0)).summary()["acceptance_length"] is None  # nothing drafted: no 1.0


def test_sglang_server_info_shapes():
    info = json.loads((DATA / "sglang_server_info.json").read_text())
    assert parse_sglang_server_info(info) == pytest.approx(3.12)
    assert parse_sglang_server_info({**info, "internal_states": [{"last_gen_throughput": 10.0}]}) is None
    assert parse_sglang_server_info({"avg_spec_accept_length": 2.5}) == 2.5  # older SGLang: top level
    two_ranks = {"internal_states": [{"avg_spec_accept_length": 3.0}, {"avg_spec_accept_length": 2.0}]}
    assert parse_sglang_server_info(two_ranks) == 2.5


# ------------------------------------------------------------------------------------------------
# the bench dataset


def _level(c: int, tps: float) -> dict:
    lat = {"requests": 4, "errors": 0, "output_tokens": 400, "duration_s": 400 / tps, "tokens_per_s": tps,
           "ttft_ms": {"p50": 20.0, "p90": 30.0}, "itl_ms": {"p50": 5.0, "p90": 6.0}}
    spec = {"drafts": 100, "draft_tokens": 300, "accepted": 240, "acceptance_length": 3.4,
            "per_position": [0.9, 0.8, 0.7]}
    return {"concurrency": c, "draft": lat, "baseline": {**lat, "tokens_per_s": tps / 2}, "spec": spec, "speedup": 2.0}


def _draft_dataset(root: Path, model: Path, name: str = "d", hidden_size: int = 128) -> Dataset:
    import numpy as np
    from safetensors.numpy import save_file

    ds = Dataset.parse(name, "drafts", root)
    ds.path.mkdir(parents=True)
    # the keys a server (and eyas_common.drafts.read_config) needs
    write_json_atomic(ds.path / "config.json", {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden_size, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 320, "vocab_size": 3000, "draft_vocab_size": 1024,
        "target_hidden_size": hidden_size, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}})
    # weights of the shapes that config gives (a launch reads their header, not their values)
    h, layer = hidden_size, {"q_proj": (hidden_size, 2 * hidden_size), "k_proj": (hidden_size // 2, 2 * hidden_size),
                             "v_proj": (hidden_size // 2, 2 * hidden_size), "o_proj": (hidden_size, hidden_size)}
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (1024, h), "d2t": (1024,),
              "t2d": (3000,), **{f"midlayer.self_attn.{k}.weight": v for k, v in layer.items()},
              **{f"midlayer.{k}.weight": (h,) for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
              "midlayer.mlp.gate_proj.weight": (320, h), "midlayer.mlp.up_proj.weight": (320, h),
              "midlayer.mlp.down_proj.weight": (h, 320)}
    save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(ds.path / "model.safetensors"))
    m = new_manifest("drafts", stage="03_train", target=target_fingerprint(load_tokenizer(model), model),
                     inputs=[{"ref": "hidden/h", "manifest_sha256": "0" * 64},
                             {"ref": "synth/s", "manifest_sha256": "1" * 64}], params={})
    finalize(ds, m, stats={})
    return ds


def test_bench_dataset_round_trip_and_refusals(tmp_path, fixture_target):
    _draft_dataset(tmp_path, fixture_target)
    out, m = start("b", draft="drafts/d", params={"x": 1}, root=tmp_path)
    assert m["status"] == "partial" and [i["ref"] for i in m["inputs"]] == ["drafts/d", "hidden/h", "synth/s"]
    with refuses("PARTIAL", "bench/b"):
        read_results("bench/b", root=tmp_path)
    results = {"engine": "vllm", "server": "http://a", "baseline": "http://b", "prompts": "p.jsonl",
               "levels": [_level(1, 100.0), _level(4, 300.0)], "spec": _level(1, 1)["spec"], "spec_tokens": 3}
    plot_results(results, out.path / PLOT)
    write_results(out, m, results, stats={})
    ds, manifest, back = read_results("bench/b", root=tmp_path)
    assert back == results and {f["name"] for f in manifest["files"]} == {RESULTS, PLOT}
    text = table(back, manifest)
    assert "acceptance length 3.40 (240 accepted / 100 drafts)" in text and "drafts/d <- hidden/h <- synth/s" in text
    # a server that speculates with no eyas draft named (prompt lookup), and one that does not speculate
    assert "speculates without an eyas draft: --prompt-lookup" in table(back, {**manifest, "inputs": []})
    assert "lineage: (no --draft given) <- target" in table({**back, "spec": None}, {**manifest, "inputs": []})
    with pytest.raises(DatasetError, match="already complete"):
        start("b", draft="drafts/d", params={}, root=tmp_path)
    bad = {**results, "levels": [{**_level(1, 1.0), "draft": {"tokens_per_s": 1.0}}]}
    with pytest.raises(DatasetError, match=r"levels\[0\].draft: needs requests"):
        validate_results(bad)
    with pytest.raises(DatasetError, match="at least 1"):
        validate_results({**results, "spec": {**results["spec"], "acceptance_length": 0.5}})
    with pytest.raises(DatasetError, match=r"tokens_per_step is 0.5; .* at least 1"):
        validate_results({**results, "spec": {**results["spec"], "tokens_per_step": 0.5}})


def test_a_second_bench_writer_is_refused_and_the_first_ones_results_stand(tmp_path):
    """Two `eyas-serve bench --name b` at once: the second is refused, naming the first, before it writes."""
    from eyas_common.lock import WriterLock
    from eyas_serve.bench import run as run_bench
    from eyas_testing.stub import start_stub

    prompts = tmp_path / "p.txt"
    prompts.write_text("a question\n")
    with start_stub() as stub:
        kw = dict(server=stub.url, engine="vllm", prompts=prompts, name="b", concurrency=(1,), warmup=0,
                  max_tokens=8, data_root=tmp_path)
        with WriterLock(Dataset.parse("b", "bench", tmp_path), stage="04_serve"):  # a bench running now
            with pytest.raises(DatasetError, match=rf"bench/b is being written by .*pid {os.getpid()}"):
                run_bench(**kw)
            assert not Dataset.parse("b", "bench", tmp_path).manifest_path.exists()
        assert run_bench(**kw)["levels"][0]["draft"]["requests"] == 1  # once it ended, the bench runs
    assert read_results("bench/b", root=tmp_path)[1]["status"] == "complete"


def _damage(out: Dataset, damage: str) -> None:
    """results.json of a complete bench as a user may leave it: gone, cut short, edited, or edited and hashed again."""
    path = out.path / RESULTS
    text = path.read_text()
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_text(text[:100])
    elif damage == "edited":  # same size, other bytes: only the sha256 tells
        path.write_text(text.replace('"requests": 4', '"requests": 9', 1))
    else:  # a value of the wrong type, in a manifest that hashes it (finalized again by hand)
        results = json.loads(text)
        results["levels"][0]["draft"]["tokens_per_s"] = "fast"
        write_json_atomic(path, results)
        finalize(out, out.read_manifest(), stats={})


@pytest.mark.parametrize("damage, says", [
    ("missing", r"bench/b: results\.json: missing: changed after it was finished; restore it, or "),
    ("truncated", r"bench/b: results\.json: 100 bytes, manifest says \d+: changed after"),
    ("edited", r"bench/b: results\.json: sha256 differs from the manifest: changed after"),
    ("wrong type", r"results\.json: levels\[0\]\.draft\.tokens_per_s is 'fast', not a number"),
])
def test_report_refuses_damaged_results_in_one_line_with_the_fix_that_works(damage, says, tmp_path):
    out, m = start("b", draft=None, params={}, root=tmp_path)
    write_results(out, m, {"engine": "vllm", "server": "http://a", "baseline": "http://b", "prompts": "p.jsonl",
                           "levels": [_level(1, 100.0)], "spec": _level(1, 1)["spec"], "spec_tokens": 3}, stats={})
    _damage(out, damage)
    fix = "remake it: `eyas-data rm bench/b --yes`, then rerun eyas-serve bench"
    for args in ((), ("--json",)):
        r = serve_cli(tmp_path, "report", "b", *args)
        assert r.returncode == 1 and not r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and re.search(says + ".*" + re.escape(fix), r.stderr), r.stderr
    with refuses("ALREADY_COMPLETE", "bench/b"):  # why a rerun alone is not the fix
        start("b", draft=None, params={}, root=tmp_path)
    remove(out)
    assert start("b", draft=None, params={}, root=tmp_path)[1]["status"] == "partial"


def test_a_bench_whose_baseline_produced_no_tokens_finishes_without_a_speedup(tmp_path, capsys, monkeypatch):
    """No baseline tokens/s to divide by: the speedup is null, printed as n/a with the reason, and the bench
    is complete (it crashed on formatting the null, leaving bench/b partial)."""
    from eyas_serve.bench import run as run_bench
    from eyas_testing.stub import start_stub, vllm_body

    (tmp_path / "p.txt").write_text("a question\n")
    monkeypatch.chdir(tmp_path)
    with start_stub() as server, start_stub(answer=lambda payload: vllm_body("", [1, 2], [])) as empty:
        results = run_bench(server=server.url, baseline=empty.url, engine="vllm", prompts=Path("p.txt"), name="b",
                            concurrency=(1,), warmup=0, max_tokens=8, data_root=tmp_path)
    assert results["prompts"] == str(tmp_path / "p.txt")   # as given, "p.txt" read from nowhere later
    assert results["levels"][0]["baseline"]["tokens_per_s"] == 0 and results["levels"][0]["speedup"] is None
    assert "speedup n/a (baseline produced no tokens)" in capsys.readouterr().err
    _, manifest, back = read_results("bench/b", root=tmp_path)
    assert manifest["status"] == "complete"
    text = table(back, manifest)
    assert re.search(r"^ +1 +[\d.]+ +0\.0 +n/a ", text, re.M), text
    assert "speedup at 1 in flight: n/a (baseline produced no tokens)" in text


# ------------------------------------------------------------------------------------------------
# refusals before anything starts (the real CLI)


def serve_cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EYAS_SERVE, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EYAS_DATA": str(root)})


def _other_target(fixture_target: Path, tmp_path: Path, hidden: int | None = None, token: str | None = None) -> Path:
    other = tmp_path / "other_target"
    shutil.copytree(fixture_target, other)
    if hidden is not None:
        cfg_path = other / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "hidden_size": hidden}))
    if token is not None:
        tok = load_tokenizer(other)
        tok.add_special_tokens({"additional_special_tokens": [token]})
        tok.save_pretrained(other)
    return other


@pytest.mark.parametrize("change", ["tokenizer", "hidden_size"])
def test_a_draft_for_another_target_is_refused_before_anything_starts(change, tmp_path, fixture_target):
    _draft_dataset(tmp_path, fixture_target)
    other = _other_target(fixture_target, tmp_path, **({"hidden": 256} if change == "hidden_size" else
                                                       {"token": "<|other|>"}))
    log = tmp_path / "serve.log"
    r = serve_cli(tmp_path, "launch", "--model", str(other), "--draft", "drafts/d", "--log", str(log),
                  "--port", "1")  # port 1 would fail to bind: the refusal must come first
    assert r.returncode == 1 and "Traceback" not in r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    if change == "hidden_size":
        assert f"drafts/d was trained for another target ({fixture_target}): this one's config.json has " \
            "hidden_size 256 (the draft's: 128)" in msg, msg
    else:
        assert_refused(msg, "TARGET_MISMATCH", str(other))
        assert fixture_target.name in msg, msg
    assert not log.exists()
    if change == "tokenizer":
        return
    # the same draft against its own target passes the check (and --print shows the command)
    r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--draft", "drafts/d", "--print",
                  "--nccl-p2p-disable", "--", "--max-model-len", "1024")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("NCCL_P2P_DISABLE=1 ") and '"method": "eagle3"' in r.stdout
    assert r.stdout.strip().endswith("--max-model-len 1024")


@pytest.mark.parametrize("damage, says", [
    ("truncated", "model.safetensors: not a whole safetensors file (20,000 bytes, but its header describes"),
    ("aux ids", "config.json: eagle_aux_hidden_state_layer_ids [2, 4, 9] name layers the target does not have "
                "(it has 8"),
    ("draft vocab", "config.json: draft_vocab_size is 512, but model.safetensors holds lm_head.weight of shape "
                    "[1024, 128]"),
])
def test_a_draft_no_server_could_load_is_refused_before_anything_starts(damage, says, tmp_path, fixture_target):
    """eyas_common.drafts.check_folder: what vLLM would fail on (or load wrong), refused from the header alone."""
    ds = _draft_dataset(tmp_path, fixture_target)
    cfg = json.loads((ds.path / "config.json").read_text())
    if damage == "truncated":
        os.truncate(ds.path / "model.safetensors", 20_000)
    elif damage == "aux ids":
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 9]
    else:
        cfg["draft_vocab_size"] = 512
    write_json_atomic(ds.path / "config.json", cfg)
    r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--draft", "drafts/d", "--print")
    assert r.returncode == 1 and not r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr and "eyas-train export" in r.stderr, r.stderr


def test_prompt_lookup_is_vllms_and_replaces_a_draft(tmp_path):
    model = tmp_path / "target"
    model.mkdir()
    r = serve_cli(tmp_path, "launch", "--model", str(model), "--prompt-lookup", "--spec-tokens", "5", "--print")
    assert r.returncode == 0, r.stderr
    assert '"method": "ngram", "num_speculative_tokens": 5' in r.stdout and "--draft" not in r.stdout
    for args, says in ((["--draft", "drafts/d"], "--prompt-lookup and --draft drafts/d both speculate"),
                       (["--engine", "sglang"], "--prompt-lookup is vLLM's n-gram prompt lookup; SGLang's")):
        r = serve_cli(tmp_path, "launch", "--model", str(model), "--prompt-lookup", "--print", *args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_port_in_use_is_refused(tmp_path, fixture_target):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        log = tmp_path / "serve.log"
        r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--port", str(port), "--log", str(log))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr and "--port" in r.stderr
    assert not log.exists()


@pytest.mark.parametrize("content, where", [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "assistant", "content": "x"}]}\n',
     r"prompts\.jsonl:2: the conversation has no user turn"),
    ("\n\n", r"prompts\.jsonl holds no prompts"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": \n', r"prompts\.jsonl:2: malformed JSON"),
])
def test_a_prompts_file_with_no_usable_prompt_is_refused(content, where, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    r = serve_cli(tmp_path, "bench", "--server", "http://127.0.0.1:1", "--prompts", str(prompts), "--name", "b")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert re.search(where, r.stderr), r.stderr
    assert not (tmp_path / "bench").exists()


def test_bad_options_get_one_line(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    r = serve_cli(tmp_path, "bench", "--server", "http://127.0.0.1:1", "--prompts", str(prompts), "--name", "b",
                  "--concurrency", "1,0")
    assert r.returncode == 2 and "every level must be >= 1" in r.stderr
    r = serve_cli(tmp_path, "bench", "--server", "http://127.0.0.1:1", "--prompts", str(prompts), "--name", "b")
    assert r.returncode == 1 and "http://127.0.0.1:1: no answer" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bench").exists()


def _error_line(r: subprocess.CompletedProcess) -> str:
    """The one `Error: ...` line a refused command prints (click's usage lines above it aside), no traceback."""
    assert "Traceback" not in r.stderr and not r.stdout, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.mark.parametrize("args, says", [
    (["--server", "127.0.0.1:8000"], "'--server': '127.0.0.1:8000': expected an http:// or https:// URL of the "
                                     "server, e.g. http://127.0.0.1:8000"),
    (["--server", "http://[::1"], "'--server': 'http://[::1': not a URL (Invalid IPv6 URL)"),
    (["--server", "http://127.0.0.1:99999"], "'--server': 'http://127.0.0.1:99999': not a URL (Port out of range"),
    (["--server", "http://127.0.0.1:1", "--baseline", "ftp://127.0.0.1:2"], "'--baseline': 'ftp://127.0.0.1:2': "
                                                                              "expected an http:// or https:// URL"),
    (["--server", "http://127.0.0.1:1", "--baseline", "http://127.0.0.1:1/"], "--baseline http://127.0.0.1:1/ is "
                                                                                "the --server itself"),
    (["--server", "http://127.0.0.1:1", "--temperature", "nan"], "'--temperature': 'nan': expected a finite number"),
    (["--server", "http://127.0.0.1:1", "--timeout", "inf"], "'--timeout': 'inf': expected a finite number"),
    (["--server", "http://127.0.0.1:1", "--num-prompts", "1000000000000"], "1000000000000 is not in the range"),
])
def test_bench_refuses_a_bad_url_or_number_before_any_request(args, says, tmp_path):
    """A URL without its scheme read as a server that does not answer, a malformed one and a nan temperature or
    timeout ended in tracebacks, and a baseline that is the server itself measured a speedup of nothing."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    r = serve_cli(tmp_path, "bench", "--prompts", str(prompts), "--name", "b", *args)
    assert r.returncode == 2 and says in _error_line(r), r.stderr
    assert not (tmp_path / "bench").exists()


def test_bench_names_a_bad_draft_or_name_before_asking_the_server(tmp_path):
    """The datasets are checked before any server is asked: with the server down too, the draft is named."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    r = serve_cli(tmp_path, "bench", "--prompts", str(prompts), "--name", "b", "--server", "http://127.0.0.1:1",
                  "--draft", "drafts/missing")
    assert r.returncode == 1 and "drafts/missing" in _error_line(r) and "127.0.0.1:1" not in r.stderr, r.stderr
    assert not (tmp_path / "bench").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, says", [
    (["--host", "999.1.1.1"], "'--host': '999.1.1.1': not an address of this machine"),
    (["--host", ""], "'--host': '': expected an address to listen on"),
    (["--log", "."], "'--log': File '.' is a directory"),
    (["--health-timeout", "nan"], "'--health-timeout': 'nan': expected a finite number"),
])
def test_launch_refuses_a_bad_host_log_or_timeout_before_anything_starts(args, says, tmp_path, fixture_target):
    """A --host that is no address here read as `port already in use`; --log naming a folder ended in a
    traceback; a nan --health-timeout waited forever."""
    r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--python", "/bin/false",
                  "--port", str(_free_port()), *args)
    assert r.returncode == 2 and says in _error_line(r) and "already in use" not in r.stderr, r.stderr


def test_launch_refuses_an_engine_that_is_not_installed_before_it_starts(tmp_path, fixture_target):
    """It started `python -m sglang.launch_server`, waited, and printed the engine's ModuleNotFoundError as a log
    tail; the interpreter is now asked for the package first."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: the launch would start it")
    log = tmp_path / "serve.log"
    r = serve_cli(tmp_path, "launch", "--engine", "sglang", "--model", str(fixture_target), "--log", str(log),
                  "--port", str(_free_port()))
    assert r.returncode == 1 and not log.exists()
    assert f"Error: {sys.executable} cannot import sglang: install sglang there" in _error_line(r), r.stderr


def test_a_draft_manifest_with_an_edited_target_is_refused_in_one_line(tmp_path, fixture_target):
    ds = _draft_dataset(tmp_path, fixture_target)
    write_json_atomic(ds.manifest_path, {**ds.read_manifest(), "target": "kimi"})
    r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--draft", "drafts/d", "--print")
    assert r.returncode == 1
    assert "drafts/d: " in (line := _error_line(r)) and "`target` is a JSON string" in line, line
    assert "eyas-data rm drafts/d --yes" in line


@pytest.mark.parametrize("edit, says", [
    ({"inputs": "drafts/d"}, "`inputs` is a JSON string, expected an array"),
    ({"inputs": [{"ref": 5}]}, '`inputs[0]` is {"ref": 5}, expected an object with a string `ref`'),
    ({"target": "kimi"}, "`target` is a JSON string, expected the target's fingerprint"),
])
def test_report_refuses_an_edited_lineage_in_one_line(edit, says, tmp_path, fixture_target):
    """The manifest's inputs and target are what the report's lineage line prints; edited, they ended in a
    traceback there. A draft whose manifest is edited so is refused before a bench copies its lineage."""
    out, m = start("b", draft=None, params={}, root=tmp_path)
    write_results(out, m, {"engine": "vllm", "server": "http://a", "baseline": None, "prompts": "p.jsonl",
                           "levels": [_level(1, 100.0)], "spec": None, "spec_tokens": 0}, stats={})
    write_json_atomic(out.manifest_path, {**out.read_manifest(), **edit})
    r = serve_cli(tmp_path, "report", "b")
    assert r.returncode == 1 and says in (line := _error_line(r)) and "eyas-data rm bench/b --yes" in line, line
    draft = _draft_dataset(tmp_path, fixture_target)
    write_json_atomic(draft.manifest_path, {**draft.read_manifest(), **edit})
    with pytest.raises(DatasetError, match=re.escape(says)):
        start("b2", draft="drafts/d", params={}, root=tmp_path)


def test_bench_refuses_an_engine_the_server_does_not_run_before_writing(tmp_path):
    """--engine sglang against a vLLM-shaped server: its /server_info is a 404, which ended in a traceback and
    left bench/b partial; now one line before bench/b exists. A server gone mid-run is one line too."""
    from eyas_serve.bench import Server
    from eyas_testing.stub import start_stub

    prompts = tmp_path / "p.txt"
    prompts.write_text("a question\n")
    with start_stub() as stub:
        r = serve_cli(tmp_path, "bench", "--server", stub.url, "--engine", "sglang", "--prompts", str(prompts),
                      "--name", "b", "--warmup", "0")
        assert r.returncode == 1 and not (tmp_path / "bench" / "b").exists()
        assert f"{stub.url}/server_info: HTTP 404; is it a sglang server?" in _error_line(r), r.stderr
        server = Server(stub.url, "vllm")
    with pytest.raises(ConnectionError, match=rf"{re.escape(stub.url)}: no answer for /metrics .*still running"):
        server.counters()


@pytest.mark.parametrize("fault, says", [
    ("500", r"HTTP 500: .*injected 500"),
    ("no_stream", r"the answer came without a stream \(no `data:` lines\): the server ignored stream=true"),
])
def test_a_level_where_every_request_failed_leaves_the_bench_partial(fault, says, tmp_path):
    """Every request refused (a --max-tokens beyond the context, a server failing) was written as a complete
    bench of errors, exit 0; it now stops with the server's own message and bench/b stays partial. A server
    that answers a streamed request in one body was measured as 0 tokens/s without an error."""
    from eyas_serve.bench import run as run_bench
    from eyas_testing.stub import Faults, start_stub

    prompts = tmp_path / "p.txt"
    prompts.write_text("a question\n")
    with start_stub(faults=Faults({fault: 1.0})) as stub:
        with pytest.raises(ConnectionError, match=rf"{re.escape(stub.url)}: all 1 requests at 1 in flight failed, "
                                                  rf"e\.g\. {says}.*bench/b stays partial"):
            run_bench(server=stub.url, engine="vllm", prompts=prompts, name="b", concurrency=(1,), warmup=0,
                      max_tokens=8, data_root=tmp_path)
    assert Dataset.parse("b", "bench", tmp_path).read_manifest()["status"] == "partial"


def test_a_malformed_stream_chunk_fails_its_request_not_the_bench():
    import asyncio

    import httpx

    from eyas_serve.load import one_request

    async def ask() -> object:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"data: [1, 2]\n\n"))
        async with httpx.AsyncClient(transport=transport) as client:
            return await one_request(client, "http://x", {})

    res = asyncio.run(ask())
    assert not res.ok and res.error.startswith("malformed stream chunk (AttributeError"), res


def test_launch_does_not_overwrite_a_log_that_is_not_an_engine_log(tmp_path, fixture_target):
    """--log is rewritten at each launch: a --log naming the prompts by mistake lost them."""
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text('{"prompt": "kept"}\n')
    r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--python", "/bin/false",
                  "--port", str(_free_port()), "--log", str(prompts))
    assert r.returncode == 2 and "is not an engine log" in _error_line(r) and "pass another --log" in r.stderr
    assert prompts.read_text() == '{"prompt": "kept"}\n'
    log = tmp_path / "serve.log"  # an earlier launch's log is rewritten as before (the engine here cannot start)
    log.write_text("$ python -m vllm...\nold\n")
    r = serve_cli(tmp_path, "launch", "--model", str(fixture_target), "--python", "/bin/false",
                  "--port", str(_free_port()), "--log", str(log))
    assert r.returncode == 1 and "cannot import vllm" in _error_line(r) and "old" in log.read_text()


def test_compare_recommends_the_fastest_only_when_it_beats_the_target_alone():
    """The recommendation is the best geometric-mean speedup over the levels, and the target alone unless a
    candidate beats 1; its make line is that row's."""
    from eyas_common.bench import validate_compare
    from eyas_serve.compare import recommend
    from eyas_serve.report import compare_table

    def row(label, *speedups):
        return {"label": label, "method": "x", "bench": None, "serve": f"make serve {label}", "tokens_per_step": 1.5,
                "acceptance_length": 1.5, "per_position": [0.5], "speedup": dict(zip(("1", "4"), speedups))}

    alone = row("target alone", 1.0, 1.0)
    fast_at_one = row("lookup", 1.6, 0.7)   # geometric mean 1.06
    steady = row("drafts/d", 1.2, 1.1)       # 1.15: the winner, though not the fastest at 1 in flight
    assert recommend([alone, fast_at_one, steady])["serve"] == "make serve drafts/d"
    assert recommend([alone, row("slow", 0.9, 0.8)])["label"] == "target alone"
    compare = {"prompts": "p", "prompts_sha256": "0", "concurrency": [1, 4], "rows": [alone, fast_at_one, steady],
               "recommendation": recommend([alone, fast_at_one, steady])}
    validate_compare(compare)
    assert compare_table(compare).splitlines()[-1].strip() == "make serve drafts/d"
    with pytest.raises(DatasetError) as e:
        validate_compare({**compare, "rows": [{**steady, "speedup": {"1": "fast"}}]})
    assert_refused(e.value, "BENCH_MALFORMED", "rows[0]")
