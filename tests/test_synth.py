"""Stage 01 synth: prompts, sample validation (the wrapper bug), faults, real vLLM, kill and resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from eyas_common.chat import ChatTokens, load_tokenizer, render_completion, render_prompt
from eyas_common.contract import Dataset, DatasetError, iter_jsonl
from eyas_common.chat import target_fingerprint
from eyas_common.samples import new_sample, validate_sample, write_dataset
from eyas_synth.cli import main as synth_cli
from eyas_common.prompts import load_prompts
from eyas_synth.run import run as synth
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.stub import Faults, start_stub
from helpers import assert_refused, refuses, rendering_answer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(fixture_target):
    return load_tokenizer(fixture_target)


def sound_sample(tok, sid: int, question: str, reasoning: str, content: str) -> dict:
    messages = [{"role": "user", "content": question}]
    prompt = render_prompt(tok, messages)
    completion = render_completion(tok, prompt, reasoning, content)
    return new_sample(id=sid, prompt_index=sid, messages=messages, thinking=True, reasoning=reasoning, content=content,
                      prompt_ids=prompt, completion_ids=completion, finish_reason="stop", source="rendered")


def write_synth(root: Path, name: str, samples: list[dict], tok, model: Path) -> Dataset:
    return write_dataset(Dataset.parse(name, "synth", root), samples, stage="test",
                         target=target_fingerprint(tok, model), params={})


# ------------------------------------------------------------------------------------------------
# prompts


def test_prompt_files(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "old answer"}]}) + "\n\n"
                 + json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                                                 {"from": "human", "value": "again"}]}) + "\n"
                 + json.dumps({"prompt": "plain", "completion": "ignored"}) + "\n")
    assert load_prompts(p) == [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}],
        [{"role": "user", "content": "plain"}],
    ]
    t = tmp_path / "p.txt"
    t.write_text("first prompt\n\nsecond prompt\n")
    assert load_prompts(t) == [[{"role": "user", "content": "first prompt"}], [{"role": "user", "content": "second prompt"}]]
    for line, err in (('{"messages": [{"role": "user"}]}', "string `role` and `content`"),
                      ('{"conversations": [{"from": "robot", "value": "x"}]}', "needs `from`"),
                      ('{"text": "x"}', "expected an object with `messages`.*found keys text.*\\.txt"),
                      ('["x"]', "expected an object .*found a JSON array"),
                      ('{"messages": "hi"}', "`messages` must be an array of {role, content} objects \\(OpenAI\\), "
                                             "found a JSON string"),
                      ('{"prompt": 3}', "`prompt` must be a string, found a JSON number"),
                      ('{"messages": [{"role": "system", "content": "x"}]}', "no user turn"),
                      ('{"messages": [{"role": "User", "content": "x"}]}', "no user turn to answer \\(its roles: "
                                                                           "User; a turn to answer has role \"user\""),
                      ('{"messages": [', "malformed JSON \\(Expecting value at column 15\\)")):
        p.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + line + "\n")
        with pytest.raises(DatasetError, match=rf"p\.jsonl:2: .*{err}"):
            load_prompts(p)


# ------------------------------------------------------------------------------------------------
# validation: the bug this project was founded on


def test_validate_sample_structure(tok):
    good = sound_sample(tok, 0, "What is 2+3?", "2+3=5.", "5")
    assert validate_sample(good, tok) == []
    t = ChatTokens.of(tok)
    assert good["input_ids"][good["loss_mask"].index(1) - 1] == t.think_open  # K2.5: <think> ends the prompt
    assert good["input_ids"][-1] == t.end_of_turn

    def broken(**change):
        return validate_sample({**good, **change}, tok)

    p = good["loss_mask"].index(1)
    assert any("covers the prompt" in e or "differ" in e for e in broken(loss_mask=[1] * len(good["loss_mask"])))
    assert any("holes" in e for e in broken(loss_mask=good["loss_mask"][:-2] + [0, 1]))
    assert any("does not end with the end-of-turn" in e for e in broken(input_ids=good["input_ids"][:-1] + [5]))
    assert any("reasoning ids decode" in e for e in broken(reasoning="something else"))
    assert any("content ids decode" in e for e in broken(content="6"))
    assert any("prompt ids differ" in e for e in broken(messages=[{"role": "user", "content": "What is 2+4?"}]))
    assert any("2 </think>" in e for e in broken(input_ids=good["input_ids"][:p] + [t.think_close] + good["input_ids"][p:],
                                                 loss_mask=good["loss_mask"] + [1]))
    # a length-truncated answer inside its reasoning is sound: no </think>, no end-of-turn
    prompt = good["input_ids"][:p]
    cut = tok.encode("2+3 is", add_special_tokens=False)
    trunc = {**good, "input_ids": prompt + cut, "loss_mask": [0] * p + [1] * len(cut), "reasoning": "2+3 is",
             "content": "", "finish_reason": "length"}
    assert validate_sample(trunc, tok) == []
    # thinking off (or a target with no <think>): a truncated answer is content, never reasoning
    off = [{"role": "user", "content": "What is 2+3?"}]
    prompt = render_prompt(tok, off, thinking=False)
    cut = tok.encode("The answer is", add_special_tokens=False)
    plain = {**good, "messages": off, "thinking": False, "input_ids": prompt + cut, "reasoning": None,
             "loss_mask": [0] * len(prompt) + [1] * len(cut), "content": "The answer is", "finish_reason": "length"}
    assert validate_sample(plain, tok) == []
    assert any("content ids decode" in e for e in validate_sample({**plain, "content": "The answer"}, tok))
    assert any("no <think> opens it" in e for e in validate_sample({**plain, "reasoning": "The answer is"}, tok))


def test_thinking_defaults_from_the_target(tok, fixture_target, tmp_path):
    """No switch is sent unless asked (the target's default is what it does); a tokenizer without thinking
    tokens refuses --thinking, which would check plain answers as reasoning."""
    from eyas_common.chat import resolve_thinking, template_switches

    assert template_switches(tok) == ("thinking",)  # the Kimi-style fixture's switch
    assert resolve_thinking(tok, None)[0] is None and resolve_thinking(tok, False)[0] is False
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in fixture_target.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            text = f.read_text().replace("<think>", "<ponder>").replace("</think>", "</ponder>")
            (plain / f.name).write_text(text)
    no_think = load_tokenizer(plain)
    assert resolve_thinking(no_think, None)[0] is None and resolve_thinking(no_think, False)[0] is False
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 1, seed=1)
    r = CliRunner().invoke(synth_cli, ["run", "--prompts", str(prompts), "--name", "t", "--model", str(plain),
                                       "--server", "http://127.0.0.1:1", "--thinking"], env={"EYAS_DATA": str(tmp_path)})
    assert r.exit_code == 1
    assert_refused(r.output, "THINKING_UNSUPPORTED", "--thinking")


def test_validate_refuses_joined_reasoning(tok, fixture_target, tmp_path, monkeypatch):
    """Reasoning and answer joined as text without <think>...</think>: refused, naming the sample."""
    samples = [sound_sample(tok, i, f"What is {i}+1?", f"{i}+1={i + 1}.", str(i + 1)) for i in range(3)]
    bad = samples[1]
    p = bad["loss_mask"].index(1)
    joined = tok.encode(bad["reasoning"] + bad["content"], add_special_tokens=False) + [ChatTokens.of(tok).end_of_turn]
    samples[1] = {**bad, "input_ids": bad["input_ids"][:p] + joined, "loss_mask": [0] * p + [1] * len(joined)}
    write_synth(tmp_path, "joined", samples, tok, fixture_target)
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    r = CliRunner().invoke(synth_cli, ["validate", "joined"])
    assert r.exit_code == 1
    assert "sample 1: " in r.output and "joined without the thinking wrappers" in r.output
    assert "sample 0" not in r.output and "sample 2" not in r.output
    assert "3 samples, 1 unsound" in r.output


def test_validate_refuses_what_the_next_stage_refuses_in_its_words(tok, fixture_target, tmp_path, monkeypatch):
    """Edited after it was finished, a status no stage writes, no `files`, partial: validate said "0 unsound"
    (exit 0) for datasets eyas-extract refuses."""
    from eyas_common.contract import check_intact, open_input

    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    samples = [sound_sample(tok, i, f"What is {i}+1?", f"{i}+1={i + 1}.", str(i + 1)) for i in range(3)]

    def consumer_refusal(name: str) -> str:  # the contract checks eyas-extract runs on its input
        with pytest.raises(DatasetError) as refused:
            check_intact(*open_input(name, "synth", root=tmp_path))
        return refused.value.line

    def manifest_edit(name: str, **change) -> None:
        path = tmp_path / "synth" / name / "manifest.json"
        m = json.loads(path.read_text()) | change
        path.write_text(json.dumps({k: v for k, v in m.items() if v is not None}))

    edits = {"edited": None, "nostatus": {"status": None}, "done": {"status": "done"}, "nofiles": {"files": None},
             "partial": {"status": "partial"}}
    for name, change in edits.items():
        ds = write_synth(tmp_path, name, samples, tok, fixture_target)
        if change is None:
            with open(ds.path / "samples.jsonl", "ab") as f:
                f.write(b" ")
        else:
            manifest_edit(name, **change)
        r = CliRunner().invoke(synth_cli, ["validate", name])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert r.output == f"Error: {consumer_refusal(f'synth/{name}')}\n", r.output
        fix = "rerun eyas-synth run (make synth) with the same name" if name == "partial" else \
            f"`eyas-data rm synth/{name} --yes`, then rerun eyas-synth run"
        assert fix in r.output, r.output
    size = (tmp_path / "synth" / "edited" / "samples.jsonl").stat().st_size
    r = CliRunner().invoke(synth_cli, ["validate", "edited"])
    assert f"samples.jsonl: {size} bytes, manifest says {size - 1}" in r.output, r.output


def test_a_malformed_line_names_what_to_do(tok, fixture_target, tmp_path, monkeypatch):
    """`samples.jsonl:2: malformed JSON (...)` said nothing more, in validate and on a rerun of synth."""
    from eyas_common.contract import finalize

    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 6, seed=3)
    ds = Dataset.parse("torn", "synth", tmp_path)
    path = ds.path / "samples.jsonl"
    with start_stub(answer=rendering_answer(tok)) as stub:
        kw = dict(prompts=prompts, name="torn", model=fixture_target, servers=[stub.url], served_model="fixture",
                  seed=0, data_root=tmp_path, progress=False)
        synth(n=6, **kw)
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(lines[0] + lines[1][:40] + b"\n" + b"".join(lines[2:]))  # line 2 cut by hand
        finished = r"samples\.jsonl:2: malformed JSON .*; edited once finished; " \
                   r"remake it: `eyas-data rm synth/torn --yes`, then rerun eyas-synth run"
        with refuses("MALFORMED_JSONL", "samples.jsonl:2"):
            synth(n=7, **kw)  # extending a complete dataset
        finalize(ds, ds.read_manifest(), stats={})  # its manifest agrees with the files: validate reads the line
        monkeypatch.setenv("EYAS_DATA", str(tmp_path))
        r = CliRunner().invoke(synth_cli, ["validate", "torn"])
        assert r.exit_code == 1 and r.output.count("\n") == 1 and re.search(finished, r.output), r.output
        ds.write_manifest(ds.read_manifest() | {"status": "partial"})
        with refuses("MALFORMED_JSONL", "samples.jsonl:2"):
            synth(n=6, **kw)
        path.write_bytes(lines[0] + b"".join(lines[2:]))  # as the refusal says
        assert synth(n=6, **kw)["samples"] == 6
    assert sorted(r["id"] for _, r in iter_jsonl(path)) == list(range(6))


# ------------------------------------------------------------------------------------------------
# a fault-injecting server


def test_faulty_server_run_stays_partial_with_failures_listed(tok, fixture_target, tmp_path):
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 40, seed=3)
    faults = Faults(rates={"500": 0.1, "503": 0.05, "429": 0.05, "hang": 0.04, "bad_json": 0.08, "drop": 0.08,
                           "no_ids": 0.2}, retry_after="0", seed=1)
    n = 80
    with start_stub(answer=rendering_answer(tok), faults=faults) as stub:
        with pytest.raises(DatasetError, match=r"synth/faulty stays partial: .* missing ids \[.*--allow-missing"):
            synth(prompts=prompts, name="faulty", model=fixture_target, servers=[stub.url], n=n,
                  concurrency=16, timeout_s=1.5, max_attempts=2, served_model="fixture", seed=0, data_root=tmp_path,
                  progress=False)
        served = stub.counts()
    ds = Dataset.parse("faulty", "synth", tmp_path)
    m = ds.read_manifest()
    stats = m["stats"]
    assert m["status"] == "partial"
    failed = [r for _, r in iter_jsonl(ds.path / "failures.jsonl")]
    samples = [r for _, r in iter_jsonl(ds.path / "samples.jsonl")]
    assert stats["failed"] == len(failed) > 0 and stats["samples"] == len(samples)
    assert stats["missing"] == sorted(f["id"] for f in failed)
    assert stats["samples"] + stats["failed"] == n and stats["rejected"] == 0
    assert {s["id"] for s in samples} | {f["id"] for f in failed} == set(range(n))
    # answers without ids were rendered here, and are exactly as sound as the server's
    assert 0 < stats["rendered"] == sum(s["source"] == "rendered" for s in samples) <= served.get("no_ids", 0)
    assert stats["truncated_kept"] == sum(s["finish_reason"] == "length" for s in samples) > 0
    client = stats["client"]
    assert client["http_5xx"] == served.get("500", 0) + served.get("503", 0)
    assert client["http_429"] == served.get("429", 0) and client["timeouts"] == served.get("hang", 0)
    assert client["bad_json"] == served.get("bad_json", 0)
    for s in samples:
        assert validate_sample(s, tok) == [], s["id"]

    # a rerun against a healthy server retries exactly the failed ones
    with start_stub(answer=rendering_answer(tok)) as stub:
        stats = synth(prompts=prompts, name="faulty", model=fixture_target, servers=[stub.url], n=n,
                      concurrency=16, max_attempts=2, served_model="fixture", seed=0, data_root=tmp_path, progress=False)
        assert stub.counts()["ok"] == len(failed)
    ids = [r["id"] for _, r in iter_jsonl(ds.path / "samples.jsonl")]
    assert sorted(ids) == list(range(n)) and stats["failed"] == 0
    assert not (ds.path / "failures.jsonl").exists()


def test_a_server_rendering_prompts_otherwise_is_refused_even_with_empty_answers(tok, fixture_target, tmp_path):
    """The prompt ids a server sends are checked whether or not it sends completion ids: an empty answer
    (no token ids) from a server on another template made a complete dataset of empty answers."""
    from eyas_testing.stub import vllm_body

    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 4, seed=5)
    with start_stub(answer=lambda payload: vllm_body("", [1, 2, 3], [])) as stub:
        with pytest.raises(DatasetError) as e:
            synth(prompts=prompts, name="other", model=fixture_target, servers=[stub.url], n=4, concurrency=4,
                  served_model="fixture", seed=0, data_root=tmp_path, progress=False)
    assert_refused(e.value, "SYNTH_NOT_EXACT", stub.url)
    assert Dataset.parse("other", "synth", tmp_path).read_manifest()["status"] == "partial"
    rejected = [r for _, r in iter_jsonl(tmp_path / "synth" / "other" / "rejected.jsonl")]
    assert rejected and all("prompt_token_ids differ" in r["problems"][0] for r in rejected)


def test_a_server_that_answers_v1_models_with_an_error_is_named_in_one_line():
    from eyas_synth.run import servers_info

    with start_stub() as stub:
        with pytest.raises(DatasetError) as e:
            servers_info([stub.url + "/not-vllm"], None)  # the stub answers 404 there, with its JSON error
    assert "/not-vllm/v1/models answered HTTP 404 (" in e.value.message and "\n" not in e.value.message
    assert "no route GET /not-vllm/v1/models" in e.value.message and "check its log" in e.value.message


def test_a_silent_server_is_reported_long_before_the_timeout(tok, fixture_target, tmp_path, capfd):
    """Requests that hang are not silent for the whole --timeout: the run says how long nothing came, and
    that the server still answers /v1/models (busy, not dead), at a quarter of --timeout here."""
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 2, seed=6)
    with start_stub(answer=rendering_answer(tok), faults=Faults(rates={"hang": 1.0})) as stub:
        with pytest.raises(DatasetError, match="the first 2 requests all failed alike.*no answer within 2 s"):
            synth(prompts=prompts, name="mute", model=fixture_target, servers=[stub.url], n=2, concurrency=2,
                  timeout_s=2, max_attempts=1, served_model="fixture", seed=0, data_root=tmp_path, progress=False)
    err = capfd.readouterr().err
    assert re.search(r"\[synth\] no answer for \d s with 2 requests in flight \(each waits up to --timeout 2 s\): "
                     + re.escape(f"{stub.url} answers GET /v1/models, so it is up and working on 2. Ctrl-C keeps "
                                 f"every answer so far; rerunning the command resumes"), err), err


def test_a_replacement_server_with_another_context_length_resumes_the_run(tok, fixture_target, tmp_path):
    """max_model_len comes from the server, not from an option: a run resumed against another server with
    another context length goes on (it was refused with "resume it with the same options", which none sets)."""
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 6, seed=6)
    go = dict(prompts=prompts, name="moved", model=fixture_target, concurrency=2, served_model="fixture", seed=0,
              data_root=tmp_path, progress=False)
    with start_stub(answer=rendering_answer(tok), max_model_len=2048) as first:
        synth(servers=[first.url], n=3, **go)
    with start_stub(answer=rendering_answer(tok)) as second:
        stats = synth(servers=[second.url], n=6, **go)
    m = Dataset.parse("moved", "synth", tmp_path).read_manifest()
    assert m["status"] == "complete" and stats["samples"] == 6 and m["params"]["max_model_len"] is None


def test_resume_refuses_changed_params_and_drops_truncated_on_request(tok, fixture_target, tmp_path):
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 14, seed=3)
    with start_stub(answer=rendering_answer(tok)) as stub:
        kw = dict(prompts=prompts, model=fixture_target, servers=[stub.url], served_model="fixture", seed=0,
                  data_root=tmp_path, progress=False)
        stats = synth(name="dropping", n=14, drop_truncated=True, **kw)
        assert stats["truncated_dropped"] == 2 and stats["samples"] == 12  # seeds 3 and 10 are cut (mod 7)
        ds = Dataset.parse("dropping", "synth", tmp_path)
        assert sum(1 for _ in iter_jsonl(ds.path / "truncated.jsonl")) == 2
        with refuses("PARAMS_CHANGED", "temperature=0.6 (now 0.9)"):
            synth(name="dropping", n=14, drop_truncated=True, temperature=0.9, **kw)
        # growing n resumes: only the new ids are asked for
        before = stub.counts()["ok"]
        synth(name="dropping", n=20, drop_truncated=True, **kw)
        assert stub.counts()["ok"] - before == 6


# ------------------------------------------------------------------------------------------------
# real vLLM


@pytest.mark.vllm
def test_synth_against_real_vllm(vllm_server, fixture_target, tok, tmp_path, monkeypatch):
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 64, seed=5)
    stats = synth(prompts=prompts, name="real", model=fixture_target, servers=[vllm_server.url], n=64,
                  max_tokens=256, temperature=0.0, concurrency=32, allow_rejected="2", data_root=tmp_path,
                  progress=False)
    # greedy answers of the fixture keep the format; a rare broken one is rejected, never kept
    assert stats["samples"] + stats["rejected"] == 64 and stats["rejected"] <= 2
    assert stats["failed"] == stats["rendered"] == 0
    samples = [r for _, r in iter_jsonl(tmp_path / "synth" / "real" / "samples.jsonl")]
    t = ChatTokens.of(tok)
    for s in samples:
        p = s["loss_mask"].index(1)
        # the server's prompt ids are the tokenizer's own rendering (validate re-checks, here explicitly)
        assert s["input_ids"][:p] == render_prompt(tok, s["messages"])
        assert s["source"] == "server" and s["reasoning"] and s["content"]
        assert t.think_close in s["input_ids"][p:] and s["input_ids"][-1] == t.end_of_turn
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    r = CliRunner().invoke(synth_cli, ["validate", "real"])
    assert r.exit_code == 0, r.output
    assert f"{stats['samples']} samples, 0 unsound, status complete" in r.output


@pytest.mark.vllm
def test_sigkill_mid_run_then_resume(vllm_server, fixture_target, tok, tmp_path):
    n = 120
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 50, seed=6)
    cmd = [str(REPO / ".venv" / "bin" / "eyas-synth"), "run", "--prompts", str(prompts), "--name", "killed",
           "--model", str(fixture_target), "--server", vllm_server.url, "--n", str(n), "--max-tokens", "256",
           "--concurrency", "4", "--allow-rejected", "10%", "--quiet"]
    env = {**os.environ, "EYAS_DATA": str(tmp_path)}
    samples = tmp_path / "synth" / "killed" / "samples.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not samples.exists() or samples.read_bytes().count(b"\n") < 30):
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = samples.read_bytes().count(b"\n")
    assert 30 <= written < n
    with open(samples, "ab") as f:  # as if killed mid-line too
        f.write(b'{"id": 999, "input_ids": [1, 2')
    m = json.loads((tmp_path / "synth" / "killed" / "manifest.json").read_text())
    assert m["status"] == "partial"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"{written} of {n} samples already there" in out.stderr
    # every id exactly once: kept, or rejected when the model itself broke the format (it is tiny)
    ids = [r["id"] for _, r in iter_jsonl(samples)]
    rejected = samples.with_name("rejected.jsonl")
    rejected_ids = [r["id"] for _, r in iter_jsonl(rejected)] if rejected.exists() else []
    assert sorted(ids + rejected_ids) == list(range(n)) and len(rejected_ids) < n // 10
    out = subprocess.run([str(REPO / ".venv" / "bin" / "eyas-synth"), "validate", "killed"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------------
# probed: bad servers and bad --server values


def test_answers_that_are_no_sample_are_rejected_without_a_crash(tok, fixture_target, tmp_path):
    """Completion ids no tokenizer decodes (negative) crashed the run with a traceback; ids outside the vocabulary
    made a complete dataset eyas-extract refuses; content parts (a list) crashed the rendering of a text answer."""
    from eyas_testing.stub import vllm_body

    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 3, seed=5)
    eot = ChatTokens.of(tok).end_of_turn

    def ids(bad):  # a sound answer but for one id in its content, which decode() raises on (-5) or drops (oov)
        def answer(payload):
            prompt = render_prompt(tok, payload["messages"])
            return vllm_body("", prompt, render_completion(tok, prompt, "hm", "")[:-1] + [bad, eot], reasoning="hm")
        return answer

    def parts(payload):
        body = vllm_body("", [], [])
        body["choices"][0]["message"]["content"] = [{"type": "text", "text": "hi"}]
        return {k: v for k, v in body.items() if k != "prompt_token_ids"}

    for name, answer, why in (("neg", ids(-5), "token_ids hold ids that are not token ids of --model's tokenizer"),
                              ("oov", ids(len(tok) + 7), "token_ids hold ids that are not token ids of --model's"),
                              ("parts", parts, "message content is a JSON array, not a string")):
        with start_stub(answer=answer) as stub:
            with pytest.raises(DatasetError) as e:
                synth(prompts=prompts, name=name, model=fixture_target, servers=[stub.url], n=3, concurrency=3,
                      served_model="fixture", seed=0, data_root=tmp_path, progress=False)
        assert_refused(e.value, "SYNTH_NOT_EXACT", stub.url)
        rejected = {r["id"]: r["problems"] for _, r in iter_jsonl(tmp_path / "synth" / name / "rejected.jsonl")}
        assert sorted(rejected) == [0, 1, 2] and all(why in p[0] for p in rejected.values())


def test_every_server_url_is_checked_before_any_request(tok, fixture_target, tmp_path):
    """A --server without a scheme was first named by httpx ("missing an 'http://'", "is the server up?"), one that
    httpx cannot parse was a traceback, and a second --server was never checked: down, schemeless or serving another
    model, it failed every request sent to it while the run went on."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):  # a server of another model name
        def do_GET(self) -> None:  # noqa: N802
            raw = json.dumps({"object": "list", "data": [{"id": "other-model", "max_model_len": 64}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args) -> None:
            pass

    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 2, seed=5)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    other_url = f"http://127.0.0.1:{other.server_port}"
    try:
        with start_stub(answer=rendering_answer(tok)) as stub:
            host = stub.url.removeprefix("http://")
            for servers, err in (([host], rf"--server '{host}': no scheme; write it as http://{host}"),
                                 ([stub.url, host], rf"--server '{host}': no scheme"),
                                 (["http://[::1"], r"--server 'http://\[::1' is not a URL .*write it as http://HOST"),
                                 ([f"{stub.url}/v1/chat/completions"], rf"names a route; pass the server's base URL, "
                                                                       rf"{stub.url}$"),
                                 ([stub.url, "http://127.0.0.1:1"], r"127\.0\.0\.1:1/v1/models \(ConnectError.*leave "
                                                                    r"that --server out"),
                                 ([stub.url, other_url], rf"{other_url} serves other-model, not 'eyas-stub' as "
                                                         rf"{stub.url} does: every --server must serve the same")):
                r = CliRunner().invoke(synth_cli, ["run", "--prompts", str(prompts), "--name", "urls", "--model",
                                                   str(fixture_target), *(a for s in servers for a in ("--server", s))],
                                       env={"EYAS_DATA": str(tmp_path)})
                assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
                assert re.search(err, r.output.splitlines()[-1]) and "Traceback" not in r.output, r.output
            assert not stub.counts().get("ok") and not (tmp_path / "synth" / "urls").exists()
    finally:
        other.shutdown()


def test_validate_checks_every_id_against_the_manifest(tok, fixture_target, tmp_path, monkeypatch):
    """A complete dataset whose files agree with its manifest but hold an id outside [0, n), or lack ids the manifest
    does not list as missing, passed validate ("0 unsound"); and a target folder gone from this machine was named as
    a --model the user never passed."""
    from eyas_common.contract import finalize

    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 5, seed=3)
    with start_stub(answer=rendering_answer(tok)) as stub:
        synth(prompts=prompts, name="ids", model=fixture_target, servers=[stub.url], n=5, served_model="fixture",
              seed=0, data_root=tmp_path, progress=False)
    ds = Dataset.parse("ids", "synth", tmp_path)
    path = ds.path / "samples.jsonl"
    # answers are written as they complete: put them in id order first, so that line 2 holds id 1
    lines = sorted(path.read_text().splitlines(keepends=True), key=lambda line: json.loads(line)["id"])
    moved = json.loads(lines[1]) | {"id": 99}
    path.write_text(lines[0] + json.dumps(moved) + "\n" + "".join(lines[2:4]))  # id 1 -> 99, id 4 dropped
    finalize(ds, ds.read_manifest(), stats=ds.read_manifest()["stats"], records={"samples.jsonl": 4})
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    r = CliRunner().invoke(synth_cli, ["validate", "ids"])
    assert r.exit_code == 1, r.output
    assert "sample 99: id outside [0, 5): no run with --n 5 asks for it (samples.jsonl line 2)" in r.output
    for sid in (1, 4):
        assert f"sample {sid}: no answer (in none of samples, truncated, rejected), and the manifest does not list " \
               f"it as missing" in r.output, r.output
    assert "4 samples, 3 unsound" in r.output
    m = ds.read_manifest()
    ds.write_manifest(m | {"target": m["target"] | {"model": str(tmp_path / "gone")}})
    finalize(ds, ds.read_manifest(), stats=m["stats"], records={"samples.jsonl": 4})
    r = CliRunner().invoke(synth_cli, ["validate", "ids"])
    assert r.output == f"Error: synth/ids was made with the target {tmp_path / 'gone'}, which is not a folder on " \
                       f"this machine; pass the target's folder with --model\n", r.output


def test_a_rerun_on_changed_prompts_says_so_in_words(tok, fixture_target, tmp_path):
    """A rerun with another prompts file (or the same file, edited) was refused with two sha256 hashes and no
    word of which file or option."""
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 3, seed=3)
    with start_stub(answer=rendering_answer(tok)) as stub:
        kw = dict(name="moved", model=fixture_target, servers=[stub.url], n=3, served_model="fixture", seed=0,
                  data_root=tmp_path, progress=False)
        synth(prompts=prompts, **kw)
        other = write_prompts_jsonl(tmp_path / "other.jsonl", 3, seed=4)
        with pytest.raises(DatasetError, match=rf"synth/moved was made from other prompts than --prompts {other} "
                                               rf"holds now \(it was {prompts}\); resume it with the prompts it was "
                                               rf"made from, or pick another --name$"):
            synth(prompts=other, **(kw | {"n": 4}))
        with open(prompts, "a") as f:
            f.write(json.dumps({"prompt": "one more"}) + "\n")
        with pytest.raises(DatasetError, match=r"\(the same file, changed since\)") as e:
            synth(prompts=prompts, **(kw | {"n": 4}))
        assert "sha256" not in e.value.message
