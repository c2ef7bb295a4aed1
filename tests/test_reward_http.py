"""HttpReward (yatt/reward/http.py) against a real local HTTP server whose answers each test scripts."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from yatt.reward.http import HttpReward
from yatt.reward.item import RewardItem

DROP = object()  # script answer: close the connection without answering
FAST = dict(timeout_s=5.0, backoff_s=0.01, error_score=-1.0)  # time-outs only where a test wants one


def ok(items):
    """The server's correct answer: each item's score is the length of its response."""
    return 200, {"scores": [float(len(it["response"])) for it in items]}


class Server:
    """A local reward server. ``script(n, items)`` (n: request number from 0) answers each request
    with ``(status, body)`` (body: bytes, or an object sent as JSON) or ``DROP``; it may wait."""

    def __init__(self):
        self.script = lambda n, items: ok(items)
        self.lock = threading.Lock()
        self.seen = []  # the items of each request, in arrival order
        self.times = []  # arrival time of each request, time.monotonic()
        self.active = self.max_active = 0
        self.release = threading.Event()  # set at teardown: ends a script's wait
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers
            disable_nagle_algorithm = True  # else headers and body in two writes wait 40 ms for an ACK

            def do_POST(self):
                items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
                with server.lock:
                    n = len(server.seen)
                    server.seen.append(items)
                    server.times.append(time.monotonic())
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                try:
                    answer = server.script(n, items)
                finally:
                    with server.lock:
                        server.active -= 1
                if answer is DROP:
                    self.close_connection = True
                    return
                status, body = answer
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (time-out)
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"


@pytest.fixture
def server():
    srv = Server()
    thread = threading.Thread(target=srv.httpd.serve_forever, kwargs=dict(poll_interval=0.02), daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.httpd.shutdown()
    srv.httpd.server_close()
    thread.join()


def make_items(n):
    return [RewardItem(f"q{i}", "x" * i, {"i": i, "path": Path(f"/d/{i}")}) for i in range(n)]


def counters(requests, retries=0, timeouts=0, failed_batches=0):
    return dict(requests=requests, retries=retries, timeouts=timeouts, failed_batches=failed_batches)


def test_plain_batches_order_and_concurrency_bound(server):
    def script(n, items):
        time.sleep(0.1 if items[0]["row"]["i"] == 0 else 0.05)  # the first batch answers last
        return ok(items)

    server.script = script
    out = HttpReward(server.url, batch_size=32, max_concurrency=2, **FAST).score(make_items(70))
    assert out.scores == [float(i) for i in range(70)]
    assert out.errors == 0
    assert out.counters == counters(3)
    assert sorted(len(b) for b in server.seen) == [6, 32, 32]
    assert server.max_active <= 2
    first = min(server.seen, key=lambda b: b[0]["row"]["i"])[0]
    assert first == {"prompt": "q0", "response": "", "row": {"i": 0, "path": "/d/0"}}  # Path via str()


def test_empty_items_make_no_request(server):
    out = HttpReward(server.url, **FAST).score([])
    assert (out.scores, out.errors, out.counters) == ([], 0, {})
    assert server.seen == []


def test_timeout_then_ok(server):
    def script(n, items):
        if n == 0:
            server.release.wait(5)  # answers after the client gave up
        return ok(items)

    server.script = script
    out = HttpReward(server.url, **{**FAST, "timeout_s": 0.5}).score(make_items(5))
    assert out.scores == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out.errors == 0
    assert out.counters == counters(2, retries=1, timeouts=1)


@pytest.mark.parametrize("status", [500, 503, 429])
def test_retryable_status_twice_then_ok_with_backoff(server, status):
    server.script = lambda n, items: (status, {"error": "busy"}) if n < 2 else ok(items)
    out = HttpReward(server.url, retries=3, **{**FAST, "backoff_s": 0.05}).score(make_items(4))
    assert out.scores == [0.0, 1.0, 2.0, 3.0]
    assert out.errors == 0
    assert out.counters == counters(3, retries=2)
    gaps = [b - a for a, b in zip(server.times, server.times[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # exponential backoff


@pytest.mark.parametrize("body", [b'{"scores": [1, 2', b"not json", b"[1, 2, 3]", {"score": [1.0, 2.0, 3.0]},
                                  {"scores": "1, 2, 3"}, {"scores": [1.0, 2.0]}],
                         ids=["truncated", "not_json", "not_object", "no_scores", "scores_not_list", "too_few"])
def test_malformed_answer_every_time(server, body):
    server.script = lambda n, items: (200, body)
    out = HttpReward(server.url, retries=2, **FAST).score(make_items(3))
    assert out.scores == [-1.0] * 3
    assert out.errors == 3
    assert out.counters == counters(3, retries=2, failed_batches=1)


def test_dropped_connection_then_ok(server):
    server.script = lambda n, items: DROP if n == 0 else ok(items)
    out = HttpReward(server.url, **FAST).score(make_items(3))
    assert out.scores == [0.0, 1.0, 2.0]
    assert out.errors == 0
    assert out.counters == counters(2, retries=1)


def test_unreachable_server():
    with socket.socket() as s:  # a port with no listener: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = HttpReward(f"http://127.0.0.1:{port}/", retries=1, **FAST).score(make_items(2))
    assert out.scores == [-1.0, -1.0]
    assert out.errors == 2
    assert out.counters == counters(2, retries=1, failed_batches=1)


def test_client_error_is_not_retried_and_fails_only_its_batch(server):
    server.script = lambda n, items: (400, {"error": "bad"}) if items[0]["row"]["i"] == 0 else ok(items)
    out = HttpReward(server.url, batch_size=2, **FAST).score(make_items(4))
    assert out.scores == [-1.0, -1.0, 2.0, 3.0]
    assert out.errors == 2
    assert out.counters == counters(2, failed_batches=1)
    assert len(server.seen) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "2.0", True, None, [1.0], 10**400],
                         ids=["nan", "inf", "string", "bool", "null", "list", "huge_int"])
def test_one_bad_score_fails_only_its_item(server, bad):
    server.script = lambda n, items: (200, {"scores": [5.0, bad, 7]})
    out = HttpReward(server.url, **FAST).score(make_items(3))
    assert out.scores == [5.0, -1.0, 7.0]
    assert out.errors == 1
    assert out.counters == counters(1)


@pytest.mark.parametrize("kwargs, name", [
    (dict(url="ftp://host/x"), "url"), (dict(url="localhost:8000"), "url"), (dict(url="http://"), "url"),
    (dict(batch_size=0), "batch_size"), (dict(batch_size=2.0), "batch_size"),
    (dict(max_concurrency=0), "max_concurrency"), (dict(retries=-1), "retries"),
    (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=float("inf")), "timeout_s"),
    (dict(backoff_s=-0.1), "backoff_s"), (dict(error_score=float("nan")), "error_score"),
])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        HttpReward(**{"url": "http://127.0.0.1:1/", **kwargs})
