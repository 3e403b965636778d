"""What the server refuses at its edge, through raw sockets and plain HTTP: bodies that are not UTF-8 JSON
(415/400), duplicate keys, requests a browser page or a rebound DNS name can send (403), ambiguous framing
(Transfer-Encoding with Content-Length), heads over the limit however their bytes arrive, and connections
closed at once after an answer that leaves a body unread. Every wait is on an event (the server closing
the socket, a metric reaching its value), bounded by a timeout, never a sleep."""

from __future__ import annotations

import json

import httpx
import pytest

from test_serve import CLIENT_TIMEOUT, _metric, _raw, _read_all, _wait, serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
BODY = json.dumps({"model": "default", "prompt": "hi", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def url(rt):
    with serve(rt, policy={"mode": "plain"}) as url:  # the default head limit, 16384 bytes
        yield url


def outcome(url: str, name: str) -> float:
    return _metric(httpx.get(url + "/metrics", timeout=10).text, f'medusa_responses_total{{outcome="{name}"}}')


def post(url: str, content: bytes, headers: dict | None = None, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, content=content, headers=headers or {}, timeout=CLIENT_TIMEOUT)


def request(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n" + body


def exchange(url: str, data: bytes, step: int = 0) -> bytes:
    """Send `data` on a fresh socket (in writes of `step` bytes, 0: one write) and read until the server
    closes the connection: a server that keeps it open fails the test at the socket timeout."""
    with _raw(url) as sock:
        for i in range(0, len(data), step or len(data)):
            try:
                sock.sendall(data[i: i + (step or len(data))])
            except (BrokenPipeError, ConnectionResetError):  # refused and closed while we were still writing
                break
        try:
            return _read_all(sock)
        except ConnectionResetError:
            return b""


# ---- the body: JSON in UTF-8 only --------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Content-Type": "text/plain"}, {"Content-Type": "text/plain;charset=UTF-8"},
                                     {"Content-Type": "application/x-www-form-urlencoded"},
                                     {"Content-Type": "multipart/form-data; boundary=x"},
                                     {"Content-Type": "application/json; charset=utf-16"}])
def test_a_body_not_sent_as_json_is_415(url, headers):
    r = post(url, BODY, headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type" and "UTF-8" in r.text or "application/json" in r.text


@pytest.mark.parametrize("raw, words", [
    (b"\xef\xbb\xbf" + BODY, "byte order mark"),
    (b"\xff\xfe" + BODY.decode().encode("utf-16-le"), "byte order mark"),
    (BODY.decode().encode("utf-16-le"), "not valid JSON"),
    (BODY.decode().encode("utf-16"), "byte order mark"),
    (b'{"model": "default", "prompt": "caf\xe9"}', "not UTF-8"),
])
def test_a_body_not_in_utf8_is_400(url, raw, words):
    r = post(url, raw, {"Content-Type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("raw, key", [
    (b'{"model": "default", "prompt": "hi", "max_tokens": 0, "max_tokens": 3}', "max_tokens"),
    (b'{"model": "gpt-4", "model": "default", "prompt": "hi", "max_tokens": 2}', "model"),
    (b'{"model": "default", "messages": [{"role": "user", "role": "system", "content": "x"}]}', "role"),
])
def test_duplicate_keys_are_400_naming_the_key(url, raw, key):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = post(url, raw, {"Content-Type": "application/json"}, path)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == key and "duplicate key" in err["message"], r.text


# ---- Host and Origin ------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, code", [
    ({"Host": "attacker.example:8000"}, "host_not_allowed"),  # a DNS name rebound to 127.0.0.1
    ({"Origin": "http://attacker.example"}, "origin_not_allowed"),
    ({"Origin": "null"}, "origin_not_allowed"),  # sandboxed frames, file: and data: pages
    ({"Origin": "http://127.0.0.1:1"}, "origin_not_allowed"),  # another local page is another origin
])
def test_foreign_hosts_and_origins_are_403_on_a_keyless_loopback_server(url, headers, code):
    r = post(url, BODY, {"Content-Type": "application/json", **headers})
    assert r.status_code == 403 and r.json()["error"]["code"] == code, r.text
    assert httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code == 403


def test_own_names_and_origin_are_served(url):
    port = url.rsplit(":", 1)[1]
    for headers in ({"Host": f"localhost:{port}"}, {"Host": f"[::1]:{port}"}, {"Host": "127.0.0.1"},
                    {"Origin": url}, {"Origin": url, "Host": f"127.0.0.1:{port}"}):
        r = post(url, BODY, {"Content-Type": "application/json", **headers})
        assert r.status_code == 200, (headers, r.text)


