"""What one draft block costs the edge: ``DraftModel.propose`` on the embedded draft.

    .venv/bin/python scripts/propose_cost.py [--threads 1] [--gamma 3]
        [--batch 1 --batch 4 --batch 16] [--out loadtest/results/propose_cost]

B requests (held-out HumanEval prompts) each draft a γ-token block at T = 0.7 with the
edge's copier (λ = DEFAULT_COPY_WEIGHT) and the draft's restricted head, as the edge runs
it; after each block the caches roll back. Two paths of the same code, interleaved call by
call so the VM's drift hits both alike (``bench_backends.interleaved_medians``): ``head
columns`` (rows mixed and drawn on the head's K tokens, the default) and ``whole
vocabulary`` (every row finished and drawn over all V tokens, as before 2026-12-05).
Also the draft forward alone (``forward_new`` of one token per session), the part no
sampling change touches. Median of the repeats; writes ``propose_cost.json`` and
``propose_cost.txt`` with the CPU model and flags, torch threads and dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from asymspec_engine.draft import DEFAULT_COPY_WEIGHT, DraftModel, DraftRequest
from asymspec_engine.embedded import EMBEDDED_DRAFT
from asymspec_engine.hardware import machine_facts
from asymspec_engine.loading import load_session_lm, restrict_draft_head
from asymspec.prompts import humaneval_prompts
from asymspec.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backends import interleaved_medians


class WholeVocabularyDraft(DraftModel):
    """The same draft with every row finished and drawn over the whole vocabulary."""

    def restricted_head(self) -> None:
        return None


def measure(
    drafts: dict[str, DraftModel], prompts: list[list[int]], batch: int, args: argparse.Namespace
) -> dict[str, float]:
    """Median ms of each draft's propose for ``batch`` requests, and of the forward alone."""
    lm = next(iter(drafts.values())).lm
    sessions = [f"s{i}" for i in range(batch)]
    for session, prompt in zip(sessions, prompts, strict=False):
        lm.open(session, prompt[:-1])
    confirmed = {session: lm.length(session) for session in sessions}
    params = SamplingParams(temperature=0.7)
    seeds = iter(range(10**9))

    def propose(draft: DraftModel) -> None:
        requests = [
            DraftRequest(
                session,
                prompts[i][-1:],
                args.gamma,
                params,
                torch.Generator().manual_seed(next(seeds)),
                rollback_to=confirmed[session],
            )
            for i, session in enumerate(sessions)
        ]
        draft.propose(requests)

    def forward() -> None:
        lm.forward_new([(s, prompts[i][-1:]) for i, s in enumerate(sessions)], [1] * batch)
        for session in sessions:
            lm.truncate(session, confirmed[session])

    runs: dict[str, Callable[[], None]] = {
        label: (lambda draft=draft: propose(draft)) for label, draft in drafts.items()
    }
    runs["draft forward (1 token each)"] = forward
    ms = {label: 1e3 * s for label, s in interleaved_medians(runs, args.repeats).items()}
    for session in sessions:
        lm.close(session)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--batch", type=int, action="append", help="requests per propose")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/propose_cost"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm, tokenizer = load_session_lm(EMBEDDED_DRAFT)
    if not restrict_draft_head(lm, EMBEDDED_DRAFT):
        raise SystemExit(f"{EMBEDDED_DRAFT} has no restricted head (head_vocab.json)")
    drafts = {
        "head columns": DraftModel(lm, copy_weight=DEFAULT_COPY_WEIGHT),
        "whole vocabulary": WholeVocabularyDraft(lm, copy_weight=DEFAULT_COPY_WEIGHT),
    }
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()]
    facts = {**machine_facts(), "dtype": str(getattr(lm, "dtype", "?")).removeprefix("torch.")}
    rows = [
        {"requests": batch, "gamma": args.gamma, "ms": measure(drafts, prompts, batch, args)}
        for batch in args.batch or [1, 4, 16]
    ]
    lines = [f"machine: {json.dumps(facts)}", "", f"propose of γ = {args.gamma}, median ms:", ""]
    labels = list(rows[0]["ms"])
    lines.append("| requests | " + " | ".join(labels) + " | head columns ÷ whole |")
    lines.append("|---" * (len(labels) + 2) + "|")
    for row in rows:
        ms = row["ms"]
        ratio = ms["head columns"] / ms["whole vocabulary"]
        cells = " | ".join(f"{ms[label]:.1f}" for label in labels)
        lines.append(f"| {row['requests']} | {cells} | {ratio:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "propose_cost.json").write_text(
        json.dumps({"machine": facts, "rows": rows}, indent=1) + "\n"
    )
    (args.out / "propose_cost.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
