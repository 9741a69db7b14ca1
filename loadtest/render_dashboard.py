"""Evaluate every panel of the committed Grafana dashboards against a Prometheus, and draw them.

    python loadtest/render_dashboard.py --prometheus http://127.0.0.1:9090 --since 10m \
        --out loadtest/results/dashboard

For the window [end - since, end] it writes to --out:

- ``panels.json``: each panel, each query as sent (variables substituted) and the instant
  value of each of its series at the end of the window;
- ``panels.md``: the same as a table;
- ``dashboard.png``: each panel's queries over the window, one subplot per panel.

Variables are substituted as Grafana does with "All" selected (each variable's allValue);
``$__rate_interval`` becomes ``--rate-interval`` for the instant values (1m, as the
metrics modules' PromQL examples) and ``--range-rate-interval`` for the plots. Exits 1 when
a query returns no series or fails: a panel that would stay empty in Grafana.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS_DIR = REPO_ROOT / "observability" / "grafana" / "dashboards"

# How the dashboards' Grafana units read in a table or on an axis.
UNIT_LABELS = {
    "s": "s",
    "percentunit": "fraction",
    "Bps": "B/s",
    "decbytes": "B",
    "reqps": "req/s",
    "ops": "/s",
    "short": "",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# ---------------------------------------------------------------------------------------
# Dashboards: panels, queries and variables


@dataclass(frozen=True)
class Query:
    legend: str  # Grafana's legendFormat, e.g. "p90" or "{{direction}}"
    expr: str  # as written in the dashboard, variables unsubstituted


@dataclass(frozen=True)
class Panel:
    dashboard: str  # file name
    title: str
    unit: str  # Grafana unit id
    queries: tuple[Query, ...]
    variables: dict[str, str] = field(hash=False)  # name -> the value "All" stands for


def dashboard_paths(folder: Path = DASHBOARDS_DIR) -> list[Path]:
    return sorted(folder.glob("*.json"))


def all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """Each templating variable's value with "All" selected: its allValue, else a regex
    that matches any value, which is what Grafana sends when it has none."""
    return {
        variable["name"]: variable.get("allValue") or ".*"
        for variable in dashboard.get("templating", {}).get("list", [])
    }


def flat_panels(panels: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    """Panels in layout order, with those inside collapsed rows."""
    for panel in panels:
        if panel.get("type") == "row":
            yield from flat_panels(panel.get("panels", []))
        else:
            yield panel


def load_panels(paths: Iterable[Path]) -> list[Panel]:
    result = []
    for path in paths:
        dashboard = json.loads(path.read_text())
        variables = all_values(dashboard)
        for panel in flat_panels(dashboard.get("panels", [])):
            queries = tuple(
                Query(target.get("legendFormat", ""), target["expr"])
                for target in panel.get("targets", [])
                if target.get("expr")
            )
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            result.append(Panel(path.name, panel["title"], unit, queries, variables))
    return result


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with $var, ${var} and [[var]] replaced; an unknown variable is an error
    (Grafana would send it verbatim and Prometheus would reject the query)."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name not in variables:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return variables[name]

    return _VARIABLE.sub(value, expr)


def legend_text(legend: str, labels: dict[str, str]) -> str:
    if not legend:  # Grafana's default legend: the series' labels
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), legend)


def unit_label(unit: str) -> str:
    if unit.startswith("suffix:"):
        return unit.removeprefix("suffix:").strip()
    return UNIT_LABELS.get(unit, unit)


# ---------------------------------------------------------------------------------------
# Prometheus HTTP API


class PromQLError(RuntimeError):
    """Prometheus refused a query (a syntax or evaluation error)."""


class Prometheus:
    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)

    def _data(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        response = self.client.get(path, params=params)
        body = response.json()
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":  # e.g. vector(0) folded to a scalar
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def instant(self, expr: str, at_s: float) -> list[dict[str, Any]]:
        return self._data("/api/v1/query", {"query": expr, "time": f"{at_s:.3f}"})

    def range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}"}
        return self._data("/api/v1/query_range", {**params, "step": f"{step_s:g}"})


# ---------------------------------------------------------------------------------------
# Evaluation


@dataclass
class SeriesValue:
    legend: str
    labels: dict[str, str]
    value: float | str  # a float, or Prometheus' text for NaN / +Inf


@dataclass
class QueryResult:
    legend: str
    expr: str  # as sent, variables substituted
    series: list[SeriesValue]
    error: str | None = None

    @property
    def empty(self) -> bool:
        return self.error is not None or not self.series


@dataclass
class PanelResult:
    dashboard: str
    title: str
    unit: str
    queries: list[QueryResult]


def as_number(text: str) -> float | str:
    number = float(text)
    return number if math.isfinite(number) else text


def evaluate_query(
    prometheus: Prometheus, query: Query, variables: dict[str, str], at_s: float
) -> QueryResult:
    expr = substitute(query.expr, variables)
    try:
        result = prometheus.instant(expr, at_s)
    except PromQLError as error:
        return QueryResult(query.legend, expr, [], str(error))
    series = [
        SeriesValue(legend_text(query.legend, s["metric"]), s["metric"], as_number(s["value"][1]))
        for s in result
    ]
    return QueryResult(query.legend, expr, sorted(series, key=lambda s: s.legend))


def evaluate(
    prometheus: Prometheus, panels: list[Panel], at_s: float, rate_interval: str
) -> list[PanelResult]:
    """Every query of every panel, as an instant query at ``at_s``."""
    results = []
    for panel in panels:
        variables = {**builtin_variables(rate_interval), **panel.variables}
        queries = [evaluate_query(prometheus, q, variables, at_s) for q in panel.queries]
        results.append(PanelResult(panel.dashboard, panel.title, panel.unit, queries))
    return results


def builtin_variables(rate_interval: str) -> dict[str, str]:
    """Grafana's own interval variables, all set to one window."""
    return {name: rate_interval for name in ("__rate_interval", "__interval", "__range")}


