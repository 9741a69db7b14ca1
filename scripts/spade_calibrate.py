"""SPADE on this system: pick the draft length γ on validation prompts, then the SPADE table.

    sudo .venv/bin/python scripts/spade_calibrate.py                  # embedded pair
    .venv/bin/python scripts/spade_calibrate.py --models tiny --max-tokens 24   # smoke

1. Calibration (SPADE §"Draft token length"): one cloud verifier and one edge gateway in the
   speculative mode (``standard``, SPADE's own system, by default) in the namespace testbed;
   for each γ in {1, 2, 3, 4, 6, 8} the same 10 validation prompts (HumanEval *train* split)
   run with the request field ``num_draft_tokens = γ``; the γ with the highest measured
   throughput is chosen.
2. The table, on held-out prompts at temperature 0 (so outputs are comparable token for
   token): target-only ("Target"), draft-only ("Draft") and each speculative mode at the
   chosen γ, each in fresh processes: target calls per request and per token, throughput,
   cloud runtime (Δ target_forward_seconds_sum) relative to target-only, and the exact-match
   rate of each completion against target-only's.

Outputs: ``loadtest/results/<run>/spade.json`` (the choice, every calibration phase, every
table row) and ``spade.md``. Root only (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Run as a file (python scripts/...), so the repository root is not on sys.path by itself;
# the bench package and netem/ live there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asymspec_engine.hardware import machine_facts, resolve_precision
from asymspec.links import get_profile
from asymspec.prompts import humaneval_prompts
from asymspec.testbed import Testbed, TestbedLayout, open_testbed
from loadtest.bench.cell import CellPlan, run_cell
from loadtest.bench.config import RESULTS_DIR, ModelPair, prepare_pair
from loadtest.bench.report import summarize_phase
from loadtest.bench.tables import fmt_value, markdown_table
from loadtest.bench.workload import Sampling, phase_bodies, with_fields

GAMMAS = (1, 2, 3, 4, 6, 8)
HEALTH_TIMEOUT_S = 600.0


def choose_gamma(calibration: Sequence[dict[str, Any]]) -> int:
    """The γ of the highest-throughput calibration phase (ties: the smaller γ)."""
    best = max(calibration, key=lambda row: (row["throughput_tok_s"], -row["gamma"]))
    return int(best["gamma"])


def exact_match_rate(texts: Sequence[str | None], reference: Sequence[str | None]) -> float:
    """Fraction of requests whose completion equals the reference's (failed = mismatch)."""
    pairs = list(zip(texts, reference, strict=True))
    return sum(a is not None and a == b for a, b in pairs) / len(pairs) if pairs else 0.0


