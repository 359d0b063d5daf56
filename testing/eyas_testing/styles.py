"""The thinking styles of real targets, on the two trained tiny fixtures: the conformance matrix's targets.

A style is a chat template (and, for one, a tokenizer without thinking tokens) over trained weights that
already behave that way, so the styles differ where real targets differ and nothing is retrained:

    kimi      the generation prompt opens `<think>`; switch `thinking` (Kimi-K2.5)        Llama fixture
    qwen3     the model opens `<think>` itself; switch `enable_thinking`, and an empty
              `<think>\\n\\n</think>\\n\\n` written into the prompt when off (Qwen3)          Qwen3 fixture
    opens     the model opens `<think>` itself; the template has no switch at all          Qwen3 fixture
    r1        the generation prompt ends in `<think>\\n`; no switch (DeepSeek-R1)            Qwen3 fixture
    plain     no thinking tokens in the tokenizer (SmolLM2): `<think>` renamed `<ponder>`,
              so the same ids are plain text to every reader                              Llama fixture

A style folder links the fixture's weights and rewrites only the tokenizer files; it is cached beside them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from eyas_testing import fixture, fixture_qwen3

# Qwen3's history layout (reasoning only after the last user turn), then each style's generation prompt.
_QWEN_TURNS = fixture_qwen3.CHAT_TEMPLATE[:fixture_qwen3.CHAT_TEMPLATE.index("{%- if add_generation_prompt")]
OPENS_TEMPLATE = _QWEN_TURNS + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}\n"
R1_TEMPLATE = _QWEN_TURNS + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}\n"

# style -> (fixture builder, chat template or None to keep the fixture's, rename the thinking tokens)
STYLES = {
    "kimi": (fixture.build_fixture, None, False),
    "qwen3": (fixture_qwen3.build_qwen3_fixture, None, False),
    "opens": (fixture_qwen3.build_qwen3_fixture, OPENS_TEMPLATE, False),
    "r1": (fixture_qwen3.build_qwen3_fixture, R1_TEMPLATE, False),
    "plain": (fixture.build_fixture, None, True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def build_style(style: str) -> Path:
    """The folder of a style's target (made once next to its fixture; weights linked, not copied)."""
    build, template, rename = STYLES[style]
    base = build()
    if template is None and not rename:
        return base
    out = base.parent / f"{base.name}-style-{style}"
    if out.is_dir():
        return out
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in base.iterdir():
        if f.name in TOKENIZER_FILES:
            text = f.read_text()
            if rename:
                text = text.replace(fixture.THINK, "<ponder>").replace(fixture.UNTHINK, "</ponder>")
            (tmp / f.name).write_text(text)
        else:
            (tmp / f.name).symlink_to(f.resolve())
    if template is not None:
        _set_template(tmp, template)
    os.rename(tmp, out)
    return out


def _set_template(folder: Path, template: str) -> None:
    """The chat template wherever the tokenizer keeps it (transformers 5: chat_template.jinja; older: the config)."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(template)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if "chat_template" in cfg or not jinja.exists():
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
