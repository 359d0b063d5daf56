"""`eyas-train eval`: offline chain speculative decoding with the real target (HF) and an exported draft.

It replays what vLLM does for EAGLE-3 with greedy verification, so its acceptance is the acceptance
vLLM reports for the same draft, target and prompts (up to float rounding):
  1. prefill: the target reads the prompt, greedy-samples the first token;
  2. propose: the draft's first pass reads positions 0..t (token x_{p+1}, fc(aux_p)) and proposes
     x_{t+2} at the last position t; k-1 further steps each feed the proposed token and the previous
     step's pre-norm output at position t+j, attending to the first pass's keys and the chain's own;
  3. verify: the target reads the last token and the k proposals; the longest prefix where proposal i
     equals the target's greedy token is accepted, and the target's next greedy token is appended;
  4. repeat until the end-of-turn token or max_tokens.
A DFlash draft (docs/interop.md, "DFlash drafts") replaces step 2 with vLLM's DFlash proposer: one pass over
the block [x_p, mask x k] at positions p..p+k (x_p the last token, the target's states of the rows before p
as context); slot j proposes x_{p+j}. Verification and counting are the same.
Counted as vLLM counts them (v1/core/sched/scheduler.py): every verification is one draft of k tokens,
accepted = tokens of that draft accepted, acceptance length = 1 + accepted / drafts.
The target is rerun over the whole sequence at each verification (no KV cache): simple and exact,
quadratic in length, meant for held-out sets of tens of prompts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas_common.chat import ChatTokens, load_tokenizer, render_prompt, resolve_thinking, target_fingerprint
from eyas_common.checkpoint import read_checkpoint_size, read_text_config
from eyas_common.contract import DatasetError, check_target, open_input, temp_path, write_json_atomic
from eyas_common.prompts import load_prompts
from eyas_common.drafts import check_folder, draft_method, served_spec_tokens
from eyas_train.config import EvalOptions
from eyas_train.methods import REGISTRY
from eyas_train.methods.base import TrainMethod


@torch.no_grad()
def _target(model: Any, ids: list[int], aux_ids: list[int], last: int,
            device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Greedy next token at the `last` final positions, and the aux states of all positions [n, 3H] on
    the draft's device (a target spread over GPUs returns its layers' states on their own devices)."""
    out = model(input_ids=torch.tensor([ids], device=model.device), output_hidden_states=True, use_cache=False,
                logits_to_keep=last)
    aux = torch.cat([out.hidden_states[i][0].to(device) for i in aux_ids], dim=-1)
    return out.logits[0].argmax(-1).tolist(), aux


