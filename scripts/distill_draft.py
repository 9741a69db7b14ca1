"""Distil the embedded draft model from the embedded target (reproducible, CPU only).

    python -m asymspec_engine.prepare --target-only     # once: the fp32 target in the cache
    python scripts/distill_draft.py                       # all stages -> models/smollm2-draft/
    python scripts/distill_draft.py --stage generate --shard 0/2 --threads 1 &   # two cores:
    python scripts/distill_draft.py --stage generate --shard 1/2 --threads 1     # two shards
    python scripts/distill_draft.py --stage train         # then train and export
    python scripts/distill_draft.py --stage export

Stages (each caches its output under ``.cache/distill/``, git-ignored):

1. ``generate``: the target writes its own continuations (on-policy data: what the draft
   has to predict at serving time) of TRAIN-split prompts: HumanEval (raw completion and
   chat template; greedy and T = 0.7), source-code continuations (``loadtest.prompts``:
   stdlib functions cut after their docstring; greedy and T = 0.7) and generic chat
   instructions. For every generated position it keeps the target's top-K next-token
   log-probabilities (soft labels). Work is split into fixed batches, each saved to its own
   file, so that shards run in parallel and an interrupted run resumes where it stopped;
   batch ``n`` samples with a generator seeded by ``(seed, n)``, so the data does not
   depend on the number of shards.
2. ``train``: a small Llama initialised from a PCA projection of the target's embedding,
   trained by knowledge distillation on the generated positions: KL(p || q) over the
   target's top-K plus one bucket for the rest of the vocabulary, plus cross-entropy on the
   target's argmax. A share of synthetic copy sequences (a window of generated text seen
   again later) teaches the copying that much of the target's output is.
3. ``export``: bf16 weights + config into ``models/smollm2-draft/``.

The held-out HumanEval problems and held-out source prompts (``loadtest.prompts``) are never
used here. See ``models/smollm2-draft/README.md`` for the design, data sizes and measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from asymspec.sampling import sample_rows
from asymspec_engine.embedded import COMMITTED_DRAFT_DIR, REPO_ROOT
from asymspec_engine.engine import SessionLM
from asymspec_engine.hardware import resolve_dtype
from asymspec_engine.head_vocab import HEAD_VOCAB_FILE, read_head_vocab
from asymspec_engine.loading import session_lm
from asymspec_engine.prepare import target_dir
from loadtest.instructions import instructions
from loadtest.prompts import humaneval_prompts, prose_prompts, render_prompt, source_prompts

CACHE = REPO_ROOT / ".cache" / "distill"
GENERATED = CACHE / "generated"  # one file per generation batch
TOP_K = 32  # soft labels kept per position; the rest of the vocabulary is one "tail" bucket
GEN_BATCH = 64  # rows per generation batch: part of the data's definition, not a knob
VALID_EVERY = 40  # every 40th greedy source job is held back for validation
CHAT_NEW_TOKENS = 320  # chat answers run long; most end (EOS) before this


def greedy_blocks(matches: list[bool], gamma: int, n_tokens: int) -> list[int]:
    """Accepted draft tokens per block at T = 0; matches[j]: draft argmax == target token j.
    A block starting at s accepts the leading run of matches (at most gamma)."""
    accepted, position = [], 0
    while position < n_tokens:
        run = 0
        while run < gamma and position + run < len(matches) and matches[position + run]:
            run += 1
        accepted.append(run)
        position += run + 1  # the accepted tokens, then the correction or bonus token
    return accepted


# Generic chat instructions for training. Deliberately disjoint from loadtest.prompts'
# CHAT_PROMPTS, which stay unseen as the chat workload.
TRAIN_CHAT_INSTRUCTIONS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain recursion to a beginner.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn.",
    "How does a binary search work?",
    "Give three reasons to exercise regularly.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "What is an API?",
    "Describe the water cycle.",
    "Write a SQL query that counts orders per customer.",
    "How do I read a CSV file in Python?",
    "What is the capital of France, and what is it known for?",
    "Explain what a unit test is and why it matters.",
    "Write a function to compute the Fibonacci sequence iteratively.",
    "What does the `yield` keyword do in Python?",
    "Suggest a name for a coffee shop and explain it.",
    "How can I merge two dictionaries in Python?",
    "Explain the difference between a process and a thread.",
    "Write a short story opening about a lighthouse keeper.",
    "Sort a list of dictionaries by a key in Python.",
    "What is machine learning?",
    "Write a bash command that finds all .txt files in a folder.",
    "What are the benefits of version control?",
    "Write a Python function that removes duplicates from a list while keeping order.",
)


@dataclass(frozen=True)
class DraftShape:
    """The draft architecture. The lm_head over 49,152 tokens dominates its compute, so the
    hidden size is kept small; depth is cheap in FLOPs but not in time: each layer costs a
    step ~1.4 ms of per-op overhead here, and 8 layers put the step above 1/4 of the
    target's."""

    hidden_size: int = 256
    num_hidden_layers: int = 6
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA: halves the KV cache the edge keeps per request


