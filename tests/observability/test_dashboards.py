"""The committed Grafana dashboards: their structure (fast), and every panel query evaluated
by a real Prometheus after real traffic (slow).

The slow test starts the cloud verifier and the edge gateway with the tiny model pair, two
dry-run netem sidecars and Prometheus (the committed prometheus.yml, targets moved to
loopback, 1 s scrapes), drives the edge with a headless Locust run of
loadtest/locustfile.py, then evaluates every query of every panel, variables set to "All",
and requires a series for each. It writes panels.json, panels.md, dashboard.png and the
Locust stats to $ASYMSPEC_DASHBOARD_OUT when set (the committed
loadtest/results/dashboard/ was made so), else to a temporary folder.

Prometheus: `scripts/ensure_prometheus.sh` installs Debian's package (as root). Without a
binary the slow tests skip and say why, unless ASYMSPEC_REQUIRE_PROMETHEUS=1 (CI) makes them
fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest import render_dashboard as rd
from loadtest.processes import cloud_env, edge_env, free_port, running
from loadtest.tiny_models import save_tiny_pair
from tests.observability import stack

DATASOURCES_YAML = (
    stack.REPO_ROOT / "observability/grafana/provisioning/datasources/prometheus.yaml"
)
JOBS = {"edge-gateway", "cloud-verifier", "netem-uplink", "netem-downlink"}
LOAD_ENV = {
    "ASYMSPEC_LOAD_MAX_TOKENS": "32",  # prompt (<= ~850 tiny tokens) + 32 < max_model_len
    # A budget, so that top-K certificates are accepted and the K and ε panels have data.
    "ASYMSPEC_LOAD_FIDELITY_BUDGET": "0.05",
    "ASYMSPEC_SLO_TTFT_P90_S": "30",  # generous: exercises the SLO path, never flaky
}


def dashboards() -> list[dict[str, Any]]:
    paths = rd.dashboard_paths()
    assert paths, f"no dashboards in {rd.DASHBOARDS_DIR}"
    return [json.loads(path.read_text()) for path in paths]


def provisioned_uid() -> str:
    (datasource,) = yaml.safe_load(DATASOURCES_YAML.read_text())["datasources"]
    return str(datasource["uid"])


def datasource_uids(node: Any) -> Iterator[str]:
    """Every datasource uid referenced anywhere in a dashboard."""
    if isinstance(node, dict):
        if isinstance(node.get("datasource"), dict):
            yield node["datasource"].get("uid", "")
        for value in node.values():
            yield from datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasource_uids(value)


# ---------------------------------------------------------------------------------------
# Fast: structure


def test_dashboards_use_the_provisioned_datasource() -> None:
    uid = provisioned_uid()
    for dashboard in dashboards():
        assert set(datasource_uids(dashboard)) == {uid}, dashboard["title"]


def test_dashboard_ids_and_titles_are_unique() -> None:
    uids = [d["uid"] for d in dashboards()]
    assert len(uids) == len(set(uids))
    for dashboard in dashboards():
        panels = list(rd.flat_panels(dashboard["panels"]))
        assert len({p["id"] for p in panels}) == len(panels)
        assert len({p["title"] for p in panels}) == len(panels)
        for panel in panels:
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_all_values_exclude_unlabelled_series() -> None:
    # "All" must be `.+`, not `.*`: the cloud exports asymspec_link_bytes_total too, without
    # a mode label, and `mode=~".*"` would add its bytes to the edge's.
    for dashboard in dashboards():
        for variable in dashboard["templating"]["list"]:
            assert variable["includeAll"] and variable["allValue"] == ".+", variable["name"]


def test_every_query_substitutes() -> None:
    panels = rd.load_panels(rd.dashboard_paths())
    assert len(panels) >= 15
    for panel in panels:
        assert panel.queries, panel.title
        for query in panel.queries:
            expr = rd.substitute(query.expr, {**rd.builtin_variables("1m"), **panel.variables})
            assert "$" not in expr, (panel.title, expr)


def test_substitute_forms() -> None:
    variables = {"mode": ".+", "__rate_interval": "1m"}
    expr = 'rate(x{mode=~"$mode"}[$__rate_interval]) + y{m=~"${mode}"} + z{m=~"[[mode]]"}'
    assert rd.substitute(expr, variables) == ('rate(x{mode=~".+"}[1m]) + y{m=~".+"} + z{m=~".+"}')
    with pytest.raises(KeyError, match="unknown dashboard variable"):
        rd.substitute("x{a=~'$nope'}", variables)


# ---------------------------------------------------------------------------------------
# Slow: every panel from a real Prometheus after real traffic


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    try:
        return stack.prometheus_binary()
    except FileNotFoundError as error:
        if os.environ.get("ASYMSPEC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(str(error))
        pytest.skip(str(error))


@pytest.mark.slow
def test_prometheus_config_is_valid(prometheus_bin: str) -> None:
    promtool = Path(prometheus_bin).with_name("promtool")
    if not promtool.is_file():
        pytest.skip("promtool is not beside prometheus")
    done = subprocess.run(
        [str(promtool), "check", "config", str(stack.PROMETHEUS_YML)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_every_panel_has_data(prometheus_bin: str, tmp_path: Path) -> None:
    out_dir = Path(os.environ.get("ASYMSPEC_DASHBOARD_OUT") or tmp_path / "dashboard")
    target, draft = save_tiny_pair(tmp_path / "pair")
    logs = tmp_path / "logs"
    logs.mkdir()
    with ExitStack() as services:
        cloud_port, edge_port = free_port(), free_port()
        secret = {"shared_secret": "test-secret"}  # as compose sets it on both sides
        services.enter_context(
            running("cloud_verifier", cloud_port, cloud_env(target, cloud_port, **secret), logs)
        )
        edge_settings = edge_env(
            draft, edge_port, cloud_port, "asymspec", max_model_len="1024", **secret
        )
        edge = services.enter_context(running("edge_gateway", edge_port, edge_settings, logs))
        up_port, down_port = free_port(), free_port()
        services.enter_context(stack.dry_run_sidecar("uplink", up_port, logs))
        services.enter_context(stack.dry_run_sidecar("downlink", down_port, logs))
        targets = {
            "edge-gateway": f"127.0.0.1:{edge_port}",
            "cloud-verifier": f"127.0.0.1:{cloud_port}",
            "netem-uplink": f"127.0.0.1:{up_port}",
            "netem-downlink": f"127.0.0.1:{down_port}",
        }
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        prom_url = services.enter_context(
            stack.prometheus(stack.loopback_config(targets), free_port(), prom_dir)
        )
        stack.wait_targets_up(prom_url, JOBS)  # counters are scraped at 0 before traffic

        started_s = time.time()
        load = stack.run_locust(edge.url, tmp_path / "locust" / "run", "30s", 8, LOAD_ENV)
        assert_clean_run(load)
        time.sleep(3)  # three more scrapes, so the last requests are in Prometheus
        options = rd.RenderOptions(
            prometheus=prom_url, out=out_dir, start_s=started_s - 5, end_s=time.time()
        )
        results = rd.render(options, rd.load_panels(rd.dashboard_paths()))
        shutil.copy(tmp_path / "locust" / "run_stats.csv", out_dir / "locust_stats.csv")
        assert rd.empty_queries(results) == []
        assert_nan_free(results)
        assert (out_dir / "dashboard.png").stat().st_size > 50_000

        # The same locustfile must fail a run whose SLO it cannot meet.
        strict = {**LOAD_ENV, "ASYMSPEC_SLO_TTFT_P90_S": "0.000001"}
        breached = stack.run_locust(edge.url, tmp_path / "strict" / "run", "5s", 2, strict)
        assert breached.returncode == 1, breached.output[-2000:]
        assert "SLO breached: TTFT p90" in breached.output


def assert_clean_run(load: stack.LocustRun) -> None:
    assert load.returncode == 0, load.output[-3000:]
    by_type: dict[str, int] = {}
    for row in load.stats:
        if row["Name"] != "Aggregated":
            assert row["Failure Count"] == "0", row
            by_type[row["Type"]] = by_type.get(row["Type"], 0) + int(row["Request Count"])
    assert by_type.get("POST", 0) > 0, load.output[-3000:]
    assert {"TTFT", "TPOT", "OUTPUT_TOKENS"} <= set(by_type), by_type


def assert_nan_free(results: list[rd.PanelResult]) -> None:
    """With traffic in the window, no quantile or ratio should come back NaN: a NaN would be
    a division by zero or a histogram with no observations that the dashboard does not guard."""
    nan = [
        f"{r.title} [{q.legend}] {s.legend}"
        for r in results
        for q in r.queries
        for s in q.series
        if s.value == "NaN"
    ]
    assert nan == []
