"""The draft's distillation data plan (scripts/distill_draft.py): what it asks the target to
continue never includes a held-out prompt, and v2 covers chat, prose and code."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from transformers import AutoTokenizer

from asymspec_engine.embedded import REPO_ROOT
from asymspec_engine.prepare import target_dir
from loadtest.instructions import instructions
from loadtest.prompts import (
    CHAT_PROMPTS,
    humaneval_prompts,
    prose_prompts,
    source_prompts,
)

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import distill_draft


def test_the_v2_plan_has_every_kind_and_no_heldout_prompt() -> None:
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    args = distill_draft.build_parser().parse_args([])
    assert args.plan == "v2"
    jobs = distill_draft.training_jobs(tokenizer, args)
    kinds = Counter(job.source.split("-")[0] for job in jobs)
    assert {"instruct", "prose", "source", "humaneval", "chat"} <= set(kinds)
    budget = sum(job.max_new_tokens for job in jobs)
    assert budget >= 10_000_000  # the 10M target-written tokens, at most lengths
    texts = "\n".join({job.text for job in jobs})
    for held in (
        [i.text for i in instructions("heldout")]
        + [m["content"] for c in CHAT_PROMPTS for m in c if m["role"] == "user"]
        + prose_prompts("heldout")
        + source_prompts("heldout")
        + humaneval_prompts("heldout")
    ):
        assert held not in texts, held[:60]
    v1 = distill_draft.training_jobs(tokenizer, argparse.Namespace(**{**vars(args), "plan": "v1"}))
    assert jobs[: len(v1)] == v1  # v2 extends v1
