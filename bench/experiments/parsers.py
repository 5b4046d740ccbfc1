"""Bare loops on one nginx, no asyncrawl: aiohttp's client against a minimal asyncio protocol
that parses with aiohttp's own parser (``aiohttp.http.HttpResponseParser``, llhttp compiled
in aiohttp's extension: what ``asyncrawl/http1.py`` parses with since stop 43) and, where
httptools is installed, the same protocol on httptools' parser (what it parsed with before).
Each GETs ``--requests`` IDs with ``--concurrency`` in flight (keep-alive, one request at a time
per connection), reads the body and ``orjson.loads`` it; rounds alternate the kinds. Prints
req/s and µs of CPU per request for each run: what the client costs, without the rest of a
crawl.

Usage::

    .venv/bin/python bench/experiments/parsers.py [--requests 20000] [--concurrency 64]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp.http import HttpResponseParser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import throughput

try:
    import httptools
except ImportError:
    httptools = None


class Httptools(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.chunks: list[bytes] = []
        self.raw: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        waiter.set_result((self.parser.get_status_code(), b"".join(self.chunks)))


class Aiohttp(asyncio.Protocol):
    _reading_paused = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.parser = HttpResponseParser(self, loop, 2**30, read_until_eof=True,
                                         auto_decompress=False)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def pause_reading(self, *_: Any, **__: Any) -> None:
        pass

    def resume_reading(self, *_: Any, **__: Any) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        messages, _, _ = self.parser.feed_data(data)
        for message, payload in messages:
            self.message, self.payload = message, payload
        if self.payload.is_eof():
            waiter, self.waiter = self.waiter, None
            waiter.set_result((self.message.code, self.payload.read_nowait()))


async def bare_protocol(base: str, n: int, concurrency: int, cls: type) -> int:
    loop = asyncio.get_running_loop()
    host, port = base.split("//")[1].split(":")
    ids, ok = list(range(n)), 0

    async def worker() -> None:
        nonlocal ok
        transport, proto = await loop.create_connection(lambda: cls(loop), host, int(port))
        while ids:
            proto.waiter = loop.create_future()
            transport.write(f"GET /items/{ids.pop()} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                            "User-Agent: x\r\nAccept: */*\r\n"
                            "Accept-Encoding: gzip, deflate\r\n\r\n".encode())
            status, body = await proto.waiter
            orjson.loads(body)
            ok += status == 200
        transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n, c = args.requests, args.concurrency
    with tempfile.TemporaryDirectory() as d, throughput.nginx_server(Path(d)) as nginx:
        kinds = {"aiohttp client": lambda: throughput.run_baseline(nginx.base, n, c),
                 "protocol + aiohttp's parser": lambda: bare_protocol(nginx.base, n, c, Aiohttp)}
        if httptools is not None:
            kinds["protocol + httptools"] = lambda: bare_protocol(nginx.base, n, c, Httptools)
        runs: dict[str, list[str]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for kind, crawl in kinds.items():
                cpu0, t0 = time.process_time(), time.perf_counter()
                ok = asyncio.run(crawl())
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                if ok != n:
                    raise SystemExit(f"{kind}: {ok} of {n} ok")
                runs[kind].append(f"{n / elapsed:,.0f} req/s {cpu / n * 1e6:.1f} us")
    for kind, figures in runs.items():
        print(f"{kind:<28} " + " | ".join(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
