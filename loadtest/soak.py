"""Soak test: Locust for N minutes over a shaped testbed, watching memory and sessions.

The cloud verifier runs in the testbed's cloud namespace on core 1, the edge gateway and
Locust in the edge namespace (the edge on core 0), one torch thread each; only edge<->cloud
traffic crosses the shaped veth. Every `sample_s` the script records each service's
resident memory (VmRSS of the python process) and the cloud's open sessions. It passes
when Locust saw 0 failures, each service's memory at the end is within `rss_tolerance`
of its memory at the end of the warm-up, and no sessions are left open afterwards.

    sudo .venv/bin/python -m loadtest.soak --minutes 10 --users 16 --profile weak
    sudo .venv/bin/python -m loadtest.soak --minutes 1 --models tiny      # the CI version
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.testbed import Testbed, open_testbed

REPO = Path(__file__).resolve().parents[1]
EDGE_PORT, CLOUD_PORT = 8000, 8001


@dataclass
class Sample:
    t_s: float
    edge_rss_mb: float
    cloud_rss_mb: float
    cloud_sessions: int


@dataclass
class SoakReport:
    minutes: float
    users: int
    profile: str
    models: str
    locust_exit_code: int
    requests: int = 0
    failures: int = 0
    samples: list[Sample] = field(default_factory=list)
    warmup_s: float = 0.0
    rss_tolerance: float = 0.10
    sessions_after: int = -1

    def rss(self, side: str, at_s: float) -> float:
        """The sample closest to `at_s`."""
        sample = min(self.samples, key=lambda s: abs(s.t_s - at_s))
        return float(getattr(sample, f"{side}_rss_mb"))

    def drift(self, side: str) -> float:
        start, end = self.rss(side, self.warmup_s), self.rss(side, self.samples[-1].t_s)
        return (end - start) / start

    @property
    def passed(self) -> bool:
        flat = all(abs(self.drift(side)) <= self.rss_tolerance for side in ("edge", "cloud"))
        return (
            self.locust_exit_code == 0
            and self.failures == 0
            and flat
            and (self.sessions_after == 0)
        )

    def markdown(self) -> str:
        rows = [
            f"| {side} | {self.rss(side, self.warmup_s):.1f} | "
            f"{self.rss(side, self.samples[-1].t_s):.1f} | {100 * self.drift(side):+.1f} % |"
            for side in ("edge", "cloud")
        ]
        peak = max(s.cloud_sessions for s in self.samples)
        return "\n".join(
            [
                f"# Soak: {self.minutes} min, {self.users} users, {self.profile} link, "
                f"{self.models} models",
                "",
                f"- requests {self.requests}, failures {self.failures}, "
                f"locust exit code {self.locust_exit_code}",
                f"- cloud sessions: peak {peak} (at most one per user), "
                f"after the run {self.sessions_after}",
                f"- verdict: {'PASS' if self.passed else 'FAIL'}",
                "",
                "| service | RSS after warm-up (MB) | RSS at end (MB) | drift |",
                "|---|---|---|---|",
                *rows,
            ]
        )


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _in_edge(bed: Testbed, code: str) -> str:
    """Run a short python snippet in the edge namespace (where the services are reachable)."""
    argv = bed.command("edge", [sys.executable, "-c", code])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def _cloud_sessions(bed: Testbed, secret: str) -> int:
    url = f"http://{bed.layout.address('cloud')}:{CLOUD_PORT}/v1/sessions"
    headers = {"Authorization": f"Bearer {secret}"}
    code = f"import httpx;print(httpx.get({url!r}, headers={headers!r}).json()['sessions'])"
    out = _in_edge(bed, code)
    return int(out) if out.isdigit() else -1


def _wait_healthy(bed: Testbed, url: str, timeout_s: float = 300) -> None:
    code = (
        "import httpx,sys,time\n"
        f"deadline=time.time()+{timeout_s}\n"
        "while time.time()<deadline:\n"
        "  try:\n"
        f"    if httpx.get({url!r}, timeout=2).status_code==200: sys.exit(0)\n"
        "  except Exception: pass\n"
        "  time.sleep(0.5)\n"
        "sys.exit(1)\n"
    )
    argv = bed.command("edge", [sys.executable, "-c", code])
    if subprocess.run(argv, timeout=timeout_s + 30).returncode != 0:
        raise RuntimeError(f"{url} did not become healthy")


def _models(kind: str, workdir: Path) -> tuple[str, str]:
    if kind == "embedded":
        return "embedded:smollm2-135m-instruct", "embedded:smollm2-draft"
    from loadtest.tiny_models import save_tiny_pair  # test helper: the tiny real pair

    target, draft = save_tiny_pair(workdir)
    return str(target), str(draft)


def _start_services(bed: Testbed, models: tuple[str, str], secret: str, logs: Path) -> tuple:
    common = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cloud_env = {
        **common,
        "ASYMSPEC_CLOUD_TARGET_MODEL": models[0],
        "ASYMSPEC_CLOUD_HOST": "0.0.0.0",
        "ASYMSPEC_CLOUD_PORT": str(CLOUD_PORT),
        "ASYMSPEC_CLOUD_THREADS": "1",
        "ASYMSPEC_CLOUD_SHARED_SECRET": secret,
    }
    edge_env = {
        **common,
        "ASYMSPEC_EDGE_DRAFT_MODEL": models[1],
        "ASYMSPEC_EDGE_HOST": "0.0.0.0",
        "ASYMSPEC_EDGE_PORT": str(EDGE_PORT),
        "ASYMSPEC_EDGE_THREADS": "1",
        "ASYMSPEC_EDGE_SHARED_SECRET": secret,
        "ASYMSPEC_EDGE_CLOUD_URL": f"ws://{bed.layout.address('cloud')}:{CLOUD_PORT}/v1/channel",
        "ASYMSPEC_EDGE_ALLOW_PLAINTEXT": "1",  # the testbed's link is namespaces on this host
        # The soak holds the speculative path (blocks, corrections over the link) under
        # load; the goodput pause would hand a crowd to the cloud's own decoding instead.
        "ASYMSPEC_EDGE_GOODPUT_PAUSE": "false",
    }
    cloud_log, edge_log = (logs / "cloud.log").open("wb"), (logs / "edge.log").open("wb")
    cloud = bed.spawn("cloud", [sys.executable, "-m", "cloud_verifier"], cpu=1, env=cloud_env,
                      stdout=cloud_log, stderr=subprocess.STDOUT)  # fmt: skip
    _wait_healthy(bed, f"http://{bed.layout.address('cloud')}:{CLOUD_PORT}/health")
    edge = bed.spawn("edge", [sys.executable, "-m", "edge_gateway"], cpu=0, env=edge_env,
                     stdout=edge_log, stderr=subprocess.STDOUT)  # fmt: skip
    _wait_healthy(bed, f"http://127.0.0.1:{EDGE_PORT}/health")
    return cloud, edge


def run_soak(
    minutes: float, users: int, profile: str, models: str, out: Path, max_tokens: int = 64
) -> SoakReport:
    out.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(16)
    report = SoakReport(minutes, users, profile, models, locust_exit_code=-1)
    report.warmup_s = min(60.0, 0.2 * minutes * 60)
    with tempfile.TemporaryDirectory() as tmp, open_testbed(profile) as bed:
        cloud, edge = _start_services(bed, _models(models, Path(tmp)), secret, out)
        locust = str(Path(sys.executable).with_name("locust"))
        locust_argv = bed.command("edge", [
            locust, "-f", str(REPO / "loadtest/locustfile.py"),
            "--headless", "-u", str(users), "-r", str(max(1, users // 4)),
            "-t", f"{int(minutes * 60)}s", "--csv", str(out / "locust"),
            "--host", f"http://127.0.0.1:{EDGE_PORT}", "--only-summary",
        ])  # fmt: skip
        load = subprocess.Popen(
            locust_argv, env={**os.environ, "ASYMSPEC_LOAD_MAX_TOKENS": str(max_tokens)},
            stdout=(out / "locust.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        started = time.monotonic()
        while load.poll() is None:
            report.samples.append(
                Sample(
                    t_s=round(time.monotonic() - started, 1),
                    edge_rss_mb=round(_rss_mb(edge.pid), 1),
                    cloud_rss_mb=round(_rss_mb(cloud.pid), 1),
                    cloud_sessions=_cloud_sessions(bed, secret),
                )
            )
            time.sleep(5 if minutes <= 2 else 10)
        report.locust_exit_code = load.returncode
        time.sleep(2)  # let closes reach the cloud
        report.sessions_after = _cloud_sessions(bed, secret)
    report.requests, report.failures = _locust_totals(out / "locust_stats.csv")
    (out / "soak.json").write_text(json.dumps(asdict(report) | {"passed": report.passed}, indent=1))
    (out / "soak.md").write_text(report.markdown() + "\n")
    return report


def _locust_totals(stats_csv: Path) -> tuple[int, int]:
    """Requests and failures of the HTTP rows (custom TTFT/TPOT rows are not requests)."""
    requests = failures = 0
    with stats_csv.open() as f:
        for row in csv.DictReader(f):
            if row["Type"] in ("POST", "GET"):
                requests += int(row["Request Count"])
                failures += int(row["Failure Count"])
    return requests, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--profile", default="weak")
    parser.add_argument("--models", choices=("embedded", "tiny"), default="embedded")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/soak")
    args = parser.parse_args()
    report = run_soak(
        args.minutes, args.users, args.profile, args.models, args.out, args.max_tokens
    )
    print(report.markdown())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
