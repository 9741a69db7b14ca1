"""py-spy profiles of both `make run` services under a chat load (the hot path's overhead).

    .venv/bin/python scripts/profile_services.py [--mode asymspec] [--concurrency 16]
        [--seconds 20] [--out loadtest/results/profiles/NAME]

Starts ``scripts/run_local.sh`` (as ``bench_make_run.py`` does), drives streaming chats at
the given concurrency, and records ``py-spy`` (from PyPI) on the cloud verifier and the edge
gateway for ``--seconds`` while the load runs: ``cloud.txt`` / ``edge.txt`` hold the top
functions by own time and by total time (from the raw samples), and ``*.raw`` the collapsed
stacks (flamegraph.pl / speedscope.app read them). ``rounds.json`` holds what both services'
``/metrics`` counted while py-spy recorded: the cloud's verify rounds (blocks per round,
forward and queue times, its fitted forward cost) and the edge's blocks (γ, accepted per
block, draft steps, round trips), which say whether the cloud or the edge binds.
``--repo`` profiles another checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_make_run import CLOUD_PORT, EDGE_PORT, Stack, drive, workload  # noqa: E402

from loadtest.bench.prometheus import Snapshot  # noqa: E402


def service_pid(port: int) -> int:
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True)
    return int(out.stdout.split("pid=")[1].split(",")[0])


def record(pid: int, seconds: int, raw: Path) -> None:
    spy = str(REPO / ".venv/bin/py-spy")
    common = ["--pid", str(pid), "--duration", str(seconds), "--rate", "200", "--nonblocking"]
    subprocess.run([spy, "record", *common, "--format", "raw", "-o", str(raw)], check=True)


def summarize(raw: Path, top: int = 25) -> str:
    """Top functions by own (leaf) samples and by inclusive samples, from py-spy's raw format."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    lines = [f"{samples} samples", "", "own time (leaf frame):"]
    lines += [f"{100 * n / samples:6.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "total time (frame anywhere on the stack):"]
    lines += [f"{100 * n / samples:6.1f}%  {f}" for f, n in total.most_common(top)]
    return "\n".join(lines) + "\n"


def scrape(port: int) -> Snapshot:
    return Snapshot.parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)


def rounds(cloud: Snapshot, edge: Snapshot, cloud_now: Snapshot) -> dict[str, float | None]:
    """What the services counted between two scrapes (``cloud``, ``edge``: the deltas),
    with the cloud's fitted forward cost as it stands at the end (``cloud_now``)."""

    def mean(delta: Snapshot, histogram: str, scale: float = 1.0) -> float | None:
        count = delta.total(f"asymspec_{histogram}_count")
        return round(scale * delta.total(f"asymspec_{histogram}_sum") / count, 3) if count else None

    blocks = edge.total("asymspec_spec_decode_num_drafts_total")

    def per_block(name: str) -> float | None:
        return round(edge.total(f"asymspec_{name}") / blocks, 3) if blocks else None

    base_s = cloud_now.total("asymspec_target_forward_base_seconds")
    row_s = cloud_now.total("asymspec_target_forward_row_seconds")
    return {
        "cloud_verify_rounds": cloud.total("asymspec_verify_batch_size_count"),
        "cloud_blocks_per_round": mean(cloud, "verify_batch_size"),
        "cloud_forward_ms": mean(cloud, "target_forward_seconds", 1e3),
        "cloud_queue_wait_ms": mean(cloud, "verify_queue_wait_seconds", 1e3),
        "cloud_fitted_base_ms": round(1e3 * base_s, 2),
        "cloud_fitted_row_ms": round(1e3 * row_s, 3),
        "edge_blocks": blocks,
        "edge_gamma": per_block("spec_decode_num_draft_tokens_total"),
        "edge_accepted_per_block": per_block("spec_decode_num_accepted_tokens_total"),
        "edge_propose_ms": mean(edge, "draft_forward_seconds", 1e3),
        "edge_requests_per_propose": mean(edge, "draft_batch_size"),
        "edge_round_trip_ms": mean(edge, "verify_round_trip_seconds", 1e3),
        "edge_busy_s": round(edge.total("asymspec_edge_busy_seconds_total"), 2),
        "tokens": edge.total("asymspec_generation_tokens_total"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="asymspec")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout to profile")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.repo, args.mode, args.out / "services.log")
    try:
        stack.wait_ready()
        asyncio.run(drive(workload(2), 2, 8))
        pids = {"cloud": service_pid(CLOUD_PORT), "edge": service_pid(EDGE_PORT)}
        load: dict = {}
        worker = threading.Thread(
            target=lambda: load.update(
                asyncio.run(drive(workload(args.requests), args.concurrency, 64))
            )
        )
        worker.start()
        time.sleep(2)  # past the first prefills
        before = scrape(CLOUD_PORT), scrape(EDGE_PORT)
        spies = [
            threading.Thread(
                target=record,
                args=(pid, args.seconds, args.out / f"{name}.raw"),
            )
            for name, pid in pids.items()
        ]
        for spy in spies:
            spy.start()
        for spy in spies:
            spy.join()
        after = scrape(CLOUD_PORT), scrape(EDGE_PORT)
        counted = rounds(after[0].minus(before[0]), after[1].minus(before[1]), after[0])
        (args.out / "rounds.json").write_text(json.dumps(counted, indent=1) + "\n")
        print(json.dumps(counted))
        worker.join()
        for name in pids:
            (args.out / f"{name}.txt").write_text(summarize(args.out / f"{name}.raw"))
        (args.out / "load.json").write_text(json.dumps({**load, **vars(args)}, default=str))
        print(json.dumps(load))
    finally:
        stack.stop()
        httpx.Client().close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
