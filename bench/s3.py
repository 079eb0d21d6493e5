"""S3 client latency: lchat's S3Store beside boto3, against the same real server, in one run.

    .venv/bin/python bench/s3.py [--server moto|seaweedfs|both] [--iterations 300]

For each operation (PUT 1 KiB, conditional PUT, HEAD, GET 1 KiB, LIST of 100 keys, DELETE) it
times N sequential calls with each client and prints p50/p99 side by side with the ratio
ours/boto3. Then it prints the S3 requests a lease costs per hour at the default TTL, counted from
our own request metric while a lease with a scaled-down TTL runs. Everything is on loopback; the
servers are started (and killed) by tests/s3servers.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import REGISTRY
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from lchat.objstore.s3 import S3Store
from lchat.threads import thread_runner
from tests.s3servers import S3Server

BODY = b"x" * 1024


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(op: str, ours: list[float], theirs: list[float]) -> str:
    o50, o99 = percentile(ours, 0.5) * 1000, percentile(ours, 0.99) * 1000
    t50, t99 = percentile(theirs, 0.5) * 1000, percentile(theirs, 0.99) * 1000
    return (
        f"| {op} | {o50:.2f} ms | {o99:.2f} ms | {t50:.2f} ms | {t99:.2f} ms "
        f"| {o50 / t50:.2f}x | {o99 / t99:.2f}x |"
    )


async def time_ours(n: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    samples = []
    for i in range(n):
        started = time.perf_counter()
        await call(i)
        samples.append(time.perf_counter() - started)
    return samples


def time_boto(n: int, call: Callable[[int], Any]) -> list[float]:
    samples = []
    for i in range(n):
        started = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - started)
    return samples


def s3_requests() -> float:
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "lchat_s3_requests":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


async def bench_server(reactor: Any, kind: str, n: int) -> list[str]:
    server = S3Server(kind)  # type: ignore[arg-type]
    await server.start()
    try:
        store = S3Store(
            reactor,
            server.bucket,
            run_in_thread=thread_runner(reactor),
            monotonic=time.monotonic,
            region=server.region,
            endpoint=server.endpoint,
            credentials=server.credentials,
        )
        boto = server.client()
        for i in range(100):
            await store.put(f"list/{i:04d}", BODY)
        ops: list[tuple[str, Callable[[int], Awaitable[Any]], Callable[[int], Any]]] = [
            (
                "PUT 1 KiB",
                lambda i: store.put(f"ours/{i}", BODY),
                lambda i: boto.put_object(Bucket=server.bucket, Key=f"boto/{i}", Body=BODY),
            ),
            (
                "PUT If-None-Match",
                lambda i: store.put(f"ours-c/{i}", BODY, if_none_match=True),
                lambda i: boto.put_object(
                    Bucket=server.bucket, Key=f"boto-c/{i}", Body=BODY, IfNoneMatch="*"
                ),
            ),
            (
                "HEAD",
                lambda i: store.head(f"ours/{i}"),
                lambda i: boto.head_object(Bucket=server.bucket, Key=f"boto/{i}"),
            ),
            (
                "GET 1 KiB",
                lambda i: store.get(f"ours/{i}"),
                lambda i: boto.get_object(Bucket=server.bucket, Key=f"boto/{i}")["Body"].read(),
            ),
            (
                "LIST 100 keys",
                lambda i: store.list("list/"),
                lambda i: boto.list_objects_v2(Bucket=server.bucket, Prefix="list/"),
            ),
            (
                "DELETE",
                lambda i: store.delete(f"ours/{i}"),
                lambda i: boto.delete_object(Bucket=server.bucket, Key=f"boto/{i}"),
            ),
        ]
        lines = [
            f"### {kind}: {n} sequential calls per operation",
            "",
            "| operation | lchat p50 | lchat p99 | boto3 p50 | boto3 p99 | p50 ratio | p99 ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, ours, theirs in ops:
            mine = await time_ours(n, ours)
            other = await deferToThread(time_boto, n, theirs)
            lines.append(row(name, mine, other))
            print(lines[-1], file=sys.stderr)
        await store.close()
        return lines
    finally:
        await server.destroy()


async def lease_cost(reactor: Any) -> list[str]:
    """Requests per lease-hour, counted: a lease at a scaled TTL for the same number of periods."""
    from lchat import lease

    server = S3Server("moto")
    await server.start()
    try:
        store = S3Store(
            reactor,
            server.bucket,
            run_in_thread=thread_runner(reactor),
            monotonic=time.monotonic,
            region=server.region,
            endpoint=server.endpoint,
            credentials=server.credentials,
        )
        ttl = 3.0  # stands for 15 m: renewals every ttl/3 as in production
        before = s3_requests()
        held = await lease.acquire(
            store, "bench.example.com/lock.json", "bench-box", ttl, monotonic=time.monotonic
        )
        lost: list[str] = []
        keeper = lease.LeaseKeeper(reactor, store, held, lost.append, monotonic=time.monotonic)
        keeper.start()
        await task.deferLater(reactor, ttl * 4, lambda: None)  # 4 TTLs = one "hour" at 15 m
        await keeper.release(5.0)
        keeper.stop()
        counted = s3_requests() - before
        await store.close()
        return [
            "### S3 requests per lease-hour (15 m TTL, renewed every 5 m)",
            "",
            f"- counted: {counted:.0f} requests for one wake held one lease-hour (acquire, "
            f"renewals every TTL/3, release) at a scaled TTL of {ttl:g} s",
            "- expected: 12 renewals + 1 acquire + 1 release = 14 (a stale lease found at "
            "acquire adds one read)",
            f"- lost callbacks: {len(lost)} (should be 0)",
        ]
    finally:
        await server.destroy()


async def main(reactor: Any, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["moto", "seaweedfs", "both"], default="both")
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args(argv)
    kinds = ["moto", "seaweedfs"] if args.server == "both" else [args.server]
    out = ["## S3 client latency (lchat S3Store vs boto3, same server, same run)", ""]
    for kind in kinds:
        out += await bench_server(reactor, kind, args.iterations) + [""]
    out += await lease_cost(reactor)
    print("\n".join(out))


if __name__ == "__main__":
    task.react(lambda reactor: Deferred.fromCoroutine(main(reactor, sys.argv[1:])))
