"""`eyas-serve report bench/NAME`: the measured table, and the lineage of what was measured."""

from __future__ import annotations

from typing import Any


def _f(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def no_speedup(level: dict[str, Any]) -> str | None:
    """Why a level measured against a baseline has no speedup (None where it has one, or has no baseline):
    a baseline that produced no tokens has no tokens/s to divide by."""
    b = level.get("baseline")
    if not b or level.get("speedup") is not None:
        return None
    failed = f"; {b['errors']} of its requests failed" if b["errors"] else ""
    return f"n/a (baseline produced no tokens{failed})" if not b["tokens_per_s"] else "n/a"


def table(results: dict[str, Any], manifest: dict[str, Any]) -> str:
    spec = results.get("spec")
    lines = [f"engine {results['engine']}  server {results['server']}  baseline {results.get('baseline') or '-'}",
             f"prompts {results['prompts']}"]
    if spec and spec.get("acceptance_length") is not None:
        pos = " ".join(_f(p) for p in spec.get("per_position") or []) or "-"
        counts = (f" ({spec['accepted']} accepted / {spec['drafts']} drafts)" if spec.get("drafts") is not None
                  else " (running mean since the server started)")
        lines.append(f"acceptance length {spec['acceptance_length']:.2f}{counts}; per position {pos}")
    else:
        lines.append("acceptance length: not reported (the server exposes no speculative counters)")
    lines.append("")
    head = (f"{'conc':>5} {'tok/s draft':>12} {'tok/s base':>11} {'speedup':>8} {'acc len':>8} {'tok/step':>8} "
            f"{'TTFT p50/p90 ms':>17} {'ITL p50/p90 ms':>16} {'req':>5} {'err':>4}")
    lines.append(head)
    for lv in results["levels"]:
        d, b, s = lv["draft"], lv.get("baseline"), lv.get("spec") or {}
        lines.append(f"{lv['concurrency']:>5} {d['tokens_per_s']:>12.1f} {_f(b and b['tokens_per_s'], '.1f'):>11} "
                     f"{'n/a' if no_speedup(lv) else _f(lv.get('speedup')):>8} {_f(s.get('acceptance_length')):>8} "
                     f"{_f(s.get('tokens_per_step')):>8} "
                     f"{_f(d['ttft_ms']['p50'], '.0f') + '/' + _f(d['ttft_ms']['p90'], '.0f'):>17} "
                     f"{_f(d['itl_ms']['p50'], '.1f') + '/' + _f(d['itl_ms']['p90'], '.1f'):>16} "
                     f"{d['requests']:>5} {d['errors']:>4}")
    lines.append("")
    lines += [f"speedup at {lv['concurrency']} in flight: {why}" for lv in results["levels"] if (why := no_speedup(lv))]
    undrafted = ("(no --draft given; the server speculates without an eyas draft: --prompt-lookup, or a draft from "
                 "elsewhere)" if spec else "(no --draft given)")
    lines.append("lineage: " + (" <- ".join(i["ref"] for i in manifest.get("inputs", [])) or undrafted)
                 + f" <- target {(manifest.get('target') or {}).get('model', '?')}")
    return "\n".join(lines)


def compare_table(compare: dict[str, Any]) -> str:
    """The comparison: one row per way of serving, and the recommendation with its make line."""
    levels = [str(c) for c in compare["concurrency"]]
    head = f"{'':<22} {'tok/step':>8} {'acc len':>8} {'per position':>18} " + " ".join(
        f"{'x@' + c:>7}" for c in levels)
    lines = [f"prompts {compare['prompts']}", "", head]
    for row in compare["rows"]:
        pos = " ".join(_f(p) for p in row.get("per_position") or []) or "-"
        lines.append(f"{row['label'][:22]:<22} {_f(row['tokens_per_step']):>8} {_f(row['acceptance_length']):>8} "
                     f"{pos:>18} " + " ".join(f"{_f(row['speedup'].get(c)):>7}" for c in levels))
    rec = compare["recommendation"]
    lines += ["", f"recommended: {rec['label']} ({rec['why']})", f"  {rec['serve']}"]
    return "\n".join(lines)
