"""YAML configs validated by pydantic models: one reader for every command, errors that name the key."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import MedusaError

M = TypeVar("M", bound=BaseModel)


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


def validate(model: type[M], data: dict[str, Any], where: str) -> M:
    """model(**data), or a MedusaError naming every bad key by its dotted path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            problems.append(f"{key}: {msg}")
        raise MedusaError(f"{where}: " + "; ".join(problems)) from None


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a part (temp file + rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
