"""Choose the draft's restricted LM head: the tokens the target writes most often.

    .venv/bin/python scripts/draft_head_vocab.py [--size 16384] [--out models/smollm2-draft]

Counts the target-written tokens of the distillation data (``scripts/distill_draft.py
--stage generate``: every generated position of every batch file under
``.cache/distill/generated/``), keeps the ``--size`` most frequent plus the tokenizer's
special tokens, and writes ``head_vocab.json`` beside the draft's weights. Coverage, the
share of target-written tokens inside the set, is measured on every 5th batch file with
the set counted on the others, and recorded in the file with the data it came from.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "shared"))

from asymspec_engine.embedded import COMMITTED_DRAFT_DIR  # noqa: E402
from asymspec_engine.head_vocab import write_head_vocab  # noqa: E402
from asymspec_engine.prepare import target_dir  # noqa: E402

GENERATED = REPO / ".cache" / "distill" / "generated"


def generated_tokens(path: Path) -> collections.Counter[int]:
    counts: collections.Counter[int] = collections.Counter()
    for row in torch.load(path, weights_only=False):
        ids = torch.as_tensor(row["ids"])
        counts.update(ids[int(row["start"]) + 1 :].tolist())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--data", type=Path, default=GENERATED)
    parser.add_argument("--out", type=Path, default=COMMITTED_DRAFT_DIR)
    args = parser.parse_args()
    files = sorted(args.data.glob("*/batch_*.pt"))
    if not files:
        raise SystemExit(f"no generated batches under {args.data}; run distill_draft.py first")
    fit, held = collections.Counter[int](), collections.Counter[int]()
    for number, path in enumerate(files):
        (held if number % 5 == 0 else fit).update(generated_tokens(path))
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    special = {int(t) for t in tokenizer.all_special_ids}

    def choose(counts: collections.Counter[int]) -> list[int]:
        chosen = set(special)
        for token, _ in counts.most_common():
            if len(chosen) >= args.size:
                break
            chosen.add(token)
        return sorted(chosen)

    held_total = sum(held.values())
    coverage = sum(n for t, n in held.items() if t in set(choose(fit))) / max(1, held_total)
    every = fit + held
    token_ids = choose(every)
    path = write_head_vocab(
        args.out,
        token_ids,
        {
            "size": len(token_ids),
            "vocab_size": len(tokenizer),
            "counted_tokens": sum(every.values()),
            "distinct_tokens": len(every),
            "batch_files": len(files),
            "heldout_coverage": round(coverage, 5),
            "how": "scripts/draft_head_vocab.py: the most frequent target-written tokens of "
            "the distillation data, plus the special tokens",
        },
    )
    print(
        f"{path}: {len(token_ids)} tokens of {len(tokenizer)}; {sum(every.values())} "
        f"target-written tokens counted ({len(every)} distinct); coverage of held-out "
        f"batches {coverage:.4f}"
    )


if __name__ == "__main__":
    main()
