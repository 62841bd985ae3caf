"""What every request passes before a route sees it (server/guard.py), and the bounds checked before tokenising.

Through FastAPI's TestClient where a request is enough; through a real uvicorn server and raw sockets where the
point is what happens on the wire (a body that never finishes, a 300 MiB Content-Length, a Host header).
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from fastapi.testclient import TestClient
from server_harness import ServerThread

from lmhead.server import create_app
from lmhead.server import schemas as S
from lmhead.server.guard import LOOPBACK_HOSTS, MAX_BODY_BYTES, Limits, host_name
from lmhead.server.protocol import HeaderTimeoutProtocol

JSON = {"content-type": "application/json"}
ROUTES = {  # a valid small body for each POST route, as raw JSON text with a hole "@" for the value under test
    "/api/predict": '{"prompt": "Hi", "temperature": @}',
    "/api/step": '{"prompt": "Hi", "top_p": @}',
    "/v1/completions": '{"prompt": "Hi", "max_tokens": 2, "min_p": @}',
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
                            '"presence_penalty": @}',
}
PARAMS = {"/api/predict": "temperature", "/api/step": "top_p", "/v1/completions": "min_p",
          "/v1/chat/completions": "presence_penalty"}


def field_of(route: str, r) -> str | None:
    """The field an error names: OpenAI's `param` under /v1, the 422 detail's location under /api."""
    body = r.json()
    if route.startswith("/v1/"):
        return body["error"]["param"]
    return ".".join(str(p) for p in body["detail"][0]["loc"][1:])


# --- strict JSON: non-finite numbers and lone surrogates are 422, naming the field ------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_a_non_finite_number_is_422_naming_its_field(client, route, number):
    r = client.post(route, content=ROUTES[route].replace("@", number), headers=JSON)
    assert r.status_code == 422, r.text
    assert field_of(route, r) == PARAMS[route]
    assert "finite" in r.text


@pytest.mark.parametrize("route,body,field", [
    ("/api/predict", '{"prompt": "\\ud800"}', "prompt"),
    ("/api/step", '{"prompt": "a\\udc00b"}', "prompt"),
    ("/api/score", '{"text": "x\\udfff"}', "text"),
    ("/api/layers", '{"prompt": "\\ude00\\ud83d"}', "prompt"),  # the halves of a pair, in the wrong order
    ("/v1/completions", '{"prompt": ["\\ud800"], "max_tokens": 2}', "prompt.0"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\udbff"], "max_tokens": 2}', "stop.0"),
    ("/v1/completions", '{"prompt": "Hi", "logit_bias": {"\\ud800": 1}, "max_tokens": 2}', "logit_bias.\\ud800"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
])
def test_a_lone_surrogate_is_422_naming_its_field(client, route, body, field):
    r = client.post(route, content=body, headers=JSON)
    assert r.status_code == 422, r.text
    assert field_of(route, r) == field
    assert "surrogate" in r.text


def test_a_surrogate_pair_is_a_character_and_is_accepted(client):
    r = client.post("/api/step", content='{"prompt": "Hi \\ud83d\\ude00", "temperature": 0}', headers=JSON)
    assert r.status_code == 200 and r.json()["prompt"].startswith("Hi \U0001F600")


def test_a_stream_refuses_bad_json_before_it_starts(client):
    body = '{"prompt": "Hi", "max_tokens": 2, "stream": true, "temperature": NaN}'
    r = client.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 422 and r.json()["error"]["param"] == "temperature"
    r = client.post("/api/generate", content='{"prompt": "\\ud800"}', headers=JSON)
    assert r.status_code == 422 and "text/event-stream" not in r.headers["content-type"]


def test_json_that_is_not_json_is_still_fastapis_422(client):
    r = client.post("/api/predict", content=b'{"prompt": "Hi",', headers=JSON)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


# --- errors do not send the input back ------------------------------------------------------------------------


@pytest.mark.parametrize("route,body", [
    ("/api/predict", {"prompt": "a" * 500_000}),
    ("/api/score", {"text": "b" * 500_000}),
    ("/v1/completions", {"prompt": "c" * 500_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "d" * 500_000}]}),
    ("/api/predict", {"prompt": "Hi", "e" * 500_000: 1}),  # an unknown field with a long name
    ("/api/predict", {"prompt": ["f" * 1000] * 400}),  # the wrong type, large
])
def test_a_422_names_the_field_and_the_rule_without_echoing_the_input(client, route, body):
    r = client.post(route, json=body)
    assert r.status_code == 422
    assert len(r.content) < 1000, f"{len(r.content)} bytes came back"
    assert not re.search(r"(.)\1{64}", r.text), "a long run of the input came back"
    if route.startswith("/api/"):
        error = r.json()["detail"][0]
        assert error["loc"][0] == "body" and error["msg"] and error["type"]
        assert "ctx" not in error and "url" not in error
    else:
        assert r.json()["error"]["param"] in ("prompt", "messages", "messages.0.content")


def test_a_short_bad_value_is_still_shown(client):
    error = client.post("/api/predict", json={"prompt": "Hi", "temperature": 3.5}).json()["detail"][0]
    assert error["loc"] == ["body", "temperature"] and error["input"] == 3.5 and "2" in error["msg"]


# --- bounds on text, checked before anything is tokenised -----------------------------------------------------


class _CountingEncode:
    """Wraps model.encode to count calls (a bound checked before tokenising leaves the count at 0)."""

    def __init__(self, monkeypatch, model):
        self.calls, original = 0, model.encode

        def encode(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "encode", encode)


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "x" * (S.MAX_PROMPT_CHARS + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["x" * (S.MAX_PROMPT_CHARS + 1)]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * (S.MAX_STOP_CHARS + 1)}, "stop"),
    ("/v1/completions", {"prompt": "x", "user": "u" * (S.MAX_NAME_CHARS + 1)}, "user"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(S.MAX_LOGIT_BIAS + 1)}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (S.MAX_PROMPT_CHARS // 2 + 1)}] * 2},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (S.MAX_MESSAGES + 1)}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 15_000}] * 2}]},
     "messages"),
])
def test_v1_text_over_its_bound_is_422_before_tokenising(client, model, monkeypatch, route, body, param):
    counter = _CountingEncode(monkeypatch, model)
    r = client.post(route, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param
    assert counter.calls == 0


def test_v1_text_at_its_bound_reaches_the_token_bound(client):
    r = client.post("/v1/completions", json={"prompt": "x " * (S.MAX_PROMPT_CHARS // 2), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# --- the body's size ------------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413(client):
    body = json.dumps({"prompt": "Hi", "user": "u" * MAX_BODY_BYTES}).encode()
    r = client.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body is")
    assert r.headers["connection"] == "close"
    r = client.post("/api/predict", content=body, headers=JSON)
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def test_a_body_just_under_the_limit_is_parsed(client):
    filler = MAX_BODY_BYTES - 100
    r = client.post("/api/predict", content=json.dumps({"prompt": "Hi", "x": "y" * filler}), headers=JSON)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "extra_forbidden"


def _send_raw(port: int, head: bytes, body: bytes = b"", timeout: float = 20.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(head + body)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _head(path: str, length: int | None, host: str = "127.0.0.1") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{size}\r\n").encode()


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(create_app(model, max_body_bytes=64 * 1024, body_timeout=1.0)) as s:
        yield s


def test_a_300_mib_content_length_is_refused_before_its_body_is_read(server):
    start = time.monotonic()
    s = _send_raw(server.port, _head("/v1/completions", 300 << 20), b'{"user": "')
    data = _read_until_closed(s)
    s.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"314,572,800" in data and time.monotonic() - start < 1.0  # before the body timeout: nothing was waited for


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(server):
    s = _send_raw(server.port, _head("/v1/completions", None))
    sent, chunk = 0, b"x" * 8192
    try:
        while sent < 1 << 20:  # the server answers long before 1 MiB
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = _read_until_closed(s)
    s.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]


def test_half_sent_bodies_get_408_and_their_connections_close(server):
    start = time.monotonic()
    socks = [_send_raw(server.port, _head("/api/predict", 1000), b'{"prompt": "' + b"a" * 400) for _ in range(20)]
    answers = [_read_until_closed(s) for s in socks]  # recv returns b"" once the server closes
    waited = time.monotonic() - start
    for s in socks:
        s.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0][:200]
    assert b"not received within 1 s" in answers[0]
    assert 0.9 <= waited < 6.0, waited
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:  # still serving
        s.sendall(b"GET /api/model HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert _read_until_closed(s).startswith(b"HTTP/1.1 200")


def test_a_body_that_keeps_coming_within_the_time_is_served(server):
    body = json.dumps({"prompt": "The cat", "temperature": 0}).encode()
    s = _send_raw(server.port, _head("/api/step", len(body)))
    for i in range(0, len(body), 10):
        s.sendall(body[i:i + 10])
        time.sleep(0.02)
    assert _read_until_closed_or_response(s).startswith(b"HTTP/1.1 200")
    s.close()


def _read_until_closed_or_response(s: socket.socket) -> bytes:
    s.settimeout(10)
    return s.recv(65536)


# --- headers (server/protocol.py: uvicorn has no header timeout) --------------------------------------------


class _OneSecondHeaders(HeaderTimeoutProtocol):
    header_timeout = 1.0


@pytest.fixture(scope="module")
def quick_headers(model):
    with ServerThread(create_app(model), http=_OneSecondHeaders) as s:
        yield s


def test_half_sent_headers_get_408_and_their_connections_close(quick_headers):
    start = time.monotonic()
    socks = [socket.create_connection(("127.0.0.1", quick_headers.port), timeout=20) for _ in range(10)]
    for i, s in enumerate(socks):
        s.sendall(b"POST /api/predict HTTP/1.1\r\nHo" if i % 2 else b"")  # half the headers, or nothing at all
    answers = [_read_until_closed(s) for s in socks]
    waited = time.monotonic() - start
    for s in socks:
        s.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert 0.9 <= waited < 6.0, waited


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(quick_headers):
    with socket.create_connection(("127.0.0.1", quick_headers.port), timeout=20) as s:
        s.sendall(b"GET /api/model HTTP/1.1\r\nHost: localhost\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /api/model HTTP/1.1\r\nHo")  # the next request's headers stall
        assert b"HTTP/1.1 408" in _read_until_closed(s)


def test_headers_that_arrive_in_time_are_served(quick_headers):
    request = b"GET /api/model HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", quick_headers.port), timeout=20) as s:
        for i in range(0, len(request), 8):  # slowly, but within the second
            s.sendall(request[i:i + 8])
            time.sleep(0.05)
        assert _read_until_closed(s).startswith(b"HTTP/1.1 200")


# --- Host ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("::1", "::1"),
                                         ("127.0.0.1", "127.0.0.1"), ("LocalHost.", "localhost"),
                                         ("evil.example:80", "evil.example")])
def test_host_name_takes_the_name_out_of_a_host_header(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000"])
def test_loopback_names_are_served(client, host):
    assert client.get("/api/model", headers={"host": host}).status_code == 200


@pytest.mark.parametrize("path", ["/", "/api/model", "/v1/models", "/docs"])
def test_another_host_is_400_against_dns_rebinding(client, path):
    r = client.get(path, headers={"host": "rebind.attacker.example:8000"})
    assert r.status_code == 400
    message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["detail"]
    assert "rebind.attacker.example" in message and "--allowed-host" in message


def test_a_real_server_refuses_a_foreign_host_and_serves_its_own(server):
    for host, status in [("rebind.attacker.example", b"400"), ("localhost:1", b"200"),
                         (f"127.0.0.1:{server.port}", b"200")]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"GET /api/model HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            assert _read_until_closed(s).startswith(b"HTTP/1.1 " + status), host


def test_allowed_hosts_add_names_and_star_accepts_any(model):
    with TestClient(create_app(model, allowed_hosts=["mybox.lan"])) as c:
        assert c.get("/api/model", headers={"host": "MyBox.lan:8000"}).status_code == 200
        assert c.get("/api/model", headers={"host": "other.lan"}).status_code == 400
        assert c.get("/api/model", headers={"host": "localhost"}).status_code == 200
    with TestClient(create_app(model, allowed_hosts=["*"])) as c:
        assert c.get("/api/model", headers={"host": "anything.example"}).status_code == 200


@pytest.mark.parametrize("kwargs", [{"max_body_bytes": 0}, {"max_body_bytes": 1.5}, {"body_timeout": 0},
                                    {"body_timeout": float("inf")}, {"allowed_hosts": "localhost"},
                                    {"allowed_hosts": [""]}])
def test_bad_guard_settings_are_refused_when_the_app_is_made(model, kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        create_app(model, **kwargs)


def test_limits_default_to_loopback_only():
    assert Limits().hosts == frozenset(LOOPBACK_HOSTS)


def test_serve_accepts_its_own_host_and_allowed_hosts_only(monkeypatch, request, model):
    from test_server import fake_serve

    from lmhead import cli

    _, apps = fake_serve(monkeypatch, request, model)
    assert cli.main(["serve", "--allowed-host", "mybox.lan", "--allowed-host", "other.lan"]) == 0
    assert cli.main(["serve", "--host", "box.example"]) == 0
    c, bound = TestClient(apps[0]), TestClient(apps[1])
    for host in ("mybox.lan", "other.lan:8000", "localhost"):
        assert c.get("/api/model", headers={"host": host}).status_code == 200, host
    assert c.get("/api/model", headers={"host": "evil.example"}).status_code == 400
    assert c.get("/api/model", headers={"host": "box.example"}).status_code == 400
    assert bound.get("/api/model", headers={"host": "box.example:8000"}).status_code == 200
    assert bound.get("/api/model", headers={"host": "mybox.lan"}).status_code == 400


# --- /docs: no CDN ---------------------------------------------------------------------------------------------


def test_docs_pages_load_nothing_from_off_the_server(client):
    assert client.get("/redoc").status_code == 404  # ReDoc's page loads its logo from a CDN: not served
    for page in ("/docs",):
        r = client.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        urls = re.findall(r"""(?:src|href|url)\s*[=:(]\s*["']?([^"' )>]+)""", r.text)
        assert urls, r.text
        for url in urls:
            assert not re.match(r"(https?:)?//", url), f"{page} loads {url}"
            if url.startswith("/docs-assets/"):
                asset = client.get(url)
                assert asset.status_code == 200 and len(asset.content) > 1000, url
    assert '"validatorUrl": null' in client.get("/docs").text  # no schema sent to validator.swagger.io
    css = client.get("/docs-assets/swagger-ui.css").text
    assert not re.search(r"url\(\s*[\"']?(https?:)?//", css)