class Spade:
    def __init__(self, args: argparse.Namespace, pair: ModelPair, out: Path) -> None:
        self.args, self.pair, self.out = args, pair, out
        self.logs = out / "logs"
        self.sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature)
        train = humaneval_prompts("train")
        self.validation = train[: args.calibration_prompts]
        # Warm-up prompts follow the calibration ones: never a calibration prompt itself.
        warm = train[args.calibration_prompts :]
        self.warmup = phase_bodies(warm, args.warmup, self.sampling, 1_000_000)
        self.heldout = humaneval_prompts("heldout")

    def cell(
        self, bed: Testbed, mode: str, name: str, phases: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        spec = {
            "health_timeout_s": HEALTH_TIMEOUT_S,
            "warmup": self.warmup,
            "warmup_concurrency": 1,
            "phases": phases,
        }
        plan = CellPlan(
            mode, self.pair, spec, self.logs, name, self.args.cell_timeout_s, self.args.dtype
        )
        started = time.monotonic()
        raw = run_cell(bed, plan, lambda event: None)
        print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        profile = get_profile(self.args.profile)
        rows = []
        for phase in raw["phases"]:
            row = summarize_phase(mode, profile, phase)
            row["texts"] = [r["text"] if r["error"] is None else None for r in phase["records"]]
            rows.append(row)
        return rows

    def calibrate(self, bed: Testbed, mode: str) -> list[dict[str, Any]]:
        bodies = phase_bodies(self.validation, len(self.validation), self.sampling, 0)
        phases = [
            {
                "name": f"gamma-{g}",
                "bodies": with_fields(bodies, num_draft_tokens=g),
                "concurrency": self.args.concurrency,
            }
            for g in self.args.gammas
        ]
        rows = self.cell(bed, mode, f"spade-calibrate-{mode}", phases)
        for gamma, row in zip(self.args.gammas, rows, strict=True):
            row["gamma"] = gamma
        return rows

    def table(self, bed: Testbed, gamma: int) -> list[dict[str, Any]]:
        bodies = phase_bodies(self.heldout, self.args.table_requests, self.sampling, 0)
        systems = [("Target", "target-only", bodies), ("Draft", "draft-only", bodies)]
        spec_bodies = with_fields(bodies, num_draft_tokens=gamma)
        systems += [(f"Speculative ({m})", m, spec_bodies) for m in self.args.modes]
        rows = []
        for system, mode, phase_bodies_ in systems:
            phase = {"name": mode, "bodies": phase_bodies_, "concurrency": self.args.concurrency}
            row = self.cell(bed, mode, f"spade-table-{mode}", [phase])[0]
            row["system"] = system
            row["gamma"] = gamma if mode in self.args.modes else None
            rows.append(row)
        reference = rows[0]
        for row in rows:
            n = row["requests"]
            row["target_calls_per_request"] = row["target_calls"] / n if n else None
            base_s = reference["cloud_target_forward_s"]
            row["cloud_runtime_ratio"] = row["cloud_target_forward_s"] / base_s if base_s else None
            row["exact_match_vs_target"] = exact_match_rate(row["texts"], reference["texts"])
        return rows


def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    calib = result["calibration"]
    lines = [
        [str(r["gamma"]), fmt_value(r["throughput_tok_s"]), fmt_value(r["mean_accepted_per_block"]),
         fmt_value(r["acceptance_rate"]), fmt_value(r["target_calls_per_token"])]
        for r in calib
    ]  # fmt: skip
    calib_md = markdown_table(
        ["γ", "tokens/s", "accepted/block", "acceptance rate", "target calls/token"], lines
    )
    rows = [
        [r["system"], r["mode"], str(r["gamma"] or "—"), fmt_value(r["target_calls_per_request"]),
         fmt_value(r["target_calls_per_token"]), fmt_value(r["throughput_tok_s"]),
         f"{fmt_value(r['cloud_runtime_ratio'])}×", fmt_value(r["exact_match_vs_target"]),
         fmt_value(r["mean_accepted_per_block"])]
        for r in result["table"]
    ]  # fmt: skip
    table_md = markdown_table(
        ["system", "mode", "γ", "target calls / request", "target calls / token", "tokens/s",
         "cloud runtime", "exact match vs Target", "accepted/block"],
        rows,
    )  # fmt: skip
    return (
        f"# SPADE on asymspec ({cfg['models']} models, {cfg['profile']} link)\n\n"
        f"Machine: {json.dumps(result.get('machine'))}\n\n"
        f"Calibration: mode {cfg['calibration_mode']}, {cfg['calibration_prompts']} validation "
        f"prompts (HumanEval train split), max_tokens {cfg['max_tokens']}, temperature "
        f"{cfg['temperature']}, concurrency {cfg['concurrency']}. **Chosen γ = "
        f"{result['gamma']}** (highest throughput).\n\n{calib_md}\n\n"
        f"## SPADE table ({cfg['table_requests']} held-out prompts, γ = {result['gamma']})\n\n"
        f"Cloud runtime = target forward seconds relative to Target. Exact match = completion "
        f"text identical to Target's for the same prompt.\n\n{table_md}\n"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", choices=("tiny", "embedded"), default="embedded")
    add("--profile", default="strong", help="link profile of the testbed")
    add("--modes", default="standard,asymspec", help="speculative modes; the first calibrates")
    add("--gammas", default=",".join(map(str, GAMMAS)))
    add("--calibration-prompts", type=int, default=10)
    add("--table-requests", type=int, default=10)
    add("--max-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.0)
    add("--concurrency", type=int, default=1, help="1 = one request at a time, as SPADE")
    add("--warmup", type=int, default=1)
    add("--cell-timeout-s", type=float, default=1800.0)
    add(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="both services' precision; float32 is the exact mode (greedy output = target's)",
    )
    add("--out", type=Path, default=None, help="run folder; default results/spade-<time>")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.gammas = [int(g) for g in args.gammas.split(",")]
    out = (args.out or RESULTS_DIR / f"spade-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    pair = prepare_pair(args.models, out)
    spade = Spade(args, pair, out)
    with open_testbed(args.profile, TestbedLayout.new(prefix="asymspec-spade")) as bed:
        rates = [c.as_dict() for c in bed.check(seconds=2.0)]
        calibration = spade.calibrate(bed, args.modes[0])
        gamma = choose_gamma(calibration)
        print(f"chosen γ = {gamma}", file=sys.stderr, flush=True)
        table = spade.table(bed, gamma)
    config = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "out": str(out),
        "calibration_mode": args.modes[0],
    }
    machine = {
        **machine_facts(),
        "service_torch_threads": {"cloud": 1, "edge": 1},  # the cells pin one core each
        "service_dtype": f"{args.dtype} = {resolve_precision(args.dtype, 'cpu')}",
    }
    result = {
        "config": config,
        "machine": machine,
        "testbed_rates": rates,
        "gamma": gamma,
        "calibration": calibration,
        "table": table,
    }
    (out / "spade.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "spade.md").write_text(render(result))
    print(f"results: {out}/spade.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
