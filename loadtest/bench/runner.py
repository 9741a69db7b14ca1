"""The run: profiles × modes through one namespace testbed, with a progress bar.

One testbed for the whole run, re-shaped per profile (``Testbed.switch``); each profile's
rates are measured once (``Testbed.check``) before its cells, with no service running.
Modes run in the configured order within a profile. Results are rewritten after every cell,
so an interrupted run keeps what it measured. A failed cell becomes a row with ``error``
and the run goes on.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from asymspec.links import get_profile
from asymspec_engine.hardware import machine_facts, resolve_dtype
from asymspec_engine.loading import choose_engine
from loadtest.bench.cell import CellFailed, CellPlan, run_cell, service_torch_threads
from loadtest.bench.config import BenchConfig, ModelPair, prepare_pair
from loadtest.bench.plots import write_plots
from loadtest.bench.report import summarize_phase
from loadtest.bench.tables import bars, check_rows, write_outputs
from loadtest.bench.workload import (
    measured_bodies,
    measured_conversations,
    warmup_bodies,
    warmup_conversations,
)
from loadtest.testbed import Testbed, TestbedLayout, open_testbed

HEALTH_TIMEOUT_S = 600.0  # two model loads on a contended CPU


def environment() -> dict[str, Any]:
    facts = machine_facts()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": facts["cpu_model"],
        "cpu_bf16_flags": facts["cpu_bf16_flags"],
        # what every cell's services run with (cell.py): their torch threads, each pinned
        # to a core (the engines' threads), and the dtype "auto" resolves to on this CPU
        # where a model runs on the torch engine (``engines``: which one each model runs on)
        "service_torch_threads": service_torch_threads(),
        "service_dtype": str(resolve_dtype("auto", "cpu")).removeprefix("torch."),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def engines(pair: ModelPair) -> dict[str, str]:
    """The engine each service picks for its model on this machine (``auto``, or the
    environment's ASYMSPEC_*_ENGINE), with its GGUF file where llama.cpp runs it."""
    chosen = {}
    for role, model, variable in (
        ("cloud", pair.target, "ASYMSPEC_CLOUD_ENGINE"),
        ("edge", pair.draft, "ASYMSPEC_EDGE_ENGINE"),
    ):
        choice = choose_engine(os.environ.get(variable, "auto"), model, "cpu")
        chosen[role] = choice.name + (f" ({choice.gguf.name})" if choice.gguf else "")
    return chosen


def driver_spec(config: BenchConfig) -> dict[str, Any]:
    """What the driver sends: HumanEval requests, or (``agent``) ``requests`` conversations
    of three rounds each, replayed round by round."""
    warmup_concurrency = max(1, min(config.warmup, config.concurrency))
    if config.workload == "agent":
        conversations = measured_conversations(config.requests, config.sampling, config.seed)
        return {
            "health_timeout_s": HEALTH_TIMEOUT_S,
            "warmup_conversations": warmup_conversations(
                config.warmup, config.sampling, config.seed
            ),
            "warmup_concurrency": warmup_concurrency,
            "phases": [
                {
                    "name": "measured",
                    "conversations": conversations,
                    "concurrency": config.concurrency,
                }
            ],
        }
    measured = measured_bodies(config.requests, config.sampling, config.seed)
    return {
        "health_timeout_s": HEALTH_TIMEOUT_S,
        "warmup": warmup_bodies(config.warmup, config.sampling, config.seed),
        "warmup_concurrency": warmup_concurrency,
        "phases": [{"name": "measured", "bodies": measured, "concurrency": config.concurrency}],
    }


class Run:
    """One benchmark run's state: config, model pair, rates, rows, and where they go."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.out = config.out
        self.logs = self.out / "logs"
        self.raw = self.out / "raw"
        self.rows: list[dict[str, Any]] = []
        self.rates: dict[str, list[dict[str, Any]]] = {}
        self.env = environment()
        self.per_cell = config.requests

    def results(self) -> dict[str, Any]:
        return {
            "config": self.config.to_json(),
            "environment": self.env,
            "testbed_rates": self.rates,
            "rows": self.rows,
            "bars": bars(self.rows, self.rates),
        }

    def save(self) -> None:
        self.env["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        results = self.results()
        check_rows(results["rows"])
        write_outputs(self.out, results)

    def execute(self) -> Path:
        for folder in (self.logs, self.raw):
            folder.mkdir(parents=True, exist_ok=True)
        pair = prepare_pair(self.config.models, self.out)
        self.env["engines"] = engines(pair)
        cfg = self.config
        cells = [(p, m) for p in cfg.profiles for m in cfg.modes]
        spec = driver_spec(cfg)
        self.per_cell = sum(len(c) for c in spec["phases"][0].get("conversations", [])) or (
            cfg.requests
        )  # requests a cell sends (an agent conversation's rounds each count)
        with (
            open_testbed(cfg.profiles[0], TestbedLayout.new(prefix="asymspec-bench")) as bed,
            tqdm(total=len(cells) * self.per_cell, unit="req", dynamic_ncols=True) as bar,
        ):
            for profile in cfg.profiles:
                self._shape(bed, profile, bar)
                for mode in cfg.modes:
                    bar.set_description(f"{profile}/{mode}")
                    self.rows.append(self._cell(bed, pair, spec, profile, mode, bar))
                    self.save()
        write_plots(self.out, self.results())
        return self.out

    def _shape(self, bed: Testbed, profile: str, bar: tqdm) -> None:
        state = bed.state
        if state is None or state.profile.name != profile:
            bed.switch(get_profile(profile))
        bar.set_description(f"{profile}: rate check")
        checks = bed.check(seconds=self.config.rate_check_s)
        self.rates[profile] = [c.as_dict() for c in checks]
        for c in checks:
            if not c.ok:
                bar.write(f"warning: {profile} {c.direction} measured {c.as_dict()}")

    def _cell(
        self,
        bed: Testbed,
        pair: ModelPair,
        spec: dict[str, Any],
        profile: str,
        mode: str,
        bar: tqdm,
    ) -> dict[str, Any]:
        name = f"{profile}-{mode}"
        plan = CellPlan(
            mode, pair, spec, self.logs, name, self.config.cell_timeout_s,
            goodput_pause=self.config.goodput_pause,
        )  # fmt: skip
        done = bar.n

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") == "request" and event.get("phase") == "measured":
                bar.update(1)
                if not event.get("ok"):
                    bar.write(f"{name}: request {event['index']} failed: {event['error']}")

        started = time.monotonic()
        try:
            raw = run_cell(bed, plan, on_event)
        except CellFailed as exc:
            bar.write(f"{name}: FAILED: {str(exc)[:2000]}")
            bar.update(self.per_cell - (bar.n - done))
            return {"mode": mode, "profile": profile, "error": str(exc)[:4000]}
        (self.raw / f"{name}.json").write_text(json.dumps(raw))
        row = summarize_phase(mode, get_profile(profile), raw["phases"][0])
        row["cell_s"] = time.monotonic() - started
        bar.write(
            f"{name}: {row['throughput_tok_s']:.1f} tok/s, "
            f"up {row['uplink_bytes_per_token'] or 0:.1f} B/tok, "
            f"accepted/block {row['mean_accepted_per_block'] or 0:.2f}, "
            f"cell {row['cell_s']:.0f} s"
        )
        return row
