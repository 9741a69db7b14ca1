"""A draft's restricted LM head: the tokens it may propose, stored beside its weights.

``head_vocab.json`` in a draft's folder lists the token ids its LM head scores (the most
frequent tokens the target writes, chosen by ``scripts/draft_head_vocab.py``); the edge
then runs ``LlamaEngine.restrict_head`` on them, so the draft's q is 0 elsewhere. That is
exact (acceptance and recovery use the same q) and saves most of the draft head's cost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEAD_VOCAB_FILE = "head_vocab.json"


def read_head_vocab(folder: Path) -> list[int] | None:
    """The token ids listed in ``folder``'s head_vocab.json, or None when there is none."""
    path = folder / HEAD_VOCAB_FILE
    if not path.is_file():
        return None
    ids = json.loads(path.read_text())["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{path}: token_ids must be a list of ints")
    return ids


def write_head_vocab(folder: Path, token_ids: list[int], facts: dict[str, Any]) -> Path:
    path = folder / HEAD_VOCAB_FILE
    path.write_text(json.dumps({**facts, "token_ids": token_ids}) + "\n")
    return path
