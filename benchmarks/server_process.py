"""One `medusa serve` process on the loopback interface, as the load and soak benchmarks run it.

The server gets a free port on 127.0.0.1, its YAML config and its log in a working folder the caller owns;
`wait_ready` polls /health (bounded by a timeout) and `stop` terminates it, killing it after 30 s.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m medusa.cli serve` with `cfg` (host and port are set here), logging to `workdir/name.log`."""

    def __init__(self, name: str, cfg: dict, workdir: Path, root: Path | None = None):
        """`root`: run the server from another checkout of the project (its code first on the path)."""
        self.name, self.port = name, free_port()
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**cfg, "host": HOST, "port": self.port}))
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if root is not None:
            env["PYTHONPATH"] = str(root)
        self.proc = subprocess.Popen([sys.executable, "-m", "medusa.cli", "serve", "--config", str(path)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=root)
        self.url = f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server {self.name} did not start within {timeout:.0f} s")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("VmRSS not found")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def counter(url: str, name: str) -> dict[str, float]:
    """The samples of the one-label Prometheus counter `name` at `url`/metrics, by label value."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out
