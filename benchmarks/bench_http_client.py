"""aiohttp vs httpx as the SGLang client's asynchronous HTTP library (the choice issue 31 asked to
make by measurement): one client process keeps C requests in flight against a server that answers
each POST /generate after a fixed delay (an engine's generation time) with an SGLang-shaped JSON
body, until R requests are done. Per library and level: requests/s, the client's CPU seconds per
1000 requests (user + system of its process: what the trainer's process pays), its threads and peak
RSS. Both clients pool keep-alive connections with no connection limit, as the product's does
(rollout/sglang/client.py: aiohttp.TCPConnector(limit=0)). The levels alternate library by library
so that other load on the machine hits both alike.

    python benchmarks/bench_http_client.py --setup     # build/bench-http-venv: httpx beside .venv
    python benchmarks/bench_http_client.py [--levels 256 1024 4096] [--delay-s 0.5] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "build" / "bench-http-venv"
HTTPX = "httpx==0.28.1"

SERVER = r"""
import asyncio, json, sys
from aiohttp import web
delay = float(sys.argv[2])
body = json.dumps({"text": "x" * 64, "output_ids": list(range(64)),
                   "meta_info": {"id": "0", "finish_reason": {"type": "length", "length": 64},
                                 "prompt_tokens": 256, "completion_tokens": 64,
                                 "output_token_logprobs": [[-0.5, i, None] for i in range(64)]}})
async def generate(request):
    await request.read()
    await asyncio.sleep(delay)
    return web.Response(text=body, content_type="application/json")
app = web.Application()
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, backlog=8192)
"""

CLIENT = r"""
import asyncio, json, os, resource, sys, threading, time
library, url, in_flight, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
payload = {"input_ids": list(range(256)), "sampling_params": {"max_new_tokens": 64, "temperature": 1.0},
           "return_logprob": True}

async def run():
    semaphore, threads = asyncio.Semaphore(in_flight), [0]
    if library == "aiohttp":
        import aiohttp
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0),
                                        timeout=aiohttp.ClientTimeout(total=None))
        async def post():
            async with session.post(url, json=payload) as response:
                response.raise_for_status()
                return json.loads(await response.read())
    else:
        import httpx
        session = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                                                        keepalive_expiry=3.0), timeout=None)
        async def post():
            response = await session.post(url, json=payload)
            response.raise_for_status()
            return response.json()
    async def one():
        async with semaphore:
            out = await post()
            threads[0] = max(threads[0], threading.active_count())
            return len(out["output_ids"])
    await one()  # connection warm-up outside the clock
    cpu, start = os.times(), time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(total))))
    wall, end = time.perf_counter() - start, os.times()
    await session.aclose() if library == "httpx" else await session.close()
    assert tokens == 64 * total
    cpu_s = (end.user - cpu.user) + (end.system - cpu.system)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"requests_per_s": total / wall, "cpu_s_per_1k": 1000 * cpu_s / total,
                      "threads": threads[0], "peak_rss_mib": rss_mib}))

asyncio.run(run())
"""


def setup() -> Path:
    """build/bench-http-venv: httpx beside .venv (which has aiohttp)."""
    from bench_e2e import layered_venv

    return layered_venv(VENV, ["-q", HTTPX])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"the test server on port {port} did not listen within {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create build/bench-http-venv and exit")
    parser.add_argument("--levels", type=int, nargs="+", default=[256, 1024, 4096], help="requests in flight")
    parser.add_argument("--requests-per-level", type=int, default=3, help="total requests = this x the level")
    parser.add_argument("--delay-s", type=float, default=0.5, help="the server's answer time per request")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    if args.setup:
        print(f"interpreter with httpx: {setup()}")
        return 0
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"{python} is missing: run `python benchmarks/bench_http_client.py --setup`", file=sys.stderr)
        return 2
    port = free_port()
    server = subprocess.Popen([str(python), "-c", SERVER, str(port), str(args.delay_s)])
    rows = {}
    try:
        wait_listening(port)
        for level in args.levels:
            for library in ("aiohttp", "httpx"):
                out = subprocess.run([str(python), "-c", CLIENT, library, f"http://127.0.0.1:{port}/generate",
                                      str(level), str(args.requests_per_level * level)],
                                     capture_output=True, text=True, timeout=900, env={**os.environ})
                if out.returncode != 0:
                    raise RuntimeError(f"{library} at {level}: {out.stderr[-2000:]}")
                rows[library, level] = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{library} at {level} in flight: {rows[library, level]}", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print("| in flight | requests/s aiohttp / httpx | client CPU s per 1000 requests aiohttp / httpx (ratio) "
          "| threads | peak RSS MiB aiohttp / httpx |\n|---|---|---|---|---|")
    for level in args.levels:
        a, h = rows["aiohttp", level], rows["httpx", level]
        ratio = h["cpu_s_per_1k"] / a["cpu_s_per_1k"]
        print(f"| {level} | {a['requests_per_s']:.0f} / {h['requests_per_s']:.0f} | {a['cpu_s_per_1k']:.2f} / "
              f"{h['cpu_s_per_1k']:.2f} ({ratio:.2f}x) | {a['threads']} / {h['threads']} "
              f"| {a['peak_rss_mib']:.0f} / {h['peak_rss_mib']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{lib} {level}": row for (lib, level), row in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
