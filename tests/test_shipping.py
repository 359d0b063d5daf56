"""What the images ship: common/ and their own stage, and none of the test scaffolding, which lives in
testing/eyas_testing (issue 19). Read from the Dockerfiles' COPY lines, .dockerignore and the packages."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from helpers import REPO

# what moved out of common/ and stages/ into testing/eyas_testing: the fixture targets and their remote code,
# the fake OpenAI server, the transformers server, the test launchers of real servers
SCAFFOLDING = frozenset({"fixture.py", "fixture_kimi.py", "fixture_qwen3.py", "fixture_smollm2.py", "kimi_k25",
                         "hf_server.py", "servers.py", "stub.py", "acceptance.py"})
# eyas-data fixture / prompts --set fixture: the one shipped module that reaches eyas_testing, lazily
LAZY_IMPORTER = REPO / "common" / "eyas_common" / "cli.py"
# each Dockerfile and the folder it is built from (the Makefile's docker build lines)
CONTEXTS = {REPO / "docker" / "Dockerfile": REPO / "docker", **{d: REPO for d in REPO.glob("stages/*/Dockerfile")}}


def copy_sources(dockerfile: Path, context: Path) -> list[Path]:
    """The COPY sources of a Dockerfile, as paths here (COPY --from=STAGE copies from another build stage)."""
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from=") for w in words):
            sources += [context / w for w in words[1:-1] if not w.startswith("--")]
    return sources


def shipped_files() -> list[Path]:
    """Every file a COPY line sends into an image, leaving out what .dockerignore leaves out (caches, egg-info)."""
    files = []
    for dockerfile, context in CONTEXTS.items():
        for source in copy_sources(dockerfile, context):
            files += [p for p in source.rglob("*") if p.is_file()] if source.is_dir() else [source]
    return [f for f in files if "__pycache__" not in f.parts and not any(p.endswith(".egg-info") for p in f.parts)]


def names_of_eyas_testing(module: Path) -> list[str]:
    """What a module imports from eyas_testing, and its strings that start with the name (importlib, `-m`)."""
    names = []
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.append(node.value)
    return [n for n in names if n.startswith("eyas_testing")]


def test_images_copy_no_test_scaffolding():
    files = [f.relative_to(REPO) for f in shipped_files()]
    assert any(f.parts[:2] == ("common", "eyas_common") for f in files), "no COPY of common/ found: parse again"
    assert not [f for f in files if f.parts[0] in ("testing", "tests")]
    assert not [f for f in files if SCAFFOLDING & set(f.parts)]


def test_the_build_context_leaves_testing_out():
    rules = [r for r in (REPO / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*", "the context must start from nothing and name what it sends"
    sent = [r[1:] for r in rules if r.startswith("!")]
    assert sent and not [r for r in sent if r.startswith(("testing", "tests"))]


def test_shipped_modules_do_not_import_eyas_testing():
    modules = [f for f in shipped_files() if f.suffix == ".py"]
    assert LAZY_IMPORTER in modules
    assert not [f for f in modules if f != LAZY_IMPORTER and names_of_eyas_testing(f)]
    top_level = [node for node in ast.parse(LAZY_IMPORTER.read_text()).body
                 if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert "eyas_testing" not in "".join(ast.unparse(node) for node in top_level)
    for pyproject in [REPO / "common" / "pyproject.toml", *REPO.glob("stages/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        extras = project.get("optional-dependencies", {}).values()
        assert not [d for d in [*project["dependencies"], *sum(extras, [])] if d.startswith("eyas-testing")]


def test_fixture_command_without_the_testing_package_is_one_line():
    # As in an image: eyas_common and the libraries, no eyas_testing. `-S` leaves out the .pth files that
    # make the editable installs importable; common/ and site-packages then come from PYTHONPATH alone.
    path = f"{REPO / 'common'}:{sysconfig.get_paths()['purelib']}"
    code = "from eyas_common.cli import main; main(['fixture', '--out', 'unused'])"
    r = subprocess.run([sys.executable, "-S", "-c", code], env={**os.environ, "PYTHONPATH": path},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "Error: the fixture builders come with the testing package eyas-testing, which is not installed here: "
        "run `make install` (or `pip install -e testing`) in a checkout"], r.stderr