def test_allow_list_is_extended_by_flags_and_off_with_a_key(rt):
    with serve(rt, policy={"mode": "plain"}, allowed_hosts=["medusa.internal"],
               cors_origins=["http://app.example"]) as url:
        ok = {"Content-Type": "application/json", "Host": "medusa.internal:80", "Origin": "http://app.example"}
        r = post(url, BODY, ok)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        pre = httpx.options(url + "/v1/completions", timeout=10, headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200
        assert post(url, BODY, {**ok, "Origin": "http://other.example"}).status_code == 403
    with serve(rt, policy={"mode": "plain"}, api_key="k") as url:  # a key guards it: no allow-list
        r = post(url, BODY, {"Content-Type": "application/json", "Host": "any.example", "Authorization": "Bearer k"})
        assert r.status_code == 200


def test_cors_is_off_unless_configured(url):
    r = httpx.options(url + "/v1/completions", timeout=10, headers={
        "Origin": url, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in r.headers


# ---- framing and the connection ----------------------------------------------------------------------------

def test_transfer_encoding_with_content_length_is_400_and_closes(url):
    before = outcome(url, "malformed")
    reply = exchange(url, request(f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
                                  f"Transfer-Encoding: chunked\nContent-Length: {len(BODY)}\n",
                                  b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)))
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply
    assert b"Transfer-Encoding and Content-Length" in reply and reply.count(b"HTTP/1.1") == 1
    assert outcome(url, "malformed") == before + 1


def test_an_overflowing_chunk_size_is_malformed_not_cancelled(url):
    before = {k: outcome(url, k) for k in ("malformed", "cancelled")}
    reply = exchange(url, request("POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
                                  "Transfer-Encoding: chunked\n", b"f" * 24 + b"\r\n" + BODY))
    assert reply.startswith(b"HTTP/1.1 400") and b"malformed HTTP request" in reply, reply
    assert _wait(lambda: outcome(url, "malformed") == before["malformed"] + 1, 60)
    assert outcome(url, "cancelled") == before["cancelled"]


@pytest.mark.parametrize("step", [0, 1024])
def test_one_header_limit_however_the_bytes_arrive(url, step):
    before = outcome(url, "headers_too_large")
    big = request("GET /health HTTP/1.1\nHost: 127.0.0.1\n" + "".join(f"X-Pad-{i}: {'a' * 90}\n" for i in range(1100)))
    reply = exchange(url, big, step)
    assert reply.startswith(b"HTTP/1.1 431") and b"16384 bytes" in reply, reply[:200]
    assert outcome(url, "headers_too_large") == before + 1
    small = request("GET /health HTTP/1.1\nHost: 127.0.0.1\nConnection: close\n" +
                    "".join(f"X-Pad-{i}: {'a' * 90}\n" for i in range(150)))  # ~15 KB: under the limit
    assert exchange(url, small, step).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("kind", ["413", "415", "400"])
def test_the_connection_closes_at_once_after_an_early_answer(rt, kind):
    """413 on a declared length, 415, 400 on framing: the server closes the socket with its answer (the
    socket's timeout is far above the keep-alive and header deadlines, so a lingering socket fails)."""
    with serve(rt, policy={"mode": "plain"}, max_body_bytes=4096, keepalive_timeout_s=600,
               header_timeout_s=600) as url:
        head = "POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: {}\nContent-Length: {}\n"
        data = {"413": request(head.format("application/json", 100_000), b"x" * 1000),
                "415": request(head.format("text/plain", 1000), b"x" * 10),
                "400": request(head.format("application/json", 10) + "Transfer-Encoding: chunked\n", b"x")}[kind]
        with _raw(url) as sock:
            sock.settimeout(CLIENT_TIMEOUT)
            sock.sendall(data)
            reply = _read_all(sock)  # returns when the server closes
        assert reply.startswith(f"HTTP/1.1 {kind}".encode()) and b"connection: close" in reply.lower(), reply


def test_a_complete_bad_body_keeps_the_connection(url):
    with httpx.Client(timeout=30) as http:
        bad = http.post(url + "/v1/completions", content=b'{"model": "default", "prompt": "x", "prompt": "y"}',
                        headers={"Content-Type": "application/json"})
        good = http.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert bad.status_code == 400 and good.status_code == 200
        assert "connection" not in bad.headers

