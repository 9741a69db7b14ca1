"""The load driver: runs inside the edge's network namespace, next to the edge gateway.

    python -m loadtest.bench.driver SPEC.json OUT.json

It waits for the cloud and the edge to be healthy, sends the warm-up requests, then runs
each measured phase between two scrapes of both services' /metrics, and writes the records
and snapshots to OUT.json. The edge is reached on its loopback, so client traffic never
crosses the shaped veth; only the cloud's /health and /metrics do, and only outside the
measured phases (a scrape is ~20 kB, milliseconds even on the weak downlink).

Progress goes to stdout as one JSON object per line (``{"event": "request", ...}``), which
the runner turns into its progress bar.

SPEC fields: ``edge_url``, ``cloud_url`` (null when the mode runs without a cloud),
``health_timeout_s``, ``warmup`` (bodies), ``warmup_concurrency``, ``settle_s`` and
``phases``: ``[{"name", "bodies", "concurrency"}]``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.loadgen import (
    REQUEST_TIMEOUT_S,
    PhaseResult,
    RequestRecord,
    run_conversations,
    run_phase,
)
from loadtest.bench.prometheus import scrape


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def wait_healthy(client: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = await client.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return
            last = response.text[:200]
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s: {last}")


async def drive(spec: dict[str, Any]) -> dict[str, Any]:
    edge_url, cloud_url = spec["edge_url"], spec.get("cloud_url")
    settle_s = float(spec.get("settle_s", 0.5))
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)
    async with (
        httpx.AsyncClient(base_url=edge_url, timeout=timeout, limits=limits) as edge,
        httpx.AsyncClient(timeout=30) as plain,
    ):
        started = time.monotonic()
        if cloud_url is not None:
            await wait_healthy(plain, cloud_url, spec["health_timeout_s"])
        await wait_healthy(plain, edge_url, spec["health_timeout_s"])
        emit("healthy", after_s=round(time.monotonic() - started, 2))

        # the warm-up: "warmup" bodies, or "warmup_conversations" replayed round by round
        warmup = {"bodies": spec.get("warmup", [])}
        if "warmup_conversations" in spec:
            warmup = {"conversations": spec["warmup_conversations"]}
        warm = await _run(edge, warmup, spec.get("warmup_concurrency", 1), "warmup")
        failed = [r.error for r in warm.records if not r.ok]
        if failed:
            raise RuntimeError(f"warm-up failed: {failed[0]}")
        phases = []
        for phase in spec["phases"]:
            # Let the previous phase's trailing frames (session closes) land before the scrape.
            await asyncio.sleep(settle_s)
            edge_before, cloud_before = await asyncio.gather(
                scrape(plain, edge_url), scrape(plain, cloud_url)
            )
            result = await _run(edge, phase, phase["concurrency"], phase["name"])
            await asyncio.sleep(settle_s)
            edge_after, cloud_after = await asyncio.gather(
                scrape(plain, edge_url), scrape(plain, cloud_url)
            )
            phases.append(
                {
                    "name": phase["name"],
                    **result.to_json(),
                    "edge_delta": edge_after.minus(edge_before).to_json(),
                    "cloud_delta": cloud_after.minus(cloud_before).to_json(),
                }
            )
        return {"warmup": warm.to_json(), "phases": phases}


async def _run(
    edge: httpx.AsyncClient, phase: dict[str, Any], concurrency: int, name: str
) -> PhaseResult:
    """A phase's ``bodies`` as independent requests, or its ``conversations`` round by round."""
    if "conversations" in phase:
        return await run_conversations(edge, phase["conversations"], concurrency, _progress(name))
    return await run_phase(edge, phase["bodies"], concurrency, _progress(name))


def _progress(phase: str) -> Any:
    def on_done(record: RequestRecord) -> None:
        emit("request", phase=phase, index=record.index, ok=record.ok, error=record.error)

    return on_done


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    try:
        out = asyncio.run(drive(spec))
    except Exception as exc:  # the runner reads this line and records the cell as failed
        emit("failed", error=f"{type(exc).__name__}: {exc}")
        return 1
    Path(args[1]).write_text(json.dumps(out))
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
