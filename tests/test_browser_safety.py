"""Browser safety (issue 23 item 5): a page on another site cannot use lse-server through its visitor's
browser. JSON endpoints take only application/json (415 otherwise: the other types need no CORS preflight),
CORS is off unless --cors-origins allows an origin, and a server bound to loopback answers only loopback
Host names (or --allowed-hosts), which defeats DNS rebinding.

The CORS expectations are the Fetch standard's: a preflight is allowed only when the answer carries
Access-Control-Allow-Origin matching the page's origin."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from test_server import API_KEY, CHAT_TEMPLATE, HELLO, Server, assert_error, lse_server

from lse_http.browser import allowed_hosts, host_name

APP_ORIGIN = "http://app.example:3000"
BODY = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(checkpoint) -> Iterator[Server]:
    with lse_server(checkpoint, "--pool", "cpu:0") as running:
        yield running


@pytest.fixture(scope="module")
def open_server(checkpoint) -> Iterator[Server]:
    """A server that lets one origin's pages in and answers one more host name."""
    with lse_server(checkpoint, "--pool", "cpu:0", "--cors-origins", APP_ORIGIN,
                    "--allowed-hosts", "lse.internal") as running:
        yield running


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_body_not_declared_json_is_refused_with_415(server: Server, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    with server.client() as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/embeddings"):
            # httpx sends no Content-Type for raw bytes unless told: the untyped case is a real one
            response = http.post(path, content=BODY, headers=headers)
            assert_error(response, 415, "invalid_request_error", "unsupported_media_type")
            assert "application/json" in response.json()["error"]["message"]
        # the next request, declared JSON, runs: nothing was lost
        assert http.post("/v1/chat/completions", content=BODY,
                         headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_415_on_the_messages_api_is_in_anthropics_shape(server: Server) -> None:
    with server.client() as http:
        body = {"model": "m", "max_tokens": 2, "messages": HELLO}
        response = http.post("/v1/messages", content=json.dumps(body), headers={"content-type": "text/plain"})
    assert response.status_code == 415
    assert response.json()["type"] == "error"
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_cors_is_off_by_default(server: Server) -> None:
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        answer = http.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in answer.headers
        assert answer.status_code >= 400
        reply = http.get("/health", headers={"Origin": "http://evil.example"})
        assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


def test_cors_origins_lets_that_origin_in_and_no_other(open_server: Server) -> None:
    with httpx.Client(base_url=open_server.url, timeout=30) as http:
        preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        answer = http.options("/v1/chat/completions", headers=preflight)   # a preflight carries no API key
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP_ORIGIN
        allowed = answer.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "content-type" in allowed
        reply = http.post("/v1/chat/completions", content=BODY,
                          headers={"Origin": APP_ORIGIN, "content-type": "application/json",
                                   "authorization": f"Bearer {API_KEY}"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == APP_ORIGIN
        other = http.options("/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "192.168.1.5"])
def test_a_rebound_host_name_is_refused(server: Server, host: str) -> None:
    with server.client() as http:
        response = http.get("/v1/models", headers={"host": host})
        error = assert_error(response, 403, "permission_error", "host_not_allowed")
        assert "--allowed-hosts" in error["message"]
        assert http.get("/health", headers={"host": host}).status_code == 403


def test_loopback_host_names_are_answered(server: Server) -> None:
    port = server.url.rsplit(":", 1)[1]
    with server.client() as http:
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_adds_a_name(open_server: Server) -> None:
    with open_server.client() as http:
        assert http.get("/v1/models", headers={"host": "lse.internal:8080"}).status_code == 200
        assert http.get("/v1/models", headers={"host": "evil.example"}).status_code == 403


def test_which_hosts_a_bind_address_answers() -> None:
    assert set(allowed_hosts("127.0.0.1", [])) >= {"localhost", "127.0.0.1", "::1"}
    assert "::1" in allowed_hosts("::1", [])
    assert allowed_hosts("0.0.0.0", []) is None                 # a LAN or proxied server: any Host
    assert allowed_hosts("0.0.0.0", ["lse.lan"]) == ["lse.lan"]
    assert [host_name(h) for h in ("[::1]:8080", "Localhost:80", "::1", "a.b")] == ["::1", "localhost", "::1", "a.b"]
