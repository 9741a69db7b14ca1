"""Uplink bytes per generated token on the channel, plaintext vs TLS, through the namespace
testbed (root): what TLS costs on the slow uplink, and what coalescing recovers.

    python -m loadtest.channel_bytes --profile weak --requests 24 --concurrency 8

Each variant starts a fresh cloud (cloud netns, core 1) and edge (edge netns, core 0), runs
the same completions through the edge, and reads the channel's TCP connection from the
kernel (`ss -ti` in the edge's namespace): payload bytes the edge sent (WebSocket frames,
plus TLS records under TLS) and segments (each adds 66 bytes of Ethernet, IP and TCP
headers on the link; pure ACKs of the downlink included). The edge's own counter of
channel frame bytes, read at the same moments, is what the wire protocol carries before
WebSocket and TLS framing.

Variants: plaintext (ws://, ASYMSPEC_EDGE_ALLOW_PLAINTEXT) or tls (wss:// with mutual
TLS), each with frames coalesced (the default) and -uncoalesced
(ASYMSPEC_EDGE_COALESCE_FRAMES and ASYMSPEC_CLOUD_COALESCE_FRAMES false: one write per
frame, as before coalescing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from asymspec.certificates import ensure
from loadtest.processes import cloud_env, edge_env
from loadtest.testbed import Side, Testbed, open_testbed

CLOUD_PORT, EDGE_PORT = 8001, 8000
VARIANTS = ("plaintext-uncoalesced", "tls-uncoalesced", "plaintext", "tls")
PROMPTS = (
    "def fibonacci(n):",
    "The history of the printing press",
    "for i in range(10):",
    "Once upon a time in a quiet village",
)
_SS_FIELDS = ("bytes_sent", "bytes_received", "segs_out", "data_segs_out", "data_segs_in")
# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): what each segment adds on the link
SEGMENT_HEADER_BYTES = 66


def variant_envs(
    bed: Testbed, variant: str, target: str, draft: str, certs: Path, secret: str
) -> tuple[dict[str, str], dict[str, str]]:
    cloud_ip = bed.layout.address("cloud")
    cloud = cloud_env(Path(target), CLOUD_PORT, host="0.0.0.0", shared_secret=secret)
    edge = edge_env(
        Path(draft), EDGE_PORT, CLOUD_PORT, "asymspec", shared_secret=secret, max_model_len="512"
    )
    coalesce = "false" if variant.endswith("-uncoalesced") else "true"
    edge["ASYMSPEC_EDGE_COALESCE_FRAMES"] = cloud["ASYMSPEC_CLOUD_COALESCE_FRAMES"] = coalesce
    if variant.startswith("plaintext"):
        edge["ASYMSPEC_EDGE_CLOUD_URL"] = f"ws://{cloud_ip}:{CLOUD_PORT}/v1/channel"
        edge["ASYMSPEC_EDGE_ALLOW_PLAINTEXT"] = "1"
        return cloud, edge
    cloud |= {
        "ASYMSPEC_CLOUD_SSL_CERTFILE": str(certs / "cloud.pem"),
        "ASYMSPEC_CLOUD_SSL_KEYFILE": str(certs / "cloud.key"),
        "ASYMSPEC_CLOUD_SSL_CA_CERTS": str(certs / "ca.pem"),
    }
    edge |= {
        "ASYMSPEC_EDGE_CLOUD_URL": f"wss://{cloud_ip}:{CLOUD_PORT}/v1/channel",
        "ASYMSPEC_EDGE_CLOUD_CA_CERTS": str(certs / "ca.pem"),
        "ASYMSPEC_EDGE_CLOUD_CERTFILE": str(certs / "edge.pem"),
        "ASYMSPEC_EDGE_CLOUD_KEYFILE": str(certs / "edge.key"),
    }
    return cloud, edge


CLOUD: Side = "cloud"
EDGE: Side = "edge"


def run_variant(bed: Testbed, variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cloud_env_, edge_env_ = variant_envs(
        bed, variant, args.target, args.draft, work / "certs", "channel-bytes-secret"
    )
    logs = {side: (work / f"{variant}-{side}.log").open("wb") for side in ("cloud", "edge")}
    procs = [
        bed.spawn(side, [sys.executable, "-m", module], cpu=cpu, env=env, stdout=logs[side],
                  stderr=subprocess.STDOUT)
        for side, module, cpu, env in (
            (CLOUD, "cloud_verifier", 1, cloud_env_), (EDGE, "edge_gateway", 0, edge_env_),
        )
    ]  # fmt: skip
    try:
        spec = {
            "cloud": f"{bed.layout.address('cloud')}:{CLOUD_PORT}",
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
        }
        argv = [sys.executable, "-m", "loadtest.channel_bytes", "drive", json.dumps(spec)]
        driver = subprocess.Popen(
            bed.command("edge", argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        while driver.poll() is None:
            dead = [p for p in procs if p.poll() is not None]
            if dead:  # a service died: the driver would wait for it in vain
                driver.kill()
                tails = [(work / f"{variant}-{side}.log").read_text()[-1500:] for side in logs]
                raise RuntimeError(f"{variant}: a service exited ({dead[0].returncode}): {tails}")
            time.sleep(1)
        out, err = driver.communicate()
        if driver.returncode != 0:
            tail = (work / f"{variant}-edge.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{variant}: driver failed:\n{err[-2000:]}\n{tail}")
        result: dict[str, Any] = json.loads(out)
        return {"variant": variant, **result}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs.values():
            log.close()


# ------------------------------------------------------------------ the driver (edge netns)


def channel_counters(cloud: str) -> dict[str, int]:
    """The kernel's counters of the edge's TCP connection(s) to the cloud, summed."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", "dst", cloud], capture_output=True, text=True
    ).stdout
    totals = dict.fromkeys(_SS_FIELDS, 0)
    for name in _SS_FIELDS:
        totals[name] = sum(int(v) for v in re.findall(rf"\b{name}:(\d+)", out))
    return totals


