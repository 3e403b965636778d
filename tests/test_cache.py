"""The model/data cache is filled once even when several processes start together."""

from __future__ import annotations

import multiprocessing as mp
import zipfile
from pathlib import Path

MEMBER = "pkg_x/data.bin"
PROCESSES = 4


def _fetch(cache: str, contend, out) -> None:
    import os

    os.environ["MEDUSA_CACHE"] = cache
    import medusa.io as mio

    write_atomic, cache_lock = mio.write_atomic, mio.cache_lock

    def counted_write(path, write):  # one line per extraction, in a log all the processes share
        with open(Path(cache) / "extractions.log", "a") as log:
            log.write(f"{os.getpid()}\n")
        return write_atomic(path, write)

    def contended_lock(name):  # every process has found the cache empty before any of them may fill it
        contend.wait(timeout=300)  # a safety net: a process that died before here fails the others
        return cache_lock(name)

    mio.write_atomic, mio.cache_lock = counted_write, contended_lock
    try:
        out.put(str(mio.fetch_wheel_file("pkg-x==1.0", MEMBER)))
    except Exception as exc:  # reported to the parent, which fails the test with it
        out.put(f"ERROR {type(exc).__name__}: {exc}")


def test_concurrent_fetch_extracts_once(tmp_path: Path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = bytes(range(256)) * 4000
    with zipfile.ZipFile(wheels / "pkg_x-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(MEMBER, payload)
    ctx = mp.get_context("spawn")
    out, contend = ctx.Queue(), ctx.Barrier(PROCESSES)
    procs = [ctx.Process(target=_fetch, args=(str(tmp_path), contend, out)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    for p in procs:  # the results are a line each: the queue's feeder never blocks a process's exit
        p.join()
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    results = [out.get_nowait() for _ in procs]
    assert all(not r.startswith("ERROR") for r in results), results
    assert len(set(results)) == 1
    assert Path(results[0]).read_bytes() == payload
    assert not list(Path(results[0]).parent.glob("*.part"))
    extractions = (tmp_path / "extractions.log").read_text().split()
    assert len(extractions) == 1, f"{len(extractions)} processes extracted the file"
