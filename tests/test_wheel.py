"""The built wheel: it holds the whole package and what the runtime reads, claims no other top-level name,
and its `medusa` command generates text when installed alone, away from the source tree.

The wheel goes into a fresh venv without dependencies; the test environment's site-packages are added to
it by a .pth file. A directory added that way is not scanned for .pth files itself, so the project's
editable install in that environment (its finder is loaded from a .pth) stays out: `medusa` can only come
from the wheel, which the test checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the runtime reads from the package (medusa.io.ASSETS): trees, heads, feature heads, the draft.
SHIPPED = ["medusa/assets/heads/trees/*.yaml", "medusa/assets/trees/*.yaml", "medusa/assets/heads/*",
           "medusa/assets/draft/*", "medusa/assets/feature_heads/*"]
# Left out of the build's source copy: a build/ from an earlier build would put stale files in the wheel.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    "runs", "out", "wandb")

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # PYTHONPATH would shadow the wheel
    env["TOKENIZERS_PARALLELISM"] = "false"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    proc = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                str(tmp / "dist"), "."], cwd=src)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (tmp / "dist").glob("medusa_decoding-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A venv holding only the wheel, with the test environment's dependencies visible through a .pth."""
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    # This environment's pip installs into the venv; the .pth comes after, so pip does not see the editable
    # install's metadata and take the wheel as already installed.
    proc = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                str(wheel)], cwd=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=env).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "test-deps.pth").write_text("".join(f"{d}\n" for d in deps))
    return env


def test_wheel_holds_the_package_its_assets_and_no_other_top_level(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"medusa", dist_info}, "the wheel claims other top-level names"
    source = [p for p in (ROOT / "medusa").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    missing = sorted(str(p.relative_to(ROOT)) for p in source if str(p.relative_to(ROOT)) not in names)
    assert not missing, f"package files not in the wheel: {missing}"
    for pattern in SHIPPED:
        assert any(Path(n).match(pattern) for n in names), f"the wheel has nothing like {pattern}"
    zf = zipfile.ZipFile(wheel)
    assert zf.read(f"{dist_info}/top_level.txt").decode().split() == ["medusa"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    for name, target in scripts.items():
        assert f"{name} = {target}" in entry_points, entry_points


def test_installed_wheel_imports_from_itself_alone(venv, tmp_path):
    python = str(venv / "bin" / "python")
    check = ("import sys, medusa\n"
             "from medusa.decoding.proposers.draft import SHIPPED_DRAFT\n"
             "from medusa.decoding.proposers.feature_heads import SHIPPED_FEATURE_DIR\n"
             "from medusa.decoding.proposers.heads import SHIPPED_DIR\n"
             "from medusa.decoding.trees.tree import CONFIG_DIR, HAND_MADE_DIR\n"
             "print(medusa.__file__)\n"
             "print(sorted(m for m in sys.modules if 'editable' in m))\n"
             "for d in (SHIPPED_DRAFT, SHIPPED_FEATURE_DIR, SHIPPED_DIR, CONFIG_DIR, HAND_MADE_DIR):\n"
             "    print(d, len(list(d.iterdir())))\n")
    proc = run([python, "-c", check], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, editable, *dirs = proc.stdout.splitlines()
    assert Path(where).is_relative_to(venv), f"medusa imported from {where}, not from the installed wheel"
    assert editable == "[]", f"the editable install's finder was loaded: {editable}"
    for line in dirs:
        path, count = line.rsplit(" ", 1)
        assert Path(path).is_relative_to(venv) and int(count) > 0, line
    for name in ("train", "serve"):  # the sub-packages live under medusa/, never beside it
        proc = run([python, "-c", f"import medusa, {name}"], cwd=tmp_path)
        assert proc.returncode != 0 and f"No module named '{name}'" in proc.stderr, proc.stderr[-500:]


def test_installed_command_generates_outside_the_source_tree(venv, tmp_path):
    # --mode heads with a named tree rather than the default auto: auto (and an unnamed feature tree)
    # measures this machine's pass-cost curve on first use (minutes on a busy two-core CPU), which is not
    # what this test is about; this decodes with the default model and heads (the shipped feature heads)
    # that the wheel carries.
    proc = run([str(venv / "bin" / "medusa"), "generate", "--prompt", "Say hello.", "--max-new-tokens", "8",
                "--mode", "heads", "--tree", "dynamic-6x2"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, rest = proc.stdout.split("\n", 1)
    assert head.startswith("--- [0] ("), proc.stdout
    text = rest.split("--- stats:")[0]
    assert text.strip(), f"no text generated: {proc.stdout!r}"
    assert "mode=feature" in rest and "tree=dynamic-6x2" in rest, proc.stdout
