"""The distribution as pip sees it: its name, and a torch requirement that any release from 2.6 on meets."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# torch releases the distribution must accept: the oldest supported, the one the project is tested with, the
# newest at the time of writing; and the installed one.
TORCH_ACCEPTED = ["2.6.0", "2.7.1", "2.10.0", "2.13.0", "2.14.1", "2.15.0"]


@pytest.fixture(scope="module")
def metadata(tmp_path_factory) -> email.message.Message:
    """The METADATA setuptools builds from pyproject.toml (the same file the wheel carries), built in a copy so
    the source tree gets no egg-info."""
    tmp = tmp_path_factory.mktemp("meta")
    src = tmp / "src"
    (src / "medusa").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    (src / "medusa" / "__init__.py").write_text("")
    out = tmp / "out"
    out.mkdir()
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dist_info = out / proc.stdout.strip().splitlines()[-1]
    return email.message_from_string((dist_info / "METADATA").read_text())


def torch_requirement(meta) -> Requirement:
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    (torch,) = [r for r in reqs if r.name == "torch" and r.marker is None]
    return torch


def test_torch_requirement_admits_every_release_from_2_6(metadata):
    import torch

    spec = torch_requirement(metadata).specifier
    installed = Version(torch.__version__.split("+")[0])
    for v in TORCH_ACCEPTED + [str(installed)]:
        assert spec.contains(v), f"the distribution refuses torch {v} ({spec})"
    assert not spec.contains("2.5.1"), "torch before 2.6 lacks what the project uses"


def test_distribution_name_is_not_the_taken_one(metadata):
    from medusa.cli import DISTRIBUTION

    assert metadata["Name"] == DISTRIBUTION == "medusa-decoding"  # `medusa` on PyPI is another project


def test_installed_distribution_matches_pyproject(metadata):
    """The environment's install (scripts/setup.sh, editable) is of this name, and `medusa --version` reads it."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("medusa-decoding")
    except PackageNotFoundError:
        pytest.skip("medusa-decoding is not installed here (run scripts/setup.sh)")
    assert torch_requirement(dist.metadata).specifier == torch_requirement(metadata).specifier
    script = Path(sys.executable).with_name("medusa")  # the entry point the install wrote
    assert script.is_file(), f"no medusa command next to {sys.executable}"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"medusa {metadata['Version']}", proc.stdout + proc.stderr
