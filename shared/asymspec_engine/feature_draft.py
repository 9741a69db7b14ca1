"""A feature draft: EAGLE's draft head (Li et al., 2024) at the edge, fed the target's
hidden states down the fast link.

A small independent draft agrees with the target on about half of held-out chat tokens
(``models/smollm2-draft/README.md``): it has to guess from the tokens alone what the target
will write. The target's own last hidden state ``h_s`` (after the final norm: what its LM
head reads to predict ``x_{s+1}``) already holds most of that answer. The cloud computes it
for every position it verifies, and the downlink is the fast direction, so the verdict
carries ``h`` of the positions it confirmed (a few KB a block) and the edge drafts from it.

The draft is one Llama decoder layer (run by ``LlamaEngine``) whose input at position s is

    x_s^in = fc([embed(x_s), h_{s-1}])        (h_{-1} = 0)

and whose output after its final norm, ``ĥ_s``, stands in for ``h_s``: the LM head (the
target's own embedding, tied, restricted to ``head_vocab.json``) turns it into q of
``x_{s+1}``, and it is the feature input of the next draft step, where no target feature
exists yet. Everything the draft produces is still a proposal distribution q, so
speculative sampling stays exact whatever the features are (bf16 on the wire, a replica
that sends none: any q is allowed, as long as the edge tests with the q it sampled from).

On disk a feature draft is a Hugging Face Llama checkpoint of one layer (its embedding is
the target's) plus ``feature_fc.safetensors``, the fused input projection; that file is what
marks a folder as a feature draft (``is_feature_draft``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors.torch import load_file, save_file

from asymspec_engine.engine import NewTokens
from asymspec_engine.llama import LlamaEngine

FEATURE_FC_FILE = "feature_fc.safetensors"
FC_WEIGHT = "fc.weight"  # [hidden, 2 hidden]: [embed(x_s), h_{s-1}] -> the layer's input


def is_feature_draft(folder: Path) -> bool:
    return (folder / FEATURE_FC_FILE).is_file()


def load_fc(folder: Path) -> torch.Tensor:
    return load_file(str(folder / FEATURE_FC_FILE))[FC_WEIGHT]


def save_fc(folder: Path, weight: torch.Tensor) -> None:
    save_file({FC_WEIGHT: weight.contiguous()}, str(folder / FEATURE_FC_FILE))


class FeatureLM:
    """Per-session caches of a feature draft; the interface of ``SessionLM`` plus the target
    features each fed token needs.

    ``prev_features[b]`` [n_b, hidden]: for each new token x_s of item b, ``h_{s-1}`` (the
    target's feature of the position before it; zeros before the first token). ``None``
    for a one-token item: the draft's own ``ĥ`` of the session's last position (a draft
    step after the first of a block). Not thread-safe, like the engine it wraps.
    """

    def __init__(self, engine: LlamaEngine, fc_weight: torch.Tensor) -> None:
        hidden = int(engine.embed.shape[1])
        if tuple(fc_weight.shape) != (hidden, 2 * hidden):
            raise ValueError(f"fc weight {tuple(fc_weight.shape)}: need ({hidden}, {2 * hidden})")
        self.engine = engine
        self.hidden_size = hidden
        self.fc = engine.make_linear(fc_weight.to(engine.dtype), None)
        self._last: dict[str, torch.Tensor] = {}  # session -> ĥ at its last position [hidden]

    # SessionLM's bookkeeping, delegated
    @property
    def forward_calls(self) -> int:
        return self.engine.forward_calls

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def sessions(self) -> int:
        return self.engine.sessions()

    def length(self, session_id: str) -> int:
        return self.engine.length(session_id)

    def token_ids(self, session_id: str) -> list[int]:
        return self.engine.token_ids(session_id)

    def close(self, session_id: str) -> None:
        self._last.pop(session_id, None)
        self.engine.close(session_id)

    def truncate(self, session_id: str, new_length: int) -> None:
        if new_length != self.engine.length(session_id):
            self._last.pop(session_id, None)  # ĥ of a position that is gone
        self.engine.truncate(session_id, new_length)

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        prev_features: torch.Tensor | None = None,
    ) -> None:
        """Start a session and feed ``token_ids`` (may be empty) with their features."""
        self.engine.open(session_id, [])
        if token_ids:
            try:
                self.forward_new([(session_id, token_ids)], [0], [prev_features])
            except BaseException:
                self.close(session_id)
                raise

    def forward_new(
        self,
        batch: Sequence[NewTokens],
        keep_rows: Sequence[int] | None = None,
        prev_features: Sequence[torch.Tensor | None] | None = None,
        head_only: bool = False,
    ) -> list[torch.Tensor]:
        """One forward over many sessions (``LlamaEngine.forward_new``'s contract)."""
        if not batch:
            return []
        counts = [len(ids) for _, ids in batch]
        keeps = list(counts) if keep_rows is None else [int(k) for k in keep_rows]
        given = list(prev_features) if prev_features is not None else [None] * len(batch)
        features = [
            self._features(s, n, f) for (s, _), n, f in zip(batch, counts, given, strict=True)
        ]
        ids = torch.tensor([int(t) for _, new in batch for t in new])
        embedded = self.engine.embed[ids]  # [T, hidden]
        inputs = self.fc(torch.cat([embedded, torch.cat(features)], dim=-1))  # [T, hidden]
        logits, out = self.engine.forward_features(
            batch, keeps, [1] * len(batch), inputs, head_only=head_only
        )
        for (session_id, _), h in zip(batch, out, strict=True):
            self._last[session_id] = h[-1]
        return logits

    def _features(self, session_id: str, n_new: int, given: torch.Tensor | None) -> torch.Tensor:
        if given is not None:
            if tuple(given.shape) != (n_new, self.hidden_size):
                raise ValueError(
                    f"session {session_id!r}: features {tuple(given.shape)} for {n_new} tokens"
                )
            return given.to(self.engine.dtype)
        last = self._last.get(session_id)
        if n_new != 1 or last is None:
            raise ValueError(
                f"session {session_id!r}: {n_new} new tokens without target features"
                + ("" if n_new != 1 else " and no draft feature of its last position")
            )
        return last[None]


def features_to_wire(features: torch.Tensor) -> npt.NDArray[np.uint16]:
    """[rows, hidden] (any float dtype) -> the wire's bf16 bit patterns (``wire.Features``)."""
    bf16 = features.detach().to("cpu", torch.bfloat16).contiguous()
    return bf16.view(torch.int16).numpy().view(np.uint16)


def features_from_wire(bits: npt.NDArray[np.uint16]) -> torch.Tensor:
    """The wire's bf16 bit patterns -> a bf16 tensor [rows, hidden] (a copy: wire arrays
    are read-only views of the frame)."""
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


class FeatureLog:
    """A request's target features by position, as the cloud sends them: the prompt's at
    open, then each verdict's (its tail's and accepted drafts'). Kept in the chunks they
    came in, so that reading the last few rows never copies the whole history."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self._chunks: list[tuple[int, torch.Tensor]] = []  # (first position, [rows, hidden])
        self.end = 0  # positions 0 .. end - 1 are known

    def extend(self, start: int, rows: torch.Tensor) -> None:
        """h of positions start .. start + len(rows) - 1; what was known from start on goes
        (a session re-opened on another replica sends the whole prefix again)."""
        if not 0 <= start <= self.end:
            raise ValueError(f"features from position {start}; only 0 .. {self.end} known")
        if rows.ndim != 2 or rows.shape[1] != self.hidden_size:
            raise ValueError(f"features {tuple(rows.shape)}: need [rows, {self.hidden_size}]")
        while self._chunks and self._chunks[-1][0] >= start:
            self._chunks.pop()
        if self._chunks:
            first, last = self._chunks[-1]
            if first + len(last) > start:
                self._chunks[-1] = (first, last[: start - first])
        if len(rows):
            self._chunks.append((start, rows))
        self.end = start + len(rows)

    def before(self, first: int, end: int) -> torch.Tensor:
        """[end - first, hidden]: for each token position s in first .. end - 1, h_{s-1}
        (zeros for s = 0): what a feature draft reads with token x_s."""
        if not 0 <= first < end or end - 1 > self.end:
            raise ValueError(f"features before positions {first} .. {end - 1}; {self.end} known")
        parts: list[torch.Tensor] = []
        want_from, want_end = first - 1, end - 1  # h positions wanted: want_from .. want_end-1
        for start, rows in reversed(self._chunks):
            if start + len(rows) <= max(want_from, 0):
                break
            lo, hi = max(want_from, start), min(want_end, start + len(rows))
            if lo < hi:
                parts.append(rows[lo - start : hi - start])
        parts.reverse()
        if want_from < 0:  # position 0 has no position before it
            dtype = parts[0].dtype if parts else torch.bfloat16
            parts.insert(0, torch.zeros((1, self.hidden_size), dtype=dtype))
        return torch.cat(parts)
