#!/usr/bin/env python3
"""Soak test of `kvrun serve` (standard library only; not a cargo test).

Starts `kvrun serve --parallel 2` on a free port and sends it N requests
(default 2,000) from C client threads (default 16): chat and completions,
streaming or not, under mixed KV policies; about 10% of the clients hang up
in the middle of a stream, about 10% of the requests are malformed, and a
few clients open a connection and stall inside their headers. Meanwhile it
samples the server's resident set size (VmRSS in /proc/PID/status) every
second and asks /health twice a second.

Pass criteria (exit status 0 when all hold):
  - RSS after warm-up is flat: its level (the median of each 30-second
    block of samples, so that the second-long peak of one request's
    buffers is not taken for growth) stays within 10% of the first block's
    level; the lowest sample per block and the raw peak are reported beside
    it;
  - no 5xx answer;
  - /health answered every time;
  - stalled-header connections were closed by the server (--timeout);
  - SIGTERM at the end stops the server with exit status 0.

    python3 tests/soak_server.py [--kvrun target/release/kvrun] [--model M]
                                 [--requests 2000] [--clients 16]
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

POLICIES = [
    {},
    {"policy": "window", "kv_budget": 48, "kv_recent": 8},
    {"policy": "h2o", "kv_budget": 48, "kv_recent": 8},
    {"policy": "snapkv", "kv_budget": 48},
    {"policy": "tova", "kv_budget": 64},
]

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
    "Give me a word that rhymes with cat.",
    "Why is the sky blue? Answer briefly.",
]

# bodies a client library would not send, or values the server rejects
MALFORMED = [
    ("/v1/chat/completions", b'{"messages": ['),
    ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 5}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -7}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "policy": "lru", "kv_budget": 8}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "policy": "h2o", "kv_budget": 0}'),
    ("/v1/completions", b'{"prompt": 3}'),
    ("/v1/completions", b'{"prompt": [1, 2, 99999999]}'),
    ("/v1/nothing", b"{}"),
]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = {}
        self.kinds = {}
        self.transport_errors = []
        self.slow_not_closed = 0

    def add(self, kind, code):
        with self.lock:
            self.status[code] = self.status.get(code, 0) + 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def error(self, kind, e):
        with self.lock:
            self.transport_errors.append(f"{kind}: {e!r}")


def normal(host, port, rng, stats):
    stream = rng.random() < 0.4
    chat = rng.random() < 0.75
    body = dict(rng.choice(POLICIES))
    body.update({"max_tokens": rng.randint(2, 12), "temperature": 0, "stream": stream})
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    else:
        path = "/v1/completions"
        body["prompt"] = rng.choice(QUESTIONS)
    c = http.client.HTTPConnection(host, port, timeout=120)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status == 200 and stream and b"data: [DONE]" not in data:
            stats.error("stream", "no [DONE]")
        stats.add("stream" if stream else "plain", r.status)
    finally:
        c.close()


def malformed(host, port, rng, stats):
    path, body = rng.choice(MALFORMED)
    c = http.client.HTTPConnection(host, port, timeout=60)
    try:
        c.request("POST", path, body, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        stats.add("malformed", r.status)
    finally:
        c.close()


def disconnect(host, port, rng, stats):
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    body.update(rng.choice(POLICIES))
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, port), timeout=120)
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        got = b""
        while b'"content":"' not in got or len(got) < 400:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        code = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0
        stats.add("disconnect", code)
    finally:
        s.close()  # hang up mid-stream


def slow_header(host, port, timeout_s, delay, stats):
    time.sleep(delay)
    s = socket.create_connection((host, port), timeout=timeout_s + 10)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
        t0 = time.time()
        try:
            while s.recv(4096):
                pass
            closed = True
        except socket.timeout:
            closed = False
        if not closed or time.time() - t0 > timeout_s + 5:
            with stats.lock:
                stats.slow_not_closed += 1
        stats.add("slow_header", "closed" if closed else "open")
    finally:
        s.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--kvrun", default=os.path.join(root, "target/release/kvrun"))
    ap.add_argument("--model", default=os.path.join(root, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=2, help="the server's --timeout")
    ap.add_argument("--slow", type=int, default=8, help="slow-header clients")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of requests before RSS is judged")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rss-log", help="write the RSS samples (s, requests done, KiB) here")
    a = ap.parse_args()

    srv = subprocess.Popen(
        [a.kvrun, "serve", "-m", a.model, "--port", "0", "--parallel", "2", "-t", str(a.threads),
         "-c", "1024", "--queue", str(a.clients * 2), "--timeout", str(a.timeout)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    first = srv.stderr.readline()
    if "http://" not in first:
        print(f"server did not start: {first!r}", file=sys.stderr)
        return 1
    host, port = first.split("http://")[1].split()[0].rsplit(":", 1)
    port = int(port)
    log = []
    threading.Thread(target=lambda: log.extend(srv.stderr), daemon=True).start()

    stats = Stats()
    done = threading.Event()
    rss = []  # (seconds since start, requests finished, KiB)
    health = {"ok": 0, "fail": 0}
    finished = [0]
    t_start = time.time()

    def sample_rss():
        while not done.is_set():
            rss.append((time.time() - t_start, finished[0], rss_kib(srv.pid)))
            done.wait(1.0)

    def poll_health():
        while not done.is_set():
            try:
                c = http.client.HTTPConnection(host, port, timeout=5)
                c.request("GET", "/health")
                r = c.getresponse()
                r.read()
                c.close()
                health["ok" if r.status == 200 else "fail"] += 1
            except Exception:
                health["fail"] += 1
            done.wait(0.5)

    next_req = [0]
    lock = threading.Lock()

    def client(ci):
        rng = random.Random(a.seed * 1000 + ci)
        while True:
            with lock:
                i = next_req[0]
                if i >= a.requests:
                    return
                next_req[0] += 1
            r = rng.random()
            kind = "malformed" if r < 0.10 else "disconnect" if r < 0.20 else "normal"
            try:
                {"malformed": malformed, "disconnect": disconnect, "normal": normal}[kind](
                    host, port, rng, stats
                )
            except Exception as e:
                stats.error(kind, e)
            with lock:
                finished[0] += 1

    bg = [threading.Thread(target=sample_rss, daemon=True), threading.Thread(target=poll_health, daemon=True)]
    for t in bg:
        t.start()
    # spread over the run: one every 10 s
    slow = [threading.Thread(target=slow_header, args=(host, port, a.timeout, 10.0 * i, stats))
            for i in range(a.slow)]
    workers = [threading.Thread(target=client, args=(ci,)) for ci in range(a.clients)]
    for t in workers + slow:
        t.start()
    for t in workers + slow:
        t.join()
    wall = time.time() - t_start
    done.set()
    for t in bg:
        t.join()

    srv.send_signal(signal.SIGTERM)
    try:
        exit_code = srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
        exit_code = None

    if a.rss_log:
        with open(a.rss_log, "w") as f:
            for t, n, k in rss:
                f.write(f"{t:.1f} {n} {k}\n")
    warm = int(a.requests * a.warmup)
    after = [k for (_, n, k) in rss if n >= warm]

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0

    win = 30
    blocks = [after[i:i + win] for i in range(0, len(after), win)]
    if len(blocks) > 1 and len(blocks[-1]) < win // 2:
        blocks.pop()  # a short tail block is mostly the drain
    levels = [median(b) for b in blocks] or [0]
    floors = [min(b) for b in blocks] or [0]
    base = levels[0]
    level_max = max(levels)
    growth = (level_max - base) / base if base else float("inf")
    peak = max(after) if after else 0
    n5xx = sum(v for k, v in stats.status.items() if isinstance(k, int) and k >= 500)
    print(f"requests: {a.requests} from {a.clients} clients in {wall:.1f} s "
          f"({a.requests / wall:.1f} req/s), kinds {stats.kinds}")
    print(f"status codes: {dict(sorted(stats.status.items(), key=str))}")
    print(f"transport errors: {len(stats.transport_errors)}"
          + (f" (first: {stats.transport_errors[0]})" if stats.transport_errors else ""))
    print(f"RSS: start {rss[0][2] / 1024:.1f} MiB; after warm-up ({warm} requests) level "
          f"{base / 1024:.1f} MiB, highest level {level_max / 1024:.1f} MiB (+{100 * growth:.1f}%), "
          f"last level {levels[-1] / 1024:.1f} MiB ({win}-s block medians); lowest sample per block "
          f"{min(floors) / 1024:.1f}..{max(floors) / 1024:.1f} MiB; raw peak {peak / 1024:.1f} MiB "
          f"(+{100 * (peak - base) / max(base, 1):.1f}%); {len(rss)} samples")
    print(f"/health: {health['ok']} answered, {health['fail']} failed")
    print(f"slow-header clients not closed by the server: {stats.slow_not_closed} of {a.slow}")
    print(f"SIGTERM: exit status {exit_code}")
    ok = (growth <= 0.10 and n5xx == 0 and health["fail"] == 0 and stats.slow_not_closed == 0
          and exit_code == 0 and not stats.transport_errors)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
