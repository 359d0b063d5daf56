"""`eyas-serve launch`: check the draft against the target, then run the engine until Ctrl-C / SIGTERM.

Nothing starts before the checks pass: a draft made for another target (tokenizer fingerprint or hidden
size), a port already taken or a --host that is no address here, an interpreter that cannot import the
engine, and a --log that names a file other than an engine log are refused first, each in one line that names
both sides and the fix.
The engine runs in its own process group; on Ctrl-C or SIGTERM the whole group is stopped (vLLM forks an
engine-core process that would otherwise outlive the API server).
"""

from __future__ import annotations

import errno
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import click

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.checkpoint import CONFIG, read_text_config
from eyas_common.contract import Dataset, DatasetError, check_target, open_input
from eyas_common.drafts import check_folder
from eyas_serve.config import LaunchConfig
from eyas_serve.engines import SERVERS, engine_command, engine_env, prompt_lookup_config
from eyas_serve.process import VllmServer, log_tail, start_server, stop, wait_healthy


def say(msg: str) -> None:
    click.echo(f"[eyas-serve] {msg}", err=True)


def check_draft(draft: str, model: str | Path, trust_remote_code: bool = False) -> tuple[Dataset, dict[str, Any]]:
    """Open drafts/NAME and refuse it unless it was made for MODEL (same tokenizer, same hidden size, layers it
    has) and a server can load it (eyas_common.drafts.check_folder: config, weights' shapes, manifest hashes)."""
    ds, manifest = open_input(draft, "drafts")
    model = Path(model)
    try:
        text = read_text_config(model)  # the text model's, for wrappers like Kimi-K2.5
    except FileNotFoundError:
        raise DatasetError(f"--model {model}: no {CONFIG} there; pass the local folder of the target") from None
    check_target(ds, manifest, target_fingerprint(load_tokenizer(model, trust_remote_code), model))
    check_folder(ds, manifest, text)
    return ds, manifest


def check_port_free(host: str, port: int) -> None:
    """Bind HOST:PORT once, as the engine will: a port in use, and a --host that is no address of this machine
    (a typo, another host's IP), are refused with their own fix before anything starts."""
    if not host:
        raise click.BadParameter("'': expected an address to listen on: 127.0.0.1 (this host only) or 0.0.0.0 "
                                 "(every interface)", param_hint="'--host'")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except socket.gaierror as e:  # not an address, nor a name that resolves
            raise click.BadParameter(f"{host!r}: not an address of this machine ({e.strerror}); use 127.0.0.1 "
                                     f"(this host only) or 0.0.0.0 (every interface)", param_hint="'--host'") from None
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # EADDRNOTAVAIL: another machine's address; EACCES: a port below 1024
                raise click.ClickException(f"cannot listen on {host}:{port} ({e.strerror}): use a --host of this "
                                           f"machine (127.0.0.1 or 0.0.0.0) and a --port above 1023") from None
            raise click.ClickException(f"port {port} on {host} is already in use ({e.strerror}): stop what "
                                       f"holds it, or choose another --port") from None


def check_engine_installed(python: str, engine: str) -> None:
    """Refuse an interpreter that cannot import the engine before it starts: otherwise the engine's own
    ModuleNotFoundError comes back only as a log tail, after the start-up wait. find_spec looks the package up
    without importing it (vLLM's import alone takes seconds)."""
    module = SERVERS[engine][0].split(".")[0]
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        code = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        raise click.ClickException(f"--python {python} does not run ({e}): pass an interpreter that has {engine}"
                                   ) from None
    if code != 0:
        install = "`make vllm` for vLLM on CPU, else pip install vllm" if engine == "vllm" else "pip install sglang"
        raise click.ClickException(f"{python} cannot import {module}: install {engine} there ({install}), or pass "
                                   f"--python an interpreter that has it (the engine's image or venv)")


def check_log(log: Path) -> None:
    """The engine log is rewritten at each launch; refuse to rewrite a file that is not one (a --log naming the
    prompts or a config by mistake would be lost). Every log eyas writes starts with the `$ command` line."""
    if log.is_file() and log.stat().st_size:
        with log.open("rb") as f:
            if f.read(2) != b"$ ":
                raise click.BadParameter(f"{str(log)!r} exists and is not an engine log (eyas' logs start with the "
                                         f"`$ command` line); nothing was written to it: pass another --log",
                                         param_hint="'--log'")


