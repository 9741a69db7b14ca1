"""The edge loads the embedded draft with its restricted head (head_vocab.json) unless told
not to, on the engine that offers one (torch); the llama.cpp engine scores every token."""

from __future__ import annotations

import pytest

from asymspec_engine.embedded import COMMITTED_DRAFT_DIR
from asymspec_engine.head_vocab import read_head_vocab
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.llamacpp import LlamaCppEngine
from edge_gateway.app import load_draft
from edge_gateway.settings import EdgeSettings


@pytest.mark.parametrize("restrict", [True, False])
def test_the_edge_restricts_the_draft_head_as_its_folder_says(restrict: bool) -> None:
    settings = EdgeSettings(
        shared_secret="s" * 16, draft_head_vocab=restrict, threads=1, engine="torch"
    )
    draft, _ = load_draft(settings)
    assert isinstance(draft.lm, LlamaEngine)
    committed = read_head_vocab(COMMITTED_DRAFT_DIR)
    assert committed is not None and 1000 < len(committed) < draft.lm.vocab_size
    if restrict:
        assert draft.lm.head_ids is not None and draft.lm.head_ids.tolist() == committed
    else:
        assert draft.lm.head_ids is None


def test_on_llama_cpp_the_draft_scores_every_token() -> None:
    settings = EdgeSettings(shared_secret="s" * 16, threads=1)  # auto: llama.cpp on a CPU
    draft, _ = load_draft(settings)
    assert isinstance(draft.lm, LlamaCppEngine)
    assert draft.lm.name == "llama.cpp" and not draft.lm.restricts_head
    assert draft.restricted_head() is None