@dataclass(frozen=True)
class Job:
    """One trajectory to generate."""

    source: str  # e.g. "source-greedy", "humaneval-completion-t0.7"
    text: str  # the rendered prompt
    temperature: float
    max_new_tokens: int


@dataclass
class Sequence:
    """One labelled token sequence: ``ids`` = prompt + generated tokens; ``topk_*[j]`` is the
    target's distribution of ``ids[start + 1 + j]``, for the positions from ``start`` on."""

    ids: torch.Tensor  # (L,) int64
    topk_ids: torch.Tensor  # (L - 1 - start, K) int32
    topk_logp: torch.Tensor  # (L - 1 - start, K) float16, log p over the full vocabulary
    start: int  # first labelled position (the prompt's last token for a trajectory)
    source: str


# ---------------------------------------------------------------- generation


def labels_from_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K log-probabilities over the full vocabulary: (..., V) -> (..., K) ids, log p."""
    logp = logits.float().log_softmax(-1)
    top = logp.topk(TOP_K, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The product's draw (``asymspec.sampling.sample_rows``): one uniform per row."""
    uniforms = torch.rand(len(probs), generator=generator, dtype=torch.float64)
    return torch.tensor(sample_rows(probs, uniforms.tolist()))


def sample_multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The first batches' draw. Its exponential race draws a variate per vocabulary entry,
    3M per 64-row step: a third of the step, against 6% for the inverse CDF."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


def sample_blocked_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The inverse CDF in two levels, one uniform per row: the block whose cumulative mass
    passes ``u x total`` (a cumsum over V / 256 block sums), then the token inside it (a
    cumsum over 256), in float64 like the sequential draw. That one's float64 copy and
    cumsum of all 49,152 tokens per row were ~20 ms of a 184 ms 64-row step (one thread);
    this draws from the same distribution in ~5 ms."""
    uniforms = torch.rand(len(probs), generator=generator, dtype=torch.float64)
    rows, vocab = probs.shape
    weights = probs if vocab % CDF_BLOCK == 0 else F.pad(probs, (0, -vocab % CDF_BLOCK))
    blocks = weights.view(rows, -1, CDF_BLOCK)  # [B, nb, S]; float64 only where summed
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb]
    if not bool((block_cdf[:, -1] > 0.0).all()):
        raise ValueError("cannot sample from a row with no positive mass")
    goal = uniforms[:, None] * block_cdf[:, -1:]  # [B, 1]
    block = torch.searchsorted(block_cdf, goal, right=True).clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks[torch.arange(rows), block[:, 0]].double().cumsum(-1) + before  # [B, S]
    index = torch.searchsorted(inside, goal, right=True)[:, 0]  # [B]
    token = block[:, 0] * CDF_BLOCK + index
    # Rounding can put the goal at or past its block's last cumulative value (index == S):
    # then, as the sequential draw does at the row's end, take the block's last token with
    # mass (the row's, if the block has none).
    for row in torch.nonzero(index >= CDF_BLOCK).flatten().tolist():
        massive = torch.nonzero(blocks[row, int(block[row])] > 0).flatten()
        token[row] = (
            int(block[row]) * CDF_BLOCK + int(massive.max())
            if len(massive)
            else int(torch.nonzero(probs[row] > 0).max())
        )
    return token


# How a sampled row draws its token: part of a batch's definition (its folder's name).
SAMPLERS = {
    "blocked-cdf": sample_blocked_cdf,
    "inverse-cdf": sample_inverse_cdf,
    "multinomial": sample_multinomial,
}
DEFAULT_SAMPLER = "blocked-cdf"


@torch.inference_mode()
def generate_batch(
    lm: SessionLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_id: int,
    sampler: str = DEFAULT_SAMPLER,
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Continue the prompts on the serving engine (ragged, no padding; logits for one row
    per live prompt): per row (new tokens, top-K ids, top-K log p). Rows that finish (EOS)
    leave the batch, so their compute is not wasted."""
    sessions = [f"gen{row}" for row in range(len(prompts))]
    for session in sessions:
        lm.open(session, [])
    pending = [list(p) for p in prompts]  # what each session's cache has not seen yet
    live = list(range(len(prompts)))
    tokens: list[list[int]] = [[] for _ in prompts]
    labels: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    try:
        for step in range(max_new_tokens):
            rows = lm.forward_new(
                [(sessions[r], pending[r]) for r in live], keep_rows=[1] * len(live)
            )
            logits = torch.cat(rows)  # (b, V)
            top_ids, top_logp = labels_from_logits(logits)
            if temperature == 0.0:
                token = logits.argmax(-1)
            else:
                token = SAMPLERS[sampler](
                    torch.softmax(logits.float() / temperature, -1), generator
                )
            for i, row in enumerate(live):
                tokens[row].append(int(token[i]))
                labels[row].append((top_ids[i], top_logp[i]))
                pending[row] = [int(token[i])]
            live = [row for i, row in enumerate(live) if int(token[i]) != eos_id]
            if step == max_new_tokens - 1 or not live:
                break
    finally:
        for session in sessions:
            lm.close(session)
    return [
        (
            tokens[row],
            torch.stack([i for i, _ in labels[row]]),
            torch.stack([lp for _, lp in labels[row]]),
        )
        for row in range(len(prompts))
    ]


