"""Measure the embedded draft against the embedded target: acceptance and step cost.

    python scripts/measure_draft.py                      # all 33 held-out prompts, T=0 and 0.7
    python scripts/measure_draft.py --prompts 20 --json .cache/measure.json

Acceptance: a plain speculative loop at batch 1 (KV caches cropped on rejection), gamma
draft tokens per block, on HELD-OUT HumanEval prompts that draft training never saw. The
rule is standard speculative sampling on p = softmax(target_logits / T) and
q = softmax(draft_logits / T): draft x_i ~ q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)), left to right; the first rejection ends the block and its
recovered token is drawn from r = [p - q]+ / Z; if all gamma are accepted a bonus token is
drawn from p. At T = 0, p and q are one-hot: accept iff the draft's argmax is the target's.

Reported per temperature: mean accepted draft tokens per block, and per position i the
fraction of blocks whose draft token i was accepted (vLLM's "accepted per position").

Cost: one decode step (one new token with a KV cache of ``--prefix`` tokens) of each model
at batch 1 and batch 8, timed alternately, median of ``--reps``; the ratio is draft/target.
This is a measurement, not the product path: the services have their own backends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET, embedded_path
from asymspec.prompts import humaneval_prompts, render_prompt


@dataclass
class Acceptance:
    gamma: int
    blocks: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per position, blocks accepting it
    generated: int = 0

    def add_block(self, n_accepted: int) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.gamma
        self.blocks += 1
        self.accepted += n_accepted
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    def summary(self) -> dict[str, object]:
        blocks = max(1, self.blocks)
        return {
            "blocks": self.blocks,
            "generated_tokens": self.generated,
            "mean_accepted_per_block": self.accepted / blocks,
            "accepted_per_position": [n / blocks for n in self.accepted_at],
            "draft_acceptance_rate": self.accepted / (blocks * self.gamma),
        }


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) logits -> the sampling distribution; one-hot argmax at T = 0."""
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, -1)


def verify_block(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator
) -> tuple[int, int]:
    """Standard speculative sampling. p: (gamma + 1, V) target, q: (gamma, V) draft.

    Returns (n_accepted, next_token): the recovered token after a rejection, or the bonus
    token when every draft token was accepted.
    """
    for i, x in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        # q[i, x] > 0 because x was sampled from q; the ratio is in [0, inf).
        if u < min(1.0, (p[i, x] / q[i, x]).item()):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        if residual.sum() <= 0:  # p == q up to rounding: a rejection is then impossible
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


def sample(dist: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(dist, 1, generator=generator))


@torch.inference_mode()
def forward(model: PreTrainedModel, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:
    """Feed ``tokens`` after the cached prefix; (len(tokens), V) logits."""
    out = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return out.logits[0].float()


def speculate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompt_ids: list[int],
    args: argparse.Namespace,
    temperature: float,
    stats: Acceptance,
    generator: torch.Generator,
) -> list[int]:
    """Generate ``max_new_tokens`` speculatively; returns the generated token ids."""
    tokens = list(prompt_ids)
    t_cache, d_cache = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    eos = target.config.eos_token_id
    while len(tokens) - len(prompt_ids) < args.max_new_tokens and tokens[-1] != eos:
        # Draft: feed what its cache lacks, then its own proposals one at a time.
        pending = tokens[d_cache.get_seq_length() :]
        drafts, q_rows = [], []
        for _ in range(args.gamma):
            q_i = probs(forward(draft, d_cache, pending)[-1], temperature)
            drafts.append(sample(q_i, generator))
            q_rows.append(q_i)
            pending = drafts[-1:]
        # Target: one forward over its missing prefix + all gamma drafts -> gamma + 1 rows.
        fed = tokens[t_cache.get_seq_length() :] + drafts
        p = probs(forward(target, t_cache, fed)[-(args.gamma + 1) :], temperature)
        n_accepted, next_token = verify_block(p, torch.stack(q_rows), drafts, generator)
        stats.add_block(n_accepted)
        tokens += [*drafts[:n_accepted], next_token]
        # Keep only KV of committed tokens; next_token is fed at the next block.
        keep_first(t_cache, len(tokens) - 1)
        keep_first(d_cache, len(tokens) - 1)
    generated = tokens[len(prompt_ids) :][: args.max_new_tokens]
    stats.generated += len(generated)
    return generated