def empty_queries(results: list[PanelResult]) -> list[str]:
    return [
        f"{r.title} [{q.legend or q.expr}]: {q.error or 'no series'}"
        for r in results
        for q in r.queries
        if q.empty
    ]


# ---------------------------------------------------------------------------------------
# Outputs


def format_value(value: float | str, unit: str) -> str:
    if isinstance(value, str):
        return value
    if unit == "percentunit":
        return f"{100 * value:.3g} %"
    return f"{value:.4g} {unit_label(unit)}".strip()


def series_cell(query: QueryResult, unit: str) -> str:
    """The values of a query's series; named by their legend when there are several."""
    if query.empty:
        return f"**empty** {query.error or ''}".strip()
    if len(query.series) == 1 and query.series[0].legend == query.legend:
        return format_value(query.series[0].value, unit)
    return ", ".join(f"{s.legend}: {format_value(s.value, unit)}" for s in query.series)


def write_json(results: list[PanelResult], path: Path, meta: dict[str, Any]) -> None:
    document = {**meta, "panels": [asdict(r) for r in results]}
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def write_markdown(results: list[PanelResult], path: Path, meta: dict[str, Any]) -> None:
    lines = [
        "# Dashboard panels: instant values",
        "",
        f"Prometheus instant queries at the end of the run ({meta['evaluated_at']}), "
        f"`$__rate_interval` = `{meta['rate_interval']}`, variables = All. "
        "Produced by `loadtest/render_dashboard.py`.",
        "",
        "| panel | query (legend) | value |",
        "|---|---|---|",
    ]
    for result in results:
        for query in result.queries:
            legend = f"`{query.legend}`" if query.legend else "-"
            lines.append(f"| {result.title} | {legend} | {series_cell(query, result.unit)} |")
    path.write_text("\n".join(lines) + "\n")


def fetch_ranges(
    prometheus: Prometheus,
    panels: list[Panel],
    window: tuple[float, float, float],
    rate_interval: str,
) -> list[list[tuple[str, list[float], list[float]]]]:
    """Per panel: (legend, seconds since start, values) for each series of each query."""
    start_s = window[0]
    drawn = []
    for panel in panels:
        variables = {**builtin_variables(rate_interval), **panel.variables}
        lines = []
        for query in panel.queries:
            try:
                series = prometheus.range(substitute(query.expr, variables), *window)
            except PromQLError:
                continue  # already reported by the instant evaluation
            for s in series:
                times = [float(t) - start_s for t, _ in s["values"]]
                values = [float(v) for _, v in s["values"]]
                lines.append((legend_text(query.legend, s["metric"]), times, values))
        drawn.append(lines)
    return drawn


def render_png(
    panels: list[Panel], drawn: list[list[tuple[str, list[float], list[float]]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: tests and CI
    import matplotlib.pyplot as plt

    columns = 4
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, panel, lines in zip(axes.flat, panels, drawn, strict=False):
        ax.set_title("\n".join(textwrap.wrap(panel.title, 38)), fontsize=10)
        ax.set_ylabel(unit_label(panel.unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        for legend, times, values in lines:
            ax.plot(times, values, label=legend, linewidth=1.2)
        if lines:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since start", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


# ---------------------------------------------------------------------------------------
# Command line


@dataclass(frozen=True)
class RenderOptions:
    prometheus: str
    out: Path
    start_s: float
    end_s: float
    step_s: float = 2.0
    rate_interval: str = "1m"
    range_rate_interval: str = "15s"


def render(options: RenderOptions, panels: list[Panel]) -> list[PanelResult]:
    """Write panels.json, panels.md and dashboard.png; return the instant results."""
    prometheus = Prometheus(options.prometheus)
    results = evaluate(prometheus, panels, options.end_s, options.rate_interval)
    window = (options.start_s, options.end_s, options.step_s)
    drawn = fetch_ranges(prometheus, panels, window, options.range_rate_interval)
    meta = {
        "prometheus": options.prometheus,
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(options.end_s)),
        "window_s": round(options.end_s - options.start_s, 1),
        "rate_interval": options.rate_interval,
        "range_rate_interval": options.range_rate_interval,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    write_json(results, options.out / "panels.json", meta)
    write_markdown(results, options.out / "panels.md", meta)
    render_png(panels, drawn, options.out / "dashboard.png")
    return results


def parse_duration_s(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "loadtest/results/dashboard")
    parser.add_argument("--since", default="10m", help="window length, e.g. 90s, 10m, 1h")
    parser.add_argument("--end", type=float, default=None, help="Unix seconds; default now")
    parser.add_argument("--step", type=float, default=2.0, help="plot resolution in seconds")
    parser.add_argument("--rate-interval", default="1m")
    parser.add_argument("--range-rate-interval", default="15s")
    parser.add_argument("--dashboards", type=Path, default=DASHBOARDS_DIR)
    args = parser.parse_args(argv)
    end_s = args.end if args.end is not None else time.time()
    options = RenderOptions(
        prometheus=args.prometheus,
        out=args.out,
        start_s=end_s - parse_duration_s(args.since),
        end_s=end_s,
        step_s=args.step,
        rate_interval=args.rate_interval,
        range_rate_interval=args.range_rate_interval,
    )
    results = render(options, load_panels(dashboard_paths(args.dashboards)))
    missing = empty_queries(results)
    for line in missing:
        print(f"empty: {line}", file=sys.stderr)
    print(f"{sum(len(r.queries) for r in results)} queries, {len(missing)} empty -> {args.out}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
