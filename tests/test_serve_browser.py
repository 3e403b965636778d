"""A real web page cannot use a keyless server on 127.0.0.1: headless Chromium opens a page served from
another local port, whose script posts a completion to the server the way any site could (a `fetch` with a
`text/plain` body needs no CORS preflight); the server refuses it and runs nothing. Skipped where Chromium
is not installed (`apt-get install -y chromium`; `.ci/run` installs it)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from test_serve import _metric, serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
PAGE = """<!doctype html><title>elsewhere</title><script>
fetch("{target}/v1/completions", {{method: "POST", mode: "no-cors",
      body: JSON.stringify({{model: "default", prompt: "from a web page", max_tokens: 4}})}})
  .then(() => "sent", e => "failed: " + e).then(r => fetch("/done?" + encodeURIComponent(r)));
</script>"""


class Page(BaseHTTPRequestHandler):
    """Serves the page at / and notes the page's /done report."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/done"):
            self.server.report = self.path  # type: ignore[attr-defined]
            self.server.done.set()  # type: ignore[attr-defined]
            body, kind = b"ok", "text/plain"
        elif self.path == "/":
            body, kind = PAGE.format(target=self.server.target).encode(), "text/html"  # type: ignore[attr-defined]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium); the "
                    "cross-origin browser check needs a real browser")
def test_a_page_on_another_origin_cannot_use_the_server(rt, tmp_path):
    with serve(rt, policy={"mode": "plain"}) as url:
        page = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        page.target, page.done, page.report = url, threading.Event(), None  # type: ignore[attr-defined]
        threading.Thread(target=page.serve_forever, daemon=True).start()
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={tmp_path / 'profile'}", f"http://127.0.0.1:{page.server_address[1]}/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            reported = page.done.wait(180)  # the page's script ran its request to the end
        finally:
            browser.terminate()
            try:
                browser.wait(30)
            except subprocess.TimeoutExpired:
                browser.kill()
            page.shutdown()
        assert reported, "the page never reported back (Chromium did not run it)"
        assert page.report == "/done?sent"  # the request left the browser (the server saw it)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, 'medusa_responses_total{outcome="forbidden"}') == 1
        assert _metric(metrics, 'medusa_responses_total{outcome="ok"}') == 0
        assert _metric(metrics, "medusa_prompt_tokens_total") == 0  # nothing reached the engine