def check_prompt_lookup(cfg: LaunchConfig) -> None:
    """--prompt-lookup is vLLM's n-gram speculation and replaces a draft: refuse it beside one, or on SGLang."""
    if cfg.draft:
        raise click.UsageError(f"--prompt-lookup and --draft {cfg.draft} both speculate: serve one of them; "
                               f"measure each against the same baseline with `eyas-serve bench`")
    if cfg.engine != "vllm":
        raise click.UsageError("--prompt-lookup is vLLM's n-gram prompt lookup; SGLang's n-gram speculation "
                               "(--speculative-algorithm NGRAM, CUDA only) is a different algorithm: pass its flags "
                               "after `--`, or serve with --engine vllm")


def speculation(cfg: LaunchConfig) -> str:
    """What the server speculates with, for the ready line."""
    if cfg.prompt_lookup:
        c = prompt_lookup_config(cfg.spec_tokens)
        return (f"vLLM prompt lookup: {c['prompt_lookup_min']}-{c['prompt_lookup_max']}-grams, "
                f"K {c['num_speculative_tokens']}, no draft model")
    return f"with {cfg.draft}" if cfg.draft else "no draft: baseline"


def plan(cfg: LaunchConfig) -> tuple[list[str], dict[str, str]]:
    """The engine command and its extra environment, after the draft check (nothing is started)."""
    if cfg.prompt_lookup:
        check_prompt_lookup(cfg)
    draft_dir = check_draft(cfg.draft, cfg.model, cfg.trust_remote_code)[0].path if cfg.draft else None
    return engine_command(cfg, draft_dir), engine_env(cfg)


class _Terminated(Exception):
    """SIGTERM: the way service managers (and `make demo`) ask a server to stop."""


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def launch(cfg: LaunchConfig, *, ready: Any = None) -> int:
    """Start the engine, wait for health, serve until it exits or we are told to stop; return an exit code
(0 after SIGTERM, 130 after Ctrl-C, the engine's own code, at least 1, when it exits by itself).

    `ready(server)` is called once the engine is healthy (the CLI prints the URL there).
    """
    cmd, env = plan(cfg)
    if shutil.which(cmd[0]) is None:
        raise click.ClickException(f"no interpreter at {cmd[0]}: install the engine (`make vllm` for vLLM on CPU) "
                                   f"or pass --python")
    check_port_free(cfg.host, cfg.port)
    log = Path(cfg.log or f"serve-{cfg.engine}-{cfg.port}.log").absolute()
    check_log(log)
    check_engine_installed(cmd[0], cfg.engine)
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    server: VllmServer | None = None
    try:
        server = start_server(cmd, port=cfg.port, log_path=log, env=env, host=cfg.host)
        say(f"{cfg.engine} starting (pid {server.pid}, log {log}); waiting up to {cfg.health_timeout_s:.0f} s "
            f"for {server.url}/health")
        t0 = time.monotonic()
        try:
            wait_healthy(server, cfg.health_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            raise click.ClickException(f"{cfg.engine} did not become healthy; it was stopped. {e}") from None
        say(f"ready after {time.monotonic() - t0:.0f} s: {server.url} "
            f"({speculation(cfg)}); Ctrl-C stops it")
        if ready is not None:
            ready(server)
        code = server.proc.wait()
        say(f"{cfg.engine} exited with code {code}; last lines of {log}:\n{log_tail(log)}")
        return code or 1
    except KeyboardInterrupt:
        say("interrupted: stopping the engine")
        return 130
    except _Terminated:
        say("SIGTERM: stopping the engine")
        return 0
    finally:
        if server is not None:
            stop(server)
        signal.signal(signal.SIGTERM, previous)


def print_command(cfg: LaunchConfig) -> str:
    """The shell line `--print` shows: extra environment, then the command, quoted for a shell."""
    cmd, env = plan(cfg)
    knobs = [f"{k}={v}" for k, v in env.items() if k in ("NCCL_P2P_DISABLE",)]
    return " ".join(knobs + [shlex.quote(c) for c in cmd])

