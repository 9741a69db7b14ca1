"""``python -m loadtest.bench``: the command line of the benchmark (``make bench``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asymspec.links import PROFILES
from asymspec.modes import MODES
from asymspec_engine.embedded import ModelNotPrepared
from loadtest.bench.config import (
    DEFAULT_PROFILES,
    BenchConfig,
    default_run_dir,
    parse_list,
)
from loadtest.bench.workload import WORKLOADS, Sampling


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench",
        description="Every mode × link profile through the namespace testbed (root only).",
    )
    add = parser.add_argument
    add("--modes", default="all", help=f"comma-separated or 'all': {', '.join(MODES)}")
    add("--profiles", default=",".join(DEFAULT_PROFILES), help=f"of {', '.join(PROFILES)}")
    add(
        "--workload",
        choices=WORKLOADS,
        default="humaneval",
        help="humaneval: single-turn requests; agent: multi-round agent conversations "
        "(docs/agents.md), --requests of them, each of three rounds",
    )
    add("--requests", type=int, default=16, help="measured requests per cell (N)")
    add("--concurrency", type=int, default=8, help="closed-loop clients (C)")
    add("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    add("--temperature", type=float, default=0.7)
    add("--fidelity-budget", type=float, default=None, help="ε per request; default: edge's")
    add("--num-draft-tokens", type=int, default=None, help="γ per request; default: edge's")
    add("--stop-at-eos", action="store_true", help="let EOS end a request (default: ignore)")
    add("--warmup", type=int, default=2, help="warm-up requests per cell, not measured")
    add("--models", choices=("tiny", "embedded"), default="embedded")
    add("--seed", type=int, default=0, help="request i gets seed + i")
    add("--rate-check-s", type=float, default=3.0, help="rate check per direction/profile")
    add("--cell-timeout-s", type=float, default=1800.0)
    add(
        "--goodput-pause",
        action="store_true",
        help="leave the edge's goodput pause on, as a user gets it (default: off, so every "
        "speculative mode speculates throughout and the table compares mechanisms)",
    )
    add("--out", type=Path, default=None, help="default: loadtest/results/<models>-<time>")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    sampling = Sampling(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=not args.stop_at_eos,
        fidelity_budget=args.fidelity_budget,
        num_draft_tokens=args.num_draft_tokens,
    )
    return BenchConfig(
        modes=parse_list(args.modes, tuple(MODES)),
        profiles=parse_list(args.profiles, tuple(PROFILES)),
        requests=args.requests,
        concurrency=args.concurrency,
        warmup=args.warmup,
        sampling=sampling,
        models=args.models,
        out=(args.out or default_run_dir(args.models)).resolve(),
        seed=args.seed,
        rate_check_s=args.rate_check_s,
        cell_timeout_s=args.cell_timeout_s,
        goodput_pause=args.goodput_pause,
        workload=args.workload,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from loadtest.bench.runner import Run  # torch and the testbed load only for a real run

    try:
        out = Run(config).execute()
    except ModelNotPrepared as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"results: {out}/results.md")
    return 0