def keep_first(cache: DynamicCache, n_tokens: int) -> None:
    """Drop cached positions beyond ``n_tokens`` (crop takes a negative count to drop; a
    count of 0 would not mean "drop nothing", so it is never passed)."""
    drop = cache.get_seq_length() - n_tokens
    if drop > 0:
        cache.crop(-drop)


@torch.inference_mode()
def check_greedy(target: PreTrainedModel, prompt_ids: list[int], generated: list[int]) -> None:
    """At T = 0 speculative decoding must reproduce the target's own greedy output."""
    out = target.generate(
        torch.tensor([prompt_ids]), max_new_tokens=len(generated), do_sample=False
    )
    expected = out[0, len(prompt_ids) :].tolist()
    if expected != generated:
        raise SystemExit(f"greedy mismatch: target {expected[:20]} vs speculative {generated[:20]}")


@torch.inference_mode()
def step_seconds(model: PreTrainedModel, batch: int, prefix: int) -> float:
    """One decode step: one new token per row after a cached prefix of ``prefix`` tokens."""
    cache = DynamicCache(config=model.config)
    model(
        input_ids=torch.randint(0, model.config.vocab_size, (batch, prefix)),
        cache=cache,
        use_cache=True,
    )
    token = torch.randint(0, model.config.vocab_size, (batch, 1))
    started = time.perf_counter()
    model(input_ids=token, cache=cache, use_cache=True)
    return time.perf_counter() - started


def measure_cost(models: dict[str, PreTrainedModel], args: argparse.Namespace) -> dict:
    """Median step time per model and batch size, alternating models to share the noise
    of a busy machine; the ratio is draft / target."""
    result: dict[str, dict[str, float]] = {}
    for batch in (1, 8):
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.reps):
            for name, model in models.items():
                times[name].append(step_seconds(model, batch, args.prefix))
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        result[f"batch{batch}"] = {**{f"{k}_ms": v for k, v in ms.items()},
                                   "ratio": ms["draft"] / ms["target"]}  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--target", default=None, help="checkpoint folder (default: embedded)")
    parser.add_argument("--draft", default=None, help="checkpoint folder (default: embedded)")
    parser.add_argument("--prompts", type=int, default=33, help="held-out prompts to use")
    parser.add_argument("--style", choices=["completion", "chat"], default="completion")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--prefix", type=int, default=256, help="cached tokens when timing")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--check-greedy",
        type=int,
        default=0,
        metavar="N",
        help="compare T=0 output with target greedy on the first N prompts",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = {
        "target": args.target or embedded_path(EMBEDDED_TARGET),
        "draft": args.draft or embedded_path(EMBEDDED_DRAFT),
    }
    models = {k: AutoModelForCausalLM.from_pretrained(v).eval() for k, v in paths.items()}
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    texts = humaneval_prompts("heldout")[: args.prompts]
    prompt_ids = [tokenizer(render_prompt(t, args.style, tokenizer)).input_ids for t in texts]
    results: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for temperature in args.temperatures:
        stats, started = Acceptance(args.gamma), time.perf_counter()
        generator = torch.Generator().manual_seed(args.seed)
        for number, ids in enumerate(prompt_ids):
            out = speculate(
                models["target"], models["draft"], ids, args, temperature, stats, generator
            )
            if temperature == 0.0 and number < args.check_greedy:
                check_greedy(models["target"], ids, out)
        summary = stats.summary() | {"seconds": time.perf_counter() - started}
        results[f"T={temperature}"] = summary
        print(f"T={temperature}: " + json.dumps(summary), flush=True)
    results["step_cost"] = measure_cost(models, args)
    print("step cost: " + json.dumps(results["step_cost"]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