def frame_bytes(edge_url: str) -> dict[str, float]:
    text = httpx.get(f"{edge_url}/metrics").text
    found = {}
    for direction in ("uplink", "downlink"):
        for metric in ("asymspec_link_bytes_total", "asymspec_link_frames_total"):
            pattern = rf'^{metric}{{[^}}]*direction="{direction}"[^}}]*}} (\S+)$'
            match = re.search(pattern, text, re.M)
            key = f"{direction}_{'bytes' if 'bytes' in metric else 'frames'}"
            found[key] = float(match.group(1)) if match else 0.0
    return found


async def load(edge_url: str, spec: dict[str, Any]) -> int:
    """Run the completions; the tokens generated."""
    gate = asyncio.Semaphore(spec["concurrency"])
    async with httpx.AsyncClient(base_url=edge_url, timeout=600) as client:

        async def one(i: int) -> int:
            body = {
                "model": "asymspec", "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": spec["max_tokens"], "temperature": spec["temperature"],
                "ignore_eos": True, "seed": i,
            }  # fmt: skip
            async with gate:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        return sum(await asyncio.gather(*(one(i) for i in range(spec["requests"]))))


def drive(spec: dict[str, Any]) -> dict[str, Any]:
    edge_url = f"http://127.0.0.1:{EDGE_PORT}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{edge_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the edge did not become healthy")
        time.sleep(0.5)
    asyncio.run(load(edge_url, {**spec, "requests": 2}))  # warm-up, not counted
    tcp0, frames0 = channel_counters(spec["cloud"]), frame_bytes(edge_url)
    started = time.monotonic()
    tokens = asyncio.run(load(edge_url, spec))
    elapsed_s = time.monotonic() - started
    tcp1, frames1 = channel_counters(spec["cloud"]), frame_bytes(edge_url)
    tcp = {k: tcp1[k] - tcp0[k] for k in tcp0}
    frames = {k: frames1[k] - frames0[k] for k in frames0}
    return {
        "tokens": tokens,
        "elapsed_s": round(elapsed_s, 2),
        "uplink_tcp_bytes_per_token": round(tcp["bytes_sent"] / tokens, 1),
        "uplink_segments_per_token": round(tcp["data_segs_out"] / tokens, 3),
        "uplink_link_bytes_per_token": round(
            (tcp["bytes_sent"] + SEGMENT_HEADER_BYTES * tcp["segs_out"]) / tokens, 1
        ),
        "uplink_frame_bytes_per_token": round(frames["uplink_bytes"] / tokens, 1),
        "uplink_frames_per_token": round(frames["uplink_frames"] / tokens, 3),
        "downlink_tcp_bytes_per_token": round(tcp["bytes_received"] / tokens, 1),
        "downlink_frame_bytes_per_token": round(frames["downlink_bytes"] / tokens, 1),
        "tcp": tcp,
        "frames": frames,
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "drive":
        print(json.dumps(drive(json.loads(sys.argv[2]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="weak")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--models", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, open_testbed(args.profile) as bed:
        work = Path(tmp)
        if args.models == "tiny":
            from loadtest.tiny_models import save_tiny_pair

            args.target, args.draft = map(str, save_tiny_pair(work / "pair"))
        else:
            from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET

            args.target, args.draft = EMBEDDED_TARGET, EMBEDDED_DRAFT
        ensure(work / "certs", [bed.layout.address("cloud")], ["edge"])
        work.chmod(0o755)
        results = []
        for variant in args.variants.split(","):
            result = run_variant(bed, variant, args, work)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("tcp", "frames")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        run = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"args": run, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
