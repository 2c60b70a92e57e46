"""A client that stops reading its stream costs only itself: the kernel holds at most
the connection's send buffer (PAGELLM_HTTP_SEND_BUFFER_BYTES), the stream at most
PAGELLM_STREAM_BUFFER_TOKENS waiting tokens; past that the request is aborted in the
engine (its KV freed) and its stream ends with a 408 error event, while other clients'
streams run to their full length."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import psutil

from tests.entrypoints.openai.conftest import ServerProcess


def _stream_tokens(url: str, key: str, max_tokens: int) -> int:
    """Reads one streamed completion to its end; its usage's completion tokens."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


def test_a_client_that_stops_reading_is_cut_off_and_the_others_finish(tiny_model) -> None:
    srv = ServerProcess("--model", tiny_model("llama", max_position_embeddings=4096), "--max-model-len", "4096")
    try:
        server = psutil.Process(srv.proc.pid)
        rss_before = server.memory_info().rss
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
        slow.connect(("127.0.0.1", srv.port))
        body = json.dumps({"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True})
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {srv.api_key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        srv.wait_running(1)

        async def others() -> list[int]:
            return await asyncio.gather(*[asyncio.to_thread(_stream_tokens, srv.url, srv.api_key, 300)
                                          for _ in range(4)])

        assert asyncio.run(others()) == [300] * 4
        deadline = time.monotonic() + 60
        while srv.metric("pagellm:num_requests_running") > 0:  # the slow stream is cut off
            assert time.monotonic() < deadline, "the unread stream was never aborted"
            time.sleep(0.1)
        assert srv.metric("pagellm:kv_cache_usage_perc") == 0
        generated = srv.metric("pagellm:generation_tokens_total")
        assert 4 * 300 + 1025 <= generated < 4 * 300 + 4000  # the unread request stopped early
        assert server.memory_info().rss - rss_before < 64 << 20

        # what the slow client finds once it reads: the tokens sent, the error, [DONE]
        # This socket's receive window has been shut for as long as the others ran; once it
        # reads, the stream may take seconds to move again (over 5 s seen on a loaded CI
        # machine, the server's writer paused until its kernel sees the window reopen).
        data = b""
        slow.settimeout(60)
        while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
            chunk = slow.recv(1 << 16)
            assert chunk, "the server closed the connection before the end of the stream"
            data += chunk
        slow.close()
        events = [e.removeprefix("data: ") for e in _dechunk(data).decode().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error == {"message": "The stream was read too slowly: 1025 tokens were waiting to be sent "
                                    "(limit 1024); the request was aborted.",
                         "type": "RequestTimeoutError", "param": None, "code": 408}
        assert 100 < len(events) - 2 < 4000 - 1025
        r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {srv.api_key}"},
                       json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        srv.stop()