def speculate(model: Any, draft: torch.nn.Module, method: type[TrainMethod], aux_ids: list[int], prompt: list[int],
              eot: int, k: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """Generate one answer, `method` proposing from `draft`; returns its tokens and the accepted count of every
    draft."""
    device = draft.fc.weight.device
    greedy, aux = _target(model, prompt, aux_ids, 1, device)
    ids = prompt + greedy
    accepted: list[int] = []
    while ids[-1] != eot and len(ids) - len(prompt) < max_tokens:
        n = len(ids)
        drafts = method.propose(draft, torch.tensor(ids, device=device), aux[: n - 1], k)
        # the target's choice after ids, then after each proposal
        verified, aux = _target(model, ids + drafts, aux_ids, k + 1, device)
        a = 0
        while a < k and drafts[a] == verified[a]:
            a += 1
        accepted.append(a)
        new = drafts[:a] + [verified[a]]
        if eot in new:  # tokens past the end of turn are accepted (and counted) but not kept
            new = new[: new.index(eot) + 1]
        ids += new[: max_tokens - (len(ids) - len(prompt))]
    return ids[len(prompt):], accepted


def memory_check(model: str | Path, dtype: str, cuda: bool) -> str:
    """The target's weights in `dtype` against this machine's memory: a one-line estimate, or a refusal
    that points to the served measurement when only a server can hold the target."""
    import os

    need = read_checkpoint_size(model).load_bytes(dtype)
    if cuda:
        have = sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        where = f"{torch.cuda.device_count()} GPU(s)"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "free host memory"
    line = f"target weights {need / 1e9:,.2f} GB in {dtype}; {where}: {have / 1e9:,.1f} GB"
    if need > 0.9 * have:
        raise DatasetError(f"{line}: the offline eval runs the whole target on this machine and it does not fit. "
                           f"Measure acceptance on the served target instead (stage 04, stages/04_serve: vLLM's "
                           f"spec_decode metrics with this draft), or run the eval on a machine with more memory")
    return line


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # what transformers takes by name


def check_device_map(device_map: str | None) -> None:
    """--device-map is one of transformers' strategies or a device name: refused before any work, not after the
    draft and the target's memory check."""
    if device_map is None or device_map in DEVICE_MAP_STRATEGIES:
        return
    try:
        torch.device(device_map)
    except RuntimeError:
        raise DatasetError(f"--device-map {device_map}: expected {', '.join(DEVICE_MAP_STRATEGIES)} or a device "
                           f"(cpu, cuda:0, ...)") from None


def check_writable(out: Path) -> None:
    """--out is written after the whole evaluation: try writing a file where it goes first (its nearest existing
    folder, when the rest is still to be made), so that a bad path is refused before the work, not after it."""
    folder = next(p for p in out.absolute().parents if p.exists())
    probe = temp_path(folder / out.name)
    try:
        probe.open("wb").close()
        probe.unlink()
    except OSError as e:
        raise DatasetError(f"--out {out}: cannot write in {folder} ({e.strerror}); pass an --out in a writable "
                           f"folder") from None


def _render_prompts(tok: Any, prompts: Path, thinking: bool, limit: int | None) -> list[list[int]]:
    """The first `limit` prompts of PROMPTS rendered by the target's chat template; one the template refuses (a
    role it does not know) is refused naming its number and roles, before the target is loaded."""
    from jinja2 import TemplateError

    out = []
    for i, messages in enumerate(load_prompts(prompts)[:limit]):
        try:
            out.append(render_prompt(tok, messages, thinking))
        except TemplateError as e:
            roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
            raise DatasetError(f"--prompts {prompts}: prompt {i + 1} (roles {roles}): the target's chat template "
                               f"refuses it ({e}); drop or fix that prompt") from None
    return out


def evaluate(options: EvalOptions | None = None, *, data_root: Path | None = None, **fields: Any) -> dict[str, Any]:
    """Acceptance of drafts/NAME on the prompts with the target, both in `dtype` (the serving dtype, for agreement
    with a server), spread over the GPUs when there are any (device_map auto). `options` as the CLI builds
    them, or their fields as keywords (EvalOptions(**fields))."""
    o = options if options is not None else EvalOptions(**fields)
    draft, model, prompts, out, device_map = o.draft, o.model, Path(o.prompts), o.out, o.device_map
    spec_tokens, max_tokens, trust_remote_code = o.spec_tokens, o.max_tokens, o.trust_remote_code
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    check_device_map(device_map)
    ds, manifest = open_input(draft, "drafts", root=data_root)
    try:
        check_folder(ds, manifest, read_text_config(model))  # before the target is loaded
    except FileNotFoundError as e:
        raise DatasetError(str(e)) from None
    if out is not None:
        check_writable(Path(out))
    tok = load_tokenizer(model, trust_remote_code)
    check_target(ds, manifest, target_fingerprint(tok, model))
    thinking, _ = resolve_thinking(tok, o.thinking)
    rendered = _render_prompts(tok, prompts, thinking, o.limit)  # before the target is loaded
    cuda = torch.cuda.is_available()
    dtype = ("bfloat16" if cuda else "float32") if o.dtype == "auto" else o.dtype
    print(f"[eyas-train eval] {memory_check(model, dtype, cuda)}", file=sys.stderr, flush=True)
    method = draft_method(ds.path)
    spec_tokens = served_spec_tokens(ds.path) if spec_tokens is None else spec_tokens
    module, aux_ids = REGISTRY[method].load(ds.path, model)
    module.to("cuda" if cuda else "cpu", getattr(torch, dtype))
    target = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype),
                                                  device_map=device_map or ("auto" if cuda else None),
                                                  trust_remote_code=trust_remote_code).eval()
    eot = ChatTokens.of(tok).end_of_turn
    counts: list[int] = []
    generated = 0
    for prompt in tqdm(rendered, desc="eval", unit="prompt"):
        tokens, accepted = speculate(target, module, REGISTRY[method], aux_ids, prompt, eot, spec_tokens, max_tokens)
        counts += accepted
        generated += len(tokens)
    drafts, acc = len(counts), sum(counts)
    result = {
        "draft": ds.ref, "method": method, "model": str(model), "prompts": len(rendered),
        "spec_tokens": spec_tokens,
        "max_tokens": max_tokens, "dtype": dtype, "drafts": drafts, "draft_tokens": drafts * spec_tokens, "accepted": acc,
        "acceptance_length": 1 + acc / drafts if drafts else None,
        # share of drafts whose position i was accepted (vLLM: accepted_per_pos[i] / drafts)
        "per_position": [sum(c > i for c in counts) / drafts if drafts else None for i in range(spec_tokens)],
        "generated_tokens": generated, "wall_s": round(time.monotonic() - t0, 1),
    }
    if out is not None:
        write_json_atomic(Path(out), result)
    return result
