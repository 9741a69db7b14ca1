"""Protocol fidelity of top-K corrections on real rejections (the AsymSpec paper's Fig. 5).

    .venv/bin/python scripts/fidelity_experiment.py                   # embedded pair, T=0.7
    .venv/bin/python scripts/fidelity_experiment.py --temperature 1.0 --prompts 16 --out DIR

In-process, no services: the embedded draft proposes γ-token blocks on held-out HumanEval
prompts, the target scores each block in one forward, and blocks are accepted left to right
(``asymspec.sampling.accept_block``); each rejected position's target row p and draft row q
(both after the sampling transform) are kept. For every K of the grid and every rejection:

    S          = topk_support(p, K): the K most probable target tokens, ordered
    delta_p    = target tail mass outside S
    eps_K      = certificate(p_S, q_S, delta_p).eps = delta_p / (Z_S + delta_p)
    residual TV = TV(r, r restricted to S) = Z_tail / (Z_S + Z_tail), the exact distance
                 that eps_K bounds (1 when Z_S = 0: nothing drawable on S), with
                 r = residual(p, q) = [p - q]+ / Z, Z_S = sum_S [p - q]+, Z_tail = Z - Z_S
    recall@n   = share of the residual's n most probable tokens (those with r > 0) inside S
    compression = |V| / K

and reports the means over rejections (plus the share with Z_S > 0 and the largest TV).
Outputs ``fidelity.json`` and ``fidelity.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: repo root

from asymspec_engine.draft import DEFAULT_COPY_WEIGHT, DraftModel, DraftRequest
from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
from asymspec_engine.engine import CachedLM, draw_uniform
from asymspec_engine.loading import load_causal_lm
from asymspec_engine.target import ScoreRequest, TargetModel
from asymspec.prompts import humaneval_prompts
from asymspec.sampling import (
    SamplingParams,
    accept_block,
    certificate,
    residual,
    sample,
    topk_support,
    transform,
)

K_GRID = (1, 2, 5, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RECALL_AT = (1, 5, 10)
Row = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Rejection:
    p: Row  # [V] target row at the rejected position, after the sampling transform
    q: Row  # [V] draft row at the same position


def fidelity_at_k(p: Row, q: Row, k: int) -> dict[str, float]:
    """The figures of one rejection for support size K (see the module docstring)."""
    ids, probs, delta_p = topk_support(p, k)
    cert = certificate(probs, q[ids.astype(np.int64)], float(delta_p))
    positive = np.maximum(p.astype(np.float64) - q.astype(np.float64), 0.0)  # [V] [p - q]+
    z = float(positive.sum())
    z_s = float(positive[ids.astype(np.int64)].sum())
    tv = 1.0 if z_s <= 0.0 else max(0.0, z - z_s) / z
    r = residual(p, q)  # [V]
    in_s = np.zeros(p.shape[0], dtype=bool)
    in_s[ids.astype(np.int64)] = True
    out: dict[str, float] = {"residual_tv": tv, "eps_k": cert.eps, "delta_p": float(delta_p)}
    order = np.argsort(-r, kind="stable")
    for n in RECALL_AT:
        top = order[: min(n, int(np.count_nonzero(r)))]
        out[f"recall_top{n}"] = float(in_s[top].mean()) if len(top) else 1.0
    out["drawable"] = float(z_s > 0.0)
    return out


def summarize(rejections: list[Rejection], vocab: int, grid: tuple[int, ...]) -> list[dict]:
    rows = []
    for k in grid:
        per = [fidelity_at_k(r.p, r.q, k) for r in rejections]
        # topk_support clips K to |V|: a K past the vocabulary is the whole row.
        row: dict[str, Any] = {"k": k, "compression": vocab / min(k, vocab) if vocab else 0.0}
        for key in per[0] if per else ():
            row[f"mean_{key}"] = float(np.mean([x[key] for x in per]))
        row["max_residual_tv"] = float(max((x["residual_tv"] for x in per), default=0.0))
        rows.append(row)
    return rows


class Collector:
    """Speculative sampling on the embedded pair, one prompt at a time, keeping rejections."""

    def __init__(self, target: TargetModel, draft: DraftModel, params: SamplingParams) -> None:
        self.target, self.draft, self.params = target, draft, params
        self.blocks = self.accepted = self.drafted = 0

    def run(self, prompt_ids: list[int], max_new: int, gamma: int, seed: int) -> list[Rejection]:
        sid = f"fidelity-{uuid.uuid4().hex}"
        edge, cloud = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
        committed, produced, found = list(prompt_ids), 0, []
        self.target.open(sid, committed)
        self.draft.open(sid, committed)
        try:
            while produced < max_new:
                g = min(gamma, max_new - produced)
                base = len(committed)
                pending = committed[self.draft.length(sid) :]
                block = self.draft.propose([DraftRequest(sid, pending, g, self.params, edge)])[0]
                tail = committed[self.target.length(sid) :]
                score = ScoreRequest(sid, [*tail, *block.tokens.tolist()], g)
                p = transform(self.target.score([score])[0], self.params).cpu()  # [g+1, V]
                uniforms = np.array([draw_uniform(cloud) for _ in range(g + 1)])
                outcome = accept_block(block.tokens, block.probs, p.numpy(), uniforms)
                n = outcome.n_accepted
                self.target.commit(sid, base + n)
                self.draft.rollback(sid, base + n)
                if outcome.bonus_token is not None:
                    next_token = outcome.bonus_token
                else:
                    p_n, q_n = p[n].numpy().copy(), block.rows[n].numpy().copy()
                    found.append(Rejection(p_n, q_n))
                    next_token = sample(residual(p_n, q_n), draw_uniform(edge))
                new = [*block.tokens[:n].tolist(), next_token]
                committed += new
                produced += len(new)
                self.blocks, self.accepted, self.drafted = (
                    self.blocks + 1, self.accepted + n, self.drafted + g
                )  # fmt: skip
        finally:
            self.target.close(sid)
            self.draft.close(sid)
        return found


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["k"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, style in (
        ("mean_residual_tv", "residual TV", "-"), ("mean_eps_k", "certificate eps_K", "--"),
        ("mean_delta_p", "target tail mass delta_p", ":"),
    ):  # fmt: skip
        # A zero cannot sit on a log axis; clip it to the float32 floor so the curve reaches it.
        values = [max(r[key], 1e-8) for r in rows]
        left.plot(ks, values, style, marker="o", ms=3, label=label)
    left.set(xscale="log", yscale="log", xlabel="K", title="distance (mean over rejections)")
    left.legend(fontsize=8, frameon=False)
    for n in RECALL_AT:
        right.plot(ks, [r[f"mean_recall_top{n}"] for r in rows], marker="o", ms=3,
                   label=f"top-{n} recall")  # fmt: skip
    right.set(xscale="log", ylim=(0, 1.05), xlabel="K", title="residual top-n tokens inside S")
    right.legend(fontsize=8, frameon=False, loc="lower right")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--target", default=EMBEDDED_TARGET)
    add("--draft", default=EMBEDDED_DRAFT)
    add("--prompts", type=int, default=12, help="held-out HumanEval prompts")
    add("--max-new-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.7)
    add("--gamma", type=int, default=4)
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=1, help="torch threads (1 on a shared 2-core box)")
    add(
        "--out",
        type=Path,
        default=Path("loadtest/results") / f"fidelity-{time.strftime('%Y%m%d-%H%M%S')}",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    target_lm, tokenizer = load_causal_lm(args.target, "cpu")
    draft_lm, _ = load_causal_lm(args.draft, "cpu")
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    target = TargetModel(CachedLM(target_lm, pad_token_id=pad))
    draft = DraftModel(CachedLM(draft_lm, pad_token_id=pad), DEFAULT_COPY_WEIGHT)  # the edge's q
    params = SamplingParams(temperature=args.temperature)
    collector = Collector(target, draft, params)
    rejections: list[Rejection] = []
    with torch.inference_mode():
        for i, prompt in enumerate(humaneval_prompts("heldout")[: args.prompts]):
            ids = tokenizer(prompt)["input_ids"]
            rejections += collector.run(ids, args.max_new_tokens, args.gamma, args.seed + i)
            print(f"prompt {i}: {len(rejections)} rejections so far", file=sys.stderr, flush=True)
    vocab = int(rejections[0].p.shape[0]) if rejections else 0
    rows = summarize(rejections, vocab, K_GRID)
    result = {
        "config": {**{k: str(v) for k, v in vars(args).items()}},
        "vocab": vocab,
        "rejections": len(rejections),
        "blocks": collector.blocks,
        "mean_accepted_per_block": collector.accepted / max(1, collector.blocks),
        "acceptance_rate": collector.accepted / max(1, collector.drafted),
        "seconds": time.monotonic() - started,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    title = f"{len(rejections)} rejections, T={args.temperature}, γ={args.gamma}, |V|={vocab}"
    plot(rows, args.out / "fidelity.png", title)
    for row in rows:
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))
    print(f"results: {args.out}/fidelity.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
