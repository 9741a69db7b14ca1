"""Benchmark the model backends on a draft/target pair (the embedded pair by default).

    .venv/bin/python scripts/bench_backends.py [--target NAME_OR_PATH] [--draft NAME_OR_PATH]
        [--prompts 8] [--max-new-tokens 64] [--json-out results.json]

Sections (all ratios, because machines here are noisy; times are medians of repeats):

a. batched vs unbatched scoring: max abs difference across sessions of different lengths
b. verify cost: scoring one γ=4 block at a 100- vs a 1000-token prefix (bar: within 25%)
c. one decode step, draft vs target, at batch 1 and 8 (wanted: draft <= 1/4 of target)
d. start-up: loading each model from the model cache
e. reference decoder: greedy output vs target-only greedy on held-out prompts (identical?),
   mean accepted per block at T=0 and T=0.7 with γ=4, and acceptance per position

On a machine whose cores other processes also use, pass ``--threads 1``: two OpenMP
threads that wait on each other's time slices made forwards here 10x (tiny models) to 20x
(the 135M target) slower. Run one section alone with e.g. ``--sections b``.

Prompts are HumanEval's held-out split (``asymspec.prompts``), or ``--prompts-file``: a
JSON-lines file whose lines are strings or objects with a "prompt" field.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec_engine.draft import DEFAULT_COPY_WEIGHT, DraftModel
from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
from asymspec_engine.engine import SessionLM
from asymspec_engine.feature_draft import FeatureLM, is_feature_draft, load_fc
from asymspec_engine.hardware import (
    Precision,
    machine_facts,
    pick_device,
    resolve_precision,
)
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import (
    load_causal_lm,
    resolve_model,
    restrict_draft_head,
    session_lm,
)
from asymspec_engine.target import TargetModel
from asymspec.instructions import instructions
from asymspec.prompts import Message, humaneval_prompts, render_prompt
from asymspec_engine.reference import GenerationStats, speculative_generate, target_generate
from asymspec.sampling import SamplingParams

VERIFY_COST_BAR = 1.25  # (b): t(1000-token prefix) / t(100-token prefix)
DECODE_RATIO_WANTED = 0.25  # (c): draft step / target step


@dataclass
class Pair:
    target: SessionLM
    draft: SessionLM | FeatureLM
    target_model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    precision: Precision
    load_s: dict[str, float]  # (d)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET, help="name, folder or hub id")
    parser.add_argument("--draft", default=EMBEDDED_DRAFT, help="name, folder or hub id")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--prompts-file", type=Path, default=None, help="JSON lines of prompts")
    parser.add_argument("--prompt-style", choices=["completion", "chat"], default="completion")
    parser.add_argument(
        "--prompt-set",
        choices=["humaneval-heldout", "chat-heldout"],
        default="humaneval-heldout",
        help="without --prompts-file: held-out HumanEval, or held-out chat instructions "
        "(asymspec.instructions, spread over every kind; implies --prompt-style chat)",
    )
    parser.add_argument(
        "--head-vocab", action="store_true", help="restrict the draft's head (head_vocab.json)"
    )
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts for (e)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="γ")
    parser.add_argument(
        "--copy-weight", type=float, default=DEFAULT_COPY_WEIGHT, help="λ; 0 = the model alone"
    )
    parser.add_argument(
        "--stop-confidence", type=float, default=0.0, help="τ; 0 = every block drafts γ"
    )
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per measurement")
    parser.add_argument("--sections", default="abcde", help="which sections to run, e.g. 'ab'")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16-weights"],
        help="model precision (the services' ASYMSPEC_*_DTYPE)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    return parser.parse_args()


def load_prompts(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    texts: list[str | list[Message]]
    style = args.prompt_style
    if args.prompts_file is not None:
        lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        texts = [row if isinstance(row, str) else row["prompt"] for row in rows]
    elif args.prompt_set == "chat-heldout":
        held = instructions("heldout")
        step = max(1, len(held) // max(1, args.prompts))  # every kind, not the first few
        texts = [[{"role": "user", "content": i.text}] for i in held[::step]]
        style = "chat"
    else:
        texts = list(humaneval_prompts("heldout"))
    rendered = [render_prompt(text, style, tokenizer) for text in texts]
    return [list(tokenizer(text)["input_ids"]) for text in rendered]


def load_pair(args: argparse.Namespace) -> Pair:
    device = args.device or pick_device()
    start = time.perf_counter()
    precision = resolve_precision(args.dtype, device)
    target_model, tokenizer = load_causal_lm(args.target, device, precision.dtype)
    middle = time.perf_counter()
    draft_model, _ = load_causal_lm(args.draft, device, precision.dtype)
    end = time.perf_counter()
    if target_model.config.vocab_size != draft_model.config.vocab_size:
        raise SystemExit("the draft and the target must share one vocabulary")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    draft: SessionLM | FeatureLM = session_lm(draft_model, pad, precision.fp16_weights)
    folder = Path(resolve_model(args.draft))
    if folder.is_dir() and is_feature_draft(folder):  # fed the target's h (reference.py)
        if not isinstance(draft, LlamaEngine):
            raise SystemExit("a feature draft runs on the LlamaEngine")
        draft = FeatureLM(draft, load_fc(folder).to(draft.dtype))
    if args.head_vocab:
        restrict_draft_head(draft, args.draft)
    return Pair(
        target=session_lm(target_model, pad, precision.fp16_weights),
        draft=draft,
        target_model=target_model,
        tokenizer=tokenizer,
        precision=precision,
        load_s={"target": middle - start, "draft": end - middle},
    )


def interleaved_medians(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median wall time of each run, after one untimed warm-up each.

    The runs take turns within every repeat, so that load from other processes on a shared
    machine hits all of them alike and their ratio stays meaningful.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def long_context(prompts: Sequence[list[int]], length: int) -> list[int]:
    """Held-out prompts back to back, cut to ``length`` tokens (a realistic long prefix)."""
    ids: list[int] = []
    for prompt in prompts:
        ids += prompt
        if len(ids) >= length:
            return ids[:length]
    raise SystemExit(f"the prompts hold fewer than {length} tokens")


# ---------------------------------------------------------------- (a) batched scoring


def bench_batched_scoring(pair: Pair, context: list[int], gamma: int) -> dict[str, Any]:
    """Sessions of different prefix lengths scored in one forward vs one by one."""
    prefix_lengths = [17, 120, 333, 64, 250]
    batched, alone = pair.target, session_lm(pair.target_model)
    batch = []
    for i, length in enumerate(prefix_lengths):
        start = 7 * i  # different text per session, not just different lengths
        prefix, block = context[start : start + length], context[start + length :][: gamma + 1]
        batched.open(f"a{i}", prefix)
        alone.open(f"a{i}", prefix)
        batch.append((f"a{i}", block))
    together = batched.forward_new(batch)
    logit_diff = prob_diff = 0.0
    same_argmax = True
    for i, request in enumerate(batch):
        (single,) = alone.forward_new([request])
        logit_diff = max(logit_diff, float((together[i] - single).abs().max()))
        probs, single_probs = torch.softmax(together[i], -1), torch.softmax(single, -1)
        prob_diff = max(prob_diff, float((probs - single_probs).abs().max()))
        same_argmax &= bool(torch.equal(together[i].argmax(-1), single.argmax(-1)))
    for session_id, _ in batch:
        batched.close(session_id)
    return {
        "prefix_lengths": prefix_lengths,
        "max_abs_logit_diff": logit_diff,
        "max_abs_prob_diff": prob_diff,
        "same_argmax": same_argmax,
    }


# ---------------------------------------------------------------- (b) verify cost vs prefix


def rolled_back_forward(
    lm: SessionLM | FeatureLM, batch: list[tuple[str, list[int]]]
) -> Callable[[], None]:
    """A forward of ``batch`` that then truncates every session back, so it can repeat. A
    feature draft is fed zero features: the cost is the same, whatever their values."""
    lengths = {session_id: lm.length(session_id) for session_id, _ in batch}

    def run() -> None:
        if isinstance(lm, FeatureLM):
            zeros = [torch.zeros((len(ids), lm.hidden_size), dtype=lm.dtype) for _, ids in batch]
            lm.forward_new(batch, None, zeros)
        else:
            lm.forward_new(batch)
        for session_id, length in lengths.items():
            lm.truncate(session_id, length)

    return run


def bench_verify_cost(pair: Pair, context: list[int], gamma: int, repeats: int) -> dict[str, Any]:
    """Scoring tail + γ drafts on a cached 100- vs 1000-token prefix."""
    lm, runs = pair.target, {}
    for prefix in (100, 1000):
        lm.open(f"verify{prefix}", context[:prefix])
        block = context[prefix : prefix + gamma + 1]
        runs[f"prefix_{prefix}"] = rolled_back_forward(lm, [(f"verify{prefix}", block)])
    medians = interleaved_medians(runs, repeats)
    for prefix in (100, 1000):
        lm.close(f"verify{prefix}")
    ratio = medians["prefix_1000"] / medians["prefix_100"]
    return {
        "gamma": gamma,
        "prefix_100_ms": 1e3 * medians["prefix_100"],
        "prefix_1000_ms": 1e3 * medians["prefix_1000"],
        "ratio": ratio,
        "within_bar": ratio <= VERIFY_COST_BAR,
    }


# ---------------------------------------------------------------- (c) decode step


def open_step_sessions(
    lm: SessionLM | FeatureLM, prompts: Sequence[list[int]], batch: int
) -> Callable[[], None]:
    """``batch`` sessions with ~100-token prefixes; returns one batched one-token step."""
    requests = []
    for i in range(batch):
        prefix = (prompts[i % len(prompts)] * 4)[:100]
        if isinstance(lm, FeatureLM):
            zeros = torch.zeros((len(prefix) - 1, lm.hidden_size), dtype=lm.dtype)
            lm.open(f"step{batch}-{i}", prefix[:-1], zeros)
        else:
            lm.open(f"step{batch}-{i}", prefix[:-1])
        requests.append((f"step{batch}-{i}", prefix[-1:]))
    return rolled_back_forward(lm, requests)


def bench_decode_step(pair: Pair, prompts: Sequence[list[int]], repeats: int) -> dict[str, Any]:
    rows = {}
    for batch in (1, 8):
        runs = {
            "target": open_step_sessions(pair.target, prompts, batch),
            "draft": open_step_sessions(pair.draft, prompts, batch),
        }
        medians = interleaved_medians(runs, repeats)
        for lm in (pair.target, pair.draft):
            for i in range(batch):
                lm.close(f"step{batch}-{i}")
        ratio = medians["draft"] / medians["target"]
        rows[f"batch_{batch}"] = {
            "target_ms": 1e3 * medians["target"],
            "draft_ms": 1e3 * medians["draft"],
            "ratio": ratio,
            "meets_wanted": ratio <= DECODE_RATIO_WANTED,
        }
    return rows


# ---------------------------------------------------------------- (e) reference decoder


def _acceptance(stats: Sequence[GenerationStats], gamma: int) -> dict[str, Any]:
    blocks = sum(s.blocks for s in stats)
    per_position = [sum(s.accepted_per_position[i] for s in stats) for i in range(gamma)]
    drafted = [sum(s.drafted_per_position[i] for s in stats) for i in range(gamma)]
    return {
        "blocks": blocks,
        "mean_accepted_per_block": sum(s.accepted_tokens for s in stats) / max(blocks, 1),
        "mean_drafted_per_block": sum(s.draft_tokens for s in stats) / max(blocks, 1),
        "acceptance_per_position": [
            a / max(d, 1) for a, d in zip(per_position, drafted, strict=True)
        ],
        "target_forward_calls": sum(s.target_forward_calls for s in stats),
        "output_tokens": sum(s.output_tokens for s in stats),
    }


def bench_generation(
    pair: Pair, prompts: Sequence[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    target = TargetModel(pair.target)
    draft = DraftModel(pair.draft, args.copy_weight, args.stop_confidence)
    eos, gamma, n = pair.tokenizer.eos_token_id, args.num_draft_tokens, args.max_new_tokens
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    identical, greedy_stats, sampled_stats = 0, [], []
    time_s = {"target_only": 0.0, "speculative_greedy": 0.0}
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        expected = target_generate(target, prompt, n, greedy, args.seed, eos)
        middle = time.perf_counter()
        result = speculative_generate(target, draft, prompt, n, gamma, greedy, args.seed, eos)
        time_s["target_only"] += middle - start
        time_s["speculative_greedy"] += time.perf_counter() - middle
        identical += int(result.tokens == expected.tokens)
        greedy_stats.append(result.stats)
        seed = args.seed + i
        sampled_stats.append(
            speculative_generate(target, draft, prompt, n, gamma, sampled, seed, eos).stats
        )
    return {
        "prompts": len(prompts),
        "max_new_tokens": n,
        "gamma": gamma,
        "copy_weight": args.copy_weight,
        "stop_confidence": args.stop_confidence,
        "greedy_identical": identical,
        "greedy_T0": _acceptance(greedy_stats, gamma),
        "sampled_T0.7": _acceptance(sampled_stats, gamma),
        "wall_s": time_s,
    }


# ---------------------------------------------------------------- report


def print_batched_scoring(a: dict[str, Any]) -> None:
    print(
        f"(a) batched vs unbatched scoring, prefixes {a['prefix_lengths']}: max |Δlogit| "
        f"{a['max_abs_logit_diff']:.2e}, max |Δp| {a['max_abs_prob_diff']:.2e}, "
        f"same argmax: {a['same_argmax']}"
    )


def print_verify_cost(b: dict[str, Any]) -> None:
    print(
        f"(b) verify γ={b['gamma']}: {b['prefix_100_ms']:.1f} ms at 100, "
        f"{b['prefix_1000_ms']:.1f} ms at 1000 tokens, ratio {b['ratio']:.2f} "
        f"(bar <= {VERIFY_COST_BAR}: {'ok' if b['within_bar'] else 'MISSED'})"
    )


def print_decode_step(c: dict[str, Any]) -> None:
    for name, row in c.items():
        print(
            f"(c) decode step {name}: draft {row['draft_ms']:.1f} ms, target "
            f"{row['target_ms']:.1f} ms, ratio {row['ratio']:.2f} "
            f"(wanted <= {DECODE_RATIO_WANTED}: {'ok' if row['meets_wanted'] else 'not met'})"
        )


def print_load(d: dict[str, float]) -> None:
    print(f"(d) load from cache: target {d['target']:.2f} s, draft {d['draft']:.2f} s")


def print_generation(e: dict[str, Any]) -> None:
    print(
        f"(e) greedy identical to target-only: {e['greedy_identical']}/{e['prompts']} prompts "
        f"x {e['max_new_tokens']} tokens; γ={e['gamma']}, copy weight λ={e['copy_weight']}, "
        f"stop confidence τ={e.get('stop_confidence', 0.0)}"
    )
    for name in ("greedy_T0", "sampled_T0.7"):
        row = e[name]
        per_position = ", ".join(f"{rate:.2f}" for rate in row["acceptance_per_position"])
        print(
            f"    {name}: mean accepted per block {row['mean_accepted_per_block']:.2f} over "
            f"{row['blocks']} blocks (drafted per block {row['mean_drafted_per_block']:.2f}); "
            f"acceptance per position [{per_position}]"
        )
    wall = e["wall_s"]
    print(
        f"    wall: target-only {wall['target_only']:.1f} s, speculative (greedy) "
        f"{wall['speculative_greedy']:.1f} s"
    )


def print_report(results: dict[str, Any]) -> None:
    print(
        f"device {results['device']}, torch threads {results['threads']}, "
        f"{results['engine']} in {results['dtype']}"
    )
    printers: dict[str, Callable[[Any], None]] = {
        "a": print_batched_scoring,
        "b": print_verify_cost,
        "c": print_decode_step,
        "d": print_load,
        "e": print_generation,
    }
    for name, print_section in printers.items():
        if name in results:
            print_section(results[name])


def run_sections(args: argparse.Namespace, pair: Pair, prompts: list[list[int]]) -> dict[str, Any]:
    def context() -> list[int]:  # (a) and (b) only: short chat prompts may not fill it
        return long_context(prompts, 1000 + args.num_draft_tokens + 1)

    sections: dict[str, Callable[[], Any]] = {
        "a": lambda: bench_batched_scoring(pair, context(), args.num_draft_tokens),
        "b": lambda: bench_verify_cost(pair, context(), args.num_draft_tokens, args.repeats),
        "c": lambda: bench_decode_step(pair, prompts, args.repeats),
        "d": lambda: pair.load_s,
        "e": lambda: bench_generation(pair, prompts[: args.prompts], args),
    }
    return {name: run() for name, run in sections.items() if name in args.sections}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args)
    prompts = load_prompts(args, pair.tokenizer)
    results: dict[str, Any] = {
        "target": args.target,
        "draft": args.draft,
        "device": str(pair.target_model.device),
        "threads": torch.get_num_threads(),
        "dtype": str(pair.precision),
        "engine": type(pair.target).__name__,
        "machine": machine_facts(),
        **run_sections(args, pair, prompts),
    }
    print_report(results)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