def training_jobs(tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> list[Job]:
    """Every trajectory to generate, in a fixed order."""
    jobs: list[Job] = []
    for code in humaneval_prompts("train"):
        chat = render_prompt(code, "chat", tokenizer)
        jobs.append(Job("humaneval-completion-greedy", code, 0.0, 160))
        jobs += [Job("humaneval-completion-t0.7", code, 0.7, 160)] * args.humaneval_samples
        jobs.append(Job("humaneval-chat-greedy", chat, 0.0, 160))
        jobs.append(Job("humaneval-chat-t0.7", chat, 0.7, 160))
    code_prompts = source_prompts("train")
    random.Random(args.seed).shuffle(code_prompts)
    for number, code in enumerate(code_prompts[: args.source_greedy]):
        kind = "valid-source-greedy" if number % VALID_EVERY == 0 else "source-greedy"
        jobs.append(Job(kind, code, 0.0, 128))
    for code in code_prompts[: args.source_sampled]:
        jobs.append(Job("source-t0.7", code, 0.7, 128))
    for instruction in TRAIN_CHAT_INSTRUCTIONS:
        chat = render_prompt([{"role": "user", "content": instruction}], "chat", tokenizer)
        jobs.append(Job("chat-greedy", chat, 0.0, 160))
        jobs.append(Job("chat-t0.7", chat, 0.7, 160))
    if args.plan == "v1":
        return jobs
    # v2: templated everyday chat (train subjects only), stdlib prose, and more samples
    # of every source prompt; sampled trajectories at T = 0.7 and T = 1.0 are on-policy
    # data for sampled serving, and each is a different text.
    for item in instructions("train"):
        chat = render_prompt([{"role": "user", "content": item.text}], "chat", tokenizer)
        jobs.append(Job(f"instruct-{item.kind}-greedy", chat, 0.0, CHAT_NEW_TOKENS))
        jobs += [Job(f"instruct-{item.kind}-t0.7", chat, 0.7, CHAT_NEW_TOKENS)] * args.chat_samples
        jobs += [
            Job(f"instruct-{item.kind}-t1", chat, 1.0, CHAT_NEW_TOKENS)
        ] * args.chat_hot_samples
    for text in prose_prompts("train"):
        jobs.append(Job("prose-greedy", text, 0.0, 128))
        jobs += [Job("prose-t0.7", text, 0.7, 128)] * args.prose_samples
        jobs += [Job("prose-t1", text, 1.0, 128)] * args.prose_samples
    for code in code_prompts[args.source_greedy :]:  # v1 took the first source_greedy
        jobs.append(Job("source-greedy", code, 0.0, 128))
    for code in code_prompts:
        jobs += [Job("source-t0.7", code, 0.7, 128)] * args.source_samples
        jobs += [Job("source-t1", code, 1.0, 128)] * args.source_samples
    return jobs


def generation_plan(jobs: list[Job], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Job indices batched by (temperature, length budget) and prompt length (little
    padding); batch n is the same whatever the number of shards."""
    lengths = [len(tokenizer(job.text).input_ids) for job in jobs]
    order = sorted(
        range(len(jobs)),
        key=lambda i: (jobs[i].temperature, jobs[i].max_new_tokens, lengths[i], i),
    )
    plan: list[list[int]] = []
    for index in order:
        last = plan[-1] if plan else None
        same = last is not None and (
            (jobs[last[0]].temperature, jobs[last[0]].max_new_tokens)
            == (jobs[index].temperature, jobs[index].max_new_tokens)
        )
        if same and last is not None and len(last) < GEN_BATCH:
            last.append(index)
        else:
            plan.append([index])
    return plan


def generated_dir(jobs: list[Job], plan: list[list[int]], seed: int, sampler: str) -> Path:
    """The batch files' folder, named by what defines the data: other options, other data.
    (The first sampler's folders were named before there was a choice, without it.)"""
    defined_by = [seed, [asdict(job) for job in jobs], plan]
    if sampler != "multinomial":
        defined_by.append(sampler)
    return GENERATED / hashlib.sha256(json.dumps(defined_by).encode()).hexdigest()[:12]


def batch_files(jobs: list[Job], plan: list[list[int]], seed: int) -> dict[int, Path]:
    """Batch number -> its file, from whichever sampler's folder holds it (the default
    sampler's first). Each file is reproducible by its own folder's sampler, and every
    sampler draws exactly from the target at the job's temperature, so any serves."""
    found: dict[int, Path] = {}
    for sampler in sorted(SAMPLERS, key=lambda name: name != DEFAULT_SAMPLER):
        for path in sorted(generated_dir(jobs, plan, seed, sampler).glob("batch_*.pt")):
            found.setdefault(int(path.stem.removeprefix("batch_")), path)
    return found


def stage_generate(args: argparse.Namespace) -> None:
    model, tokenizer = load_target(resolve_dtype("auto", "cpu"))  # the serving dtype
    lm = session_lm(model, int(tokenizer.pad_token_id or 0))
    jobs = training_jobs(tokenizer, args)
    plan = generation_plan(jobs, tokenizer)
    shard, shards = (int(part) for part in args.shard.split("/"))
    mine = [n for n in range(len(plan)) if n % shards == shard]
    # A seeded order, so that the batches done so far are a fair sample of the whole plan
    # (the plan is sorted by temperature and length), whenever a run is stopped.
    random.Random(args.seed).shuffle(mine)
    if args.reverse:  # a helper for a slow shard: it takes that shard's work from the end
        mine.reverse()
    # Start further along that order: batches an earlier draft was trained on (the first of
    # each shard's order) are left to it, so that a warm start sees new text.
    mine = mine[args.skip :]
    folder = generated_dir(jobs, plan, args.seed, args.sampler)
    folder.mkdir(parents=True, exist_ok=True)
    started, made = time.perf_counter(), 0
    done = batch_files(jobs, plan, args.seed)  # by any sampler; other shards own other numbers
    for number in mine:
        path = folder / f"batch_{number:05d}.pt"
        if number in done:
            continue
        part = [jobs[i] for i in plan[number]]
        prompts = [tokenizer(job.text).input_ids for job in part]
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + number)
        outputs = generate_batch(
            lm,
            prompts,
            part[0].max_new_tokens,
            part[0].temperature,
            generator,
            tokenizer.eos_token_id,
            args.sampler,
        )
        sequences = [
            Sequence(torch.tensor(prompt + new), top_ids, top_logp, len(prompt) - 1, job.source)
            for job, prompt, (new, top_ids, top_logp) in zip(part, prompts, outputs, strict=True)
        ]
        tmp = path.with_suffix(".tmp")
        torch.save([as_row(seq) for seq in sequences], tmp)
        tmp.rename(path)  # a batch file is complete or absent
        made += sum(len(seq.topk_ids) for seq in sequences)
        elapsed = time.perf_counter() - started
        print(
            f"generate shard {args.shard}: batch {number} ({len(plan)} in all), "
            f"{made} new tokens in {elapsed:.0f} s ({made / elapsed:.1f}/s)",
            flush=True,
        )
    print(f"generate shard {args.shard}: done; {len(plan)} batches in the plan")


# ---------------------------------------------------------------- training data


def copy_sequence(pool: list[Sequence], rng: random.Random) -> Sequence:
    """Context, a window W of generated text, filler, W again: hard labels on the second W
    (every token of it after the first is predictable by copying)."""

    def window(length: int) -> list[int]:
        s = rng.choice(pool)
        generated = s.ids[s.start + 1 :].tolist()
        first = rng.randrange(max(1, len(generated) - length))
        return generated[first : first + length]

    repeated = window(rng.randint(12, 48))
    context, filler = window(rng.randint(16, 96)), window(rng.randint(4, 64))
    ids = context + repeated + filler + repeated
    start = len(context) + len(repeated) + len(filler)  # input = W[0], predicts W[1]
    targets = torch.tensor(repeated[1:], dtype=torch.int32)
    top_ids = torch.zeros((len(targets), TOP_K), dtype=torch.int32)
    top_ids[:, 0] = targets
    # p = 1 on the copied token; -30 (not -inf) keeps 0 * log 0 terms finite in the loss.
    top_logp = torch.full((len(targets), TOP_K), -30.0, dtype=torch.float16)
    top_logp[:, 0] = 0.0
    return Sequence(torch.tensor(ids), top_ids, top_logp, start, "copy")


def training_data(args: argparse.Namespace) -> tuple[list[Sequence], list[Sequence]]:
    """(train, valid): every generated trajectory, plus copy sequences; validation is the
    held-back greedy source trajectories (TRAIN split, never trained on)."""
    _, tokenizer = load_target()
    jobs = training_jobs(tokenizer, args)
    plan = generation_plan(jobs, tokenizer)
    files = [path for _, path in sorted(batch_files(jobs, plan, args.seed).items())]
    if args.allow_partial and files:  # a fair sample: batches are generated in shuffled order
        print(f"train: {len(files)} of {len(plan)} generated batches (--allow-partial)")
    elif len(files) != len(plan):
        raise SystemExit(
            f"{len(files)} of {len(plan)} generated batches are under {GENERATED}; "
            "run --stage generate (with the same options) first"
        )
    sequences = [Sequence(**row) for path in files for row in torch.load(path)]
    valid = [s for s in sequences if s.source.startswith("valid-")]
    train = [s for s in sequences if not s.source.startswith("valid-")]
    rng = random.Random(args.seed)
    n_copy = int(len(train) * args.copy_share / (1 - args.copy_share))
    train += [copy_sequence(train, rng) for _ in range(n_copy)]
    return train, valid


# ---------------------------------------------------------------- the draft and its training


def draft_config(target: LlamaConfig, shape: DraftShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=target.vocab_size,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        tie_word_embeddings=True,  # one 49,152 x d matrix: half the bytes of untied
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=dict(target.rope_parameters or {}),
        rms_norm_eps=target.rms_norm_eps,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
        **asdict(shape),
    )


def pca_embedding(target_embedding: torch.Tensor, dim: int) -> torch.Tensor:
    """The target's (tied) embedding projected on its top ``dim`` principal directions.

    Logits are h . e_v, so the draft starts with the target's geometry of the vocabulary in
    a smaller space instead of random rows (rare tokens get little gradient in training).
    """
    centered = target_embedding - target_embedding.mean(0)
    _, _, vh = torch.linalg.svd(centered, full_matrices=False)  # vh: (576, 576)
    return target_embedding @ vh[:dim].T  # (V, dim)


class Head:
    """The tokens the draft's LM head scores in training: the ones it will score when
    served (``head_vocab.json``, ``LlamaEngine.restrict_head``), or the whole vocabulary.
    Training on the served head gives the softmax the edge samples from, and skips most of
    the head's cost: the 49,152 x 256 product was three quarters of a training step."""

    def __init__(self, vocab_size: int, token_ids: list[int] | None) -> None:
        self.ids = None if token_ids is None else torch.tensor(sorted(set(token_ids)))
        # vocabulary id -> column of the head's logits; -1 outside the head
        self.column = torch.arange(vocab_size)
        if self.ids is not None:
            self.column = torch.full((vocab_size,), -1, dtype=torch.long)
            self.column[self.ids] = torch.arange(len(self.ids))

    @property
    def size(self) -> int:
        return len(self.column) if self.ids is None else len(self.ids)

    def logits(self, model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, H): logits over the head's tokens."""
        weight = model.lm_head.weight
        return hidden @ (weight if self.ids is None else weight[self.ids]).T

    def token(self, columns: torch.Tensor) -> torch.Tensor:
        """Head columns -> vocabulary ids."""
        return columns if self.ids is None else self.ids[columns]


def kd_loss(
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logp: torch.Tensor,
    ce_weight: float,
    head: Head,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(p || q) with the vocabulary outside the target's top-K as one bucket,
    plus ``ce_weight`` x cross-entropy on the target's argmax. Returns (losses (N,), argmax
    agreement (N,)). q is 0 outside the head, so top-K tokens outside it join p's bucket
    (the KL of the coarser partition), and the argmax's cross-entropy counts only inside.

    logits: (N, H) draft over the head; topk_ids, topk_logp: (N, K) target, log p sorted
    descending.
    """
    logq = logits.float().log_softmax(-1)  # (N, H)
    columns = head.column[topk_ids.long()]  # (N, K)
    inside = columns >= 0
    logq_k = logq.gather(-1, columns.clamp(min=0))  # (N, K); junk where outside
    logp_k = topk_logp.float()
    p_k = torch.where(inside, logp_k.exp(), 0.0)
    q_k = torch.where(inside, logq_k.exp(), 0.0)
    tail_p = (1 - p_k.sum(-1)).clamp(min=1e-6)
    tail_q = (1 - q_k.sum(-1)).clamp(min=1e-6)
    kl = (p_k * torch.where(inside, logp_k - logq_k, 0.0)).sum(-1)
    kl = kl + tail_p * (tail_p.log() - tail_q.log())
    ce = torch.where(inside[:, 0], -logq_k[:, 0], 0.0)
    agree = (head.token(logits.argmax(-1)) == topk_ids[:, 0].long()).float()
    return kl + ce_weight * ce, agree


def batches(
    sequences: list[Sequence], tokens_per_batch: int, rng: random.Random
) -> list[list[int]]:
    """Index batches of similar length (little padding), in shuffled order."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i].ids), i))
    out: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = len(sequences[index].ids)
        if current and width * (len(current) + 1) > tokens_per_batch:
            out.append(current)
            current = []
        current.append(index)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def collate(sequences: list[Sequence]) -> tuple[torch.Tensor, ...]:
    """Right-padded inputs, and labels for the kept (labelled) positions in row-major order."""
    width = max(len(s.ids) for s in sequences) - 1
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    keep = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, s in enumerate(sequences):
        ids[row, : len(s.ids) - 1] = s.ids[:-1]
        keep[row, s.start : len(s.ids) - 1] = True
    top_ids = torch.cat([s.topk_ids for s in sequences])  # (N, K), N = keep.sum()
    top_logp = torch.cat([s.topk_logp for s in sequences])
    return ids, top_ids, top_logp, keep


def train_step(
    model: LlamaForCausalLM, batch: tuple[torch.Tensor, ...], ce_weight: float, head: Head
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per labelled position: (losses (N,), argmax agreement (N,))."""
    ids, top_ids, top_logp, keep = batch
    hidden = model.model(input_ids=ids).last_hidden_state[keep]  # (N, d) labelled positions
    return kd_loss(head.logits(model, hidden), top_ids, top_logp, ce_weight, head)


def new_draft(shape: DraftShape, init: Path | None = None) -> LlamaForCausalLM:
    """A fresh draft (embedding from the target's PCA), or one continued from ``init``
    (deepened to ``shape``'s layers by ``deepen`` when it has fewer)."""
    if init is not None:
        model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32)
        if model.config.hidden_size != shape.hidden_size:
            raise SystemExit(f"{init} is not a {shape} draft")
        if model.config.num_hidden_layers < shape.num_hidden_layers:
            return deepen(model, shape.num_hidden_layers)
        if model.config.num_hidden_layers > shape.num_hidden_layers:
            raise SystemExit(f"{init} has more layers than {shape}")
        return model
    target, _ = load_target()
    model = LlamaForCausalLM(draft_config(target.config, shape))
    with torch.no_grad():
        embedding = pca_embedding(target.model.embed_tokens.weight, shape.hidden_size)
        model.model.embed_tokens.weight.copy_(embedding)
    return model


def deepen(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """The same function with ``layers`` layers: copies of evenly spread layers inserted
    after their originals, with their output projections (o_proj, down_proj) zeroed, so
    each new layer adds nothing to the residual stream yet, and starts learning at once
    (its other weights are trained ones, so their gradients are not zero)."""
    old = model.config.num_hidden_layers
    extra = layers - old
    after = {round((k + 1) * old / extra) - 1 for k in range(extra)}
    sources: list[tuple[int, bool]] = []  # (old layer, is a new copy) per new layer
    for i in range(old):
        sources.append((i, False))
        if i in after:
            sources.append((i, True))
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    grown = LlamaForCausalLM(config)
    weights = model.state_dict()
    state = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for new, (i, fresh) in enumerate(sources):
        prefix = f"model.layers.{i}."
        for key, value in weights.items():
            if key.startswith(prefix):
                name = key.removeprefix(prefix)
                zero = fresh and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
                state[f"model.layers.{new}.{name}"] = torch.zeros_like(value) if zero else value
    grown.load_state_dict(state)
    return grown


def stage_train(args: argparse.Namespace) -> None:
    """Train, saving a resumable snapshot every ``--save-every`` steps."""
    torch.manual_seed(args.seed)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    train, valid = training_data(args)
    model = new_draft(DraftShape(num_hidden_layers=args.layers), args.init)
    head = Head(model.config.vocab_size, None if args.full_head else read_head_vocab(args.out))
    if head.ids is None and not args.full_head:
        raise SystemExit(f"no {HEAD_VOCAB_FILE} in {args.out}: run scripts/draft_head_vocab.py")
    rng = random.Random(args.seed)
    plan = [b for _ in range(args.epochs) for b in batches(train, args.batch_tokens, rng)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(len(plan), warmup=100))
    positions = sum(len(s.topk_ids) for s in train)
    print(
        f"train: {len(train)} sequences, {positions} labelled positions, {len(plan)} steps, "
        f"head of {head.size} tokens"
    )
    snapshot_path, first_step = args.run_dir / "draft_train.partial.pt", 1
    if snapshot_path.is_file() and (snap := torch.load(snapshot_path))["plan"] == len(plan):
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        schedule.load_state_dict(snap["schedule"])
        first_step = snap["step"] + 1
        print(f"train: resuming at step {first_step}")
    # bf16 autocast (fp32 master weights) where the CPU has native bf16: 2.02 s against
    # 2.70 s per 4,096-token step in fp32 on two threads here (torch 2.13; an older note
    # said 40x slower, which no longer holds).
    use_bf16 = args.train_dtype == "bfloat16" or (
        args.train_dtype == "auto" and resolve_dtype("auto", "cpu") == torch.bfloat16
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    print(f"train: {'bf16 autocast' if use_bf16 else 'float32'}")
    started = time.perf_counter()
    for step in range(first_step, len(plan) + 1):
        model.train()
        batch = collate([train[i] for i in plan[step - 1]])  # outside autocast: it casts
        with autocast:
            losses, agree = train_step(model, batch, args.ce_weight, head)
        losses.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % args.save_every == 0 or step == len(plan):
            minutes = (time.perf_counter() - started) / 60
            print(
                f"step {step}/{len(plan)} loss {losses.mean().item():.3f} "
                f"agree {agree.mean().item():.3f} valid {json.dumps(validate(model, valid, head))} "
                f"{minutes:.1f} min",
                flush=True,
            )
            snap = {
                "plan": len(plan),
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
            }
            torch.save(snap, snapshot_path.with_suffix(".tmp"))
            snapshot_path.with_suffix(".tmp").rename(snapshot_path)
    torch.save(model.state_dict(), args.run_dir / "draft_fp32.pt")
    summary = {
        "sequences": len(train),
        "positions": positions,
        "steps": len(plan),
        "minutes_this_run": (time.perf_counter() - started) / 60,
        "valid": validate(model, valid, head),
        "head_tokens": head.size,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    snapshot_path.unlink(missing_ok=True)


def warmup_cosine(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


@torch.no_grad()
def validate(
    model: LlamaForCausalLM, valid: list[Sequence], head: Head, gamma: int = 4
) -> dict[str, float]:
    """On held-back greedy trajectories: argmax agreement with the target, and the accepted
    draft tokens per block a greedy speculative loop would get (the leading run of
    agreements from each block start, at most ``gamma``)."""
    model.eval()
    agreements, blocks = [], []
    for s in valid:
        ids, _, _, keep = collate([s])
        hidden = model.model(input_ids=ids).last_hidden_state[0, keep[0]]
        predicted = head.token(head.logits(model, hidden).argmax(-1))
        matches = (predicted == s.topk_ids[:, 0].long()).tolist()
        agreements += matches
        blocks += greedy_blocks(matches, gamma, len(matches))
    return {
        "agree": round(sum(agreements) / max(1, len(agreements)), 4),
        "accepted_per_block": round(sum(blocks) / max(1, len(blocks)), 3),
    }


def stage_export(args: argparse.Namespace) -> None:
    target, _ = load_target()
    model = LlamaForCausalLM(draft_config(target.config, DraftShape(num_hidden_layers=args.layers)))
    model.load_state_dict(torch.load(args.run_dir / "draft_fp32.pt"))
    model.generation_config.bos_token_id = target.generation_config.bos_token_id
    model.generation_config.eos_token_id = target.generation_config.eos_token_id
    model.generation_config.pad_token_id = target.generation_config.pad_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    model.bfloat16().save_pretrained(args.out)  # bf16: half the committed bytes
    size = (args.out / "model.safetensors").stat().st_size
    print(f"exported {args.out} ({size / 1e6:.1f} MB)")


# ---------------------------------------------------------------- plumbing


def load_target(
    dtype: torch.dtype = torch.float32,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    path = target_dir()
    if not (path / "config.json").is_file():
        raise SystemExit(f"no target at {path}; run `python -m asymspec_engine.prepare` first")
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


def as_row(sequence: Sequence) -> dict[str, object]:
    """A Sequence as a dict, without dataclasses.asdict's deep copies of the tensors."""
    return {f.name: getattr(sequence, f.name) for f in fields(sequence)}


STAGES = {"generate": stage_generate, "train": stage_train, "export": stage_export}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    parser.add_argument("--out", type=Path, default=COMMITTED_DRAFT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="use 1 per shard")
    parser.add_argument("--shard", default="0/1", help="generate: this shard of N, 'k/N'")
    parser.add_argument("--reverse", action="store_true", help="generate: last batch first")
    parser.add_argument(
        "--skip", type=int, default=0, help="generate: start at this position of the order"
    )
    parser.add_argument("--sampler", choices=list(SAMPLERS), default=DEFAULT_SAMPLER)
    parser.add_argument("--humaneval-samples", type=int, default=4, help="T=0.7 per prompt")
    parser.add_argument("--source-greedy", type=int, default=3000, help="source prompts")
    parser.add_argument("--source-sampled", type=int, default=800, help="of the same prompts")
    parser.add_argument("--plan", choices=["v1", "v2"], default="v2", help="generation jobs")
    parser.add_argument("--chat-samples", type=int, default=10, help="v2: T=0.7 per instruction")
    parser.add_argument("--chat-hot-samples", type=int, default=8, help="v2: T=1 per instruction")
    parser.add_argument("--prose-samples", type=int, default=4, help="v2: per temperature")
    parser.add_argument("--source-samples", type=int, default=4, help="v2: per temperature")
    parser.add_argument(
        "--train-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: bf16 autocast where the CPU has AMX-BF16 or AVX512-BF16",
    )
    parser.add_argument("--copy-share", type=float, default=0.15, help="of training sequences")
    parser.add_argument(
        "--allow-partial", action="store_true", help="train: on the batches generated so far"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=CACHE,
        help="train, export: the snapshot, fp32 weights and summary (one per parallel run)",
    )
    parser.add_argument("--init", type=Path, default=None, help="train: continue this draft")
    parser.add_argument(
        "--full-head",
        action="store_true",
        help="train: score the whole vocabulary, not the head_vocab.json in --out",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=DraftShape.num_hidden_layers,
        help="train, export: the draft's depth (an --init with fewer is deepened)",
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ce-weight", type=float, default=0.5)
    parser.add_argument("--save-every", type=int, default=50)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    for name in STAGES if args.stage == "all" else [args.stage]:
        started = time.perf_counter()
        STAGES[name](args)
        print(f"== stage {name} done in {(time.perf_counter() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
