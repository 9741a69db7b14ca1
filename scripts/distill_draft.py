"""Distil the embedded draft model from the embedded target (reproducible, CPU only).

    python -m asymspec.backends.prepare --target-only   # once: the fp32 target in the cache
    python scripts/distill_draft.py                     # all stages -> models/smollm2-draft/
    python scripts/distill_draft.py --stage train       # retrain from the cached target data

Stages (each caches its output under ``.cache/distill/``, git-ignored, so that a rerun of a
later stage does not redo an earlier one):

1. ``generate``: the target writes its own continuations of the TRAIN-split HumanEval
   prompts (raw completion and chat template; greedy and temperature 0.7) and of some
   generic chat instructions, in batches with the KV cache. For every position we keep the
   target's top-K next-token log-probabilities (its soft labels).
2. ``label``: target soft labels for chunks of this machine's Python stdlib source.
3. ``train``: a small Llama initialised from a PCA projection of the target's embedding,
   trained by knowledge distillation: KL(p || q) over the target's top-K plus one bucket for
   the rest of the vocabulary, plus cross-entropy on the target's argmax token.
4. ``export``: bf16 weights + config into ``models/smollm2-draft/``.

The held-out HumanEval problems (``asymspec.prompts``, every 5th) are never used here.
See ``models/smollm2-draft/README.md`` for the design, data sizes, times and measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from asymspec.backends.embedded import COMMITTED_DRAFT_DIR, REPO_ROOT
from asymspec.backends.prepare import target_dir
from asymspec.prompts import humaneval_prompts, render_prompt

CACHE = REPO_ROOT / ".cache" / "distill"
TOP_K = 32  # soft labels kept per position; the rest of the vocabulary is one "tail" bucket

# Generic chat instructions for training. Deliberately disjoint from asymspec.prompts'
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
    """The draft architecture. The lm_head over 49,152 tokens dominates its cost, so the
    hidden size is kept small and depth (cheap by comparison) carries the capacity."""

    hidden_size: int = 256
    num_hidden_layers: int = 6
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA: halves the KV cache the edge keeps per request


@dataclass
class Sequence:
    """One labelled token sequence; labels[t] is the target's distribution of ids[t + 1]."""

    ids: torch.Tensor  # (L,) int64
    topk_ids: torch.Tensor  # (L - 1, K) int32
    topk_logp: torch.Tensor  # (L - 1, K) float16, log-probabilities over the full vocabulary
    source: str  # e.g. "humaneval-completion-greedy", "stdlib"
    loss_start: int = 0  # labels before this position are context only (set in training)


# ---------------------------------------------------------------- target soft labels


def labels_from_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K log-probabilities over the full vocabulary: (..., V) -> (..., K) ids, log p."""
    logp = logits.float().log_softmax(-1)
    top = logp.topk(TOP_K, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


@torch.inference_mode()
def topk_logprobs(model: PreTrainedModel, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Labels from final hidden states (B, T, d), chunked over positions so that the
    (B, T, 49152) float32 logits never exist at once."""
    parts = [labels_from_logits(model.lm_head(chunk)) for chunk in hidden.split(64, dim=1)]
    return torch.cat([ids for ids, _ in parts], 1), torch.cat([lp for _, lp in parts], 1)


@torch.inference_mode()
def generate_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_id: int,
    pad_id: int,
) -> list[Sequence]:
    """Continue left-padded prompts with the KV cache, keeping top-K labels everywhere."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    hidden = model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    ).last_hidden_state  # (B, P, d)
    label_ids, label_logp = topk_logprobs(model, hidden)
    steps_ids, steps_topk, steps_logp = [], [label_ids], [label_logp]
    last_logits = model.lm_head(hidden[:, -1]).float()  # (B, V)
    done = torch.zeros(batch, dtype=torch.bool)
    lengths = torch.full((batch,), max_new_tokens)
    for step in range(max_new_tokens):
        if temperature == 0.0:
            token = last_logits.argmax(-1)
        else:
            probs = torch.softmax(last_logits / temperature, -1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        steps_ids.append(token)
        finished_now = ~done & (token == eos_id)
        lengths[finished_now] = step + 1
        done |= finished_now
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], 1)
        positions = positions[:, -1:] + 1
        hidden = model.model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).last_hidden_state  # (B, 1, d)
        last_logits = model.lm_head(hidden[:, -1]).float()  # (B, V)
        top_ids, top_logp = labels_from_logits(last_logits)
        steps_topk.append(top_ids[:, None])
        steps_logp.append(top_logp[:, None])
    new_ids = torch.stack(steps_ids, 1)  # (B, n)
    all_topk, all_logp = torch.cat(steps_topk, 1), torch.cat(steps_logp, 1)  # (B, P+n-1, K)
    sequences = []
    for row, prompt in enumerate(prompts):
        n_new = int(min(lengths[row], new_ids.shape[1]))
        seq_ids = torch.cat([torch.tensor(prompt), new_ids[row, :n_new]])
        first = width - len(prompt)
        stop = first + len(seq_ids) - 1
        sequences.append(
            Sequence(
                seq_ids, all_topk[row, first:stop].clone(), all_logp[row, first:stop].clone(), ""
            )
        )
    return sequences


def training_prompts(tokenizer: AutoTokenizer, samples: int) -> list[tuple[str, str, float]]:
    """(source, text, temperature) for every target trajectory to generate."""
    jobs: list[tuple[str, str, float]] = []
    for code in humaneval_prompts("train"):
        jobs.append(("humaneval-completion-greedy", code, 0.0))
        jobs += [("humaneval-completion-t0.7", code, 0.7)] * samples
        jobs.append(("humaneval-chat-greedy", render_prompt(code, "chat", tokenizer), 0.0))
    for instruction in TRAIN_CHAT_INSTRUCTIONS:
        chat = render_prompt([{"role": "user", "content": instruction}], "chat", tokenizer)
        jobs.append(("chat-greedy", chat, 0.0))
        jobs.append(("chat-t0.7", chat, 0.7))
    return jobs


def generation_batches(jobs: list[tuple[str, str, float]], size: int) -> list[list[int]]:
    """Job indices batched by temperature and prompt length (little padding), fixed order."""
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i][2], len(jobs[i][1]), i))
    out: list[list[int]] = []
    for temperature in sorted({job[2] for job in jobs}):
        same = [i for i in order if jobs[i][2] == temperature]
        out += [same[first : first + size] for first in range(0, len(same), size)]
    return out


def stage_generate(args: argparse.Namespace) -> None:
    """Target trajectories, resumable: progress is saved after every batch (with the
    sampler's state), so an interrupted run continues where it stopped."""
    model, tokenizer = load_target()
    jobs = training_prompts(tokenizer, args.samples)
    plan = generation_batches(jobs, args.gen_batch)
    key = [args.seed, args.max_new_tokens, args.gen_batch, args.samples, len(jobs)]
    partial_path = CACHE / "trajectories.partial.pt"
    generator = torch.Generator().manual_seed(args.seed)
    sequences: list[Sequence] = []
    done = 0
    if partial_path.is_file() and (partial := torch.load(partial_path))["key"] == key:
        done, generator_state = partial["done"], partial["generator"]
        sequences = [Sequence(**row) for row in partial["sequences"]]
        generator.set_state(generator_state)
        print(f"generate: resuming after {done} of {len(plan)} batches")
    started = time.perf_counter()
    for number in range(done, len(plan)):
        part = [jobs[i] for i in plan[number]]
        prompts = [tokenizer(text).input_ids for _, text, _ in part]
        made = generate_batch(
            model,
            prompts,
            args.max_new_tokens,
            part[0][2],
            generator,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
        for seq, (source, _, _) in zip(made, part, strict=True):
            seq.source = source
        sequences.extend(made)
        snapshot = {
            "key": key,
            "done": number + 1,
            "generator": generator.get_state(),
            "sequences": [as_row(s) for s in sequences],
        }
        torch.save(snapshot, partial_path.with_suffix(".tmp"))
        partial_path.with_suffix(".tmp").rename(partial_path)
        report_progress("generate", len(sequences), len(jobs), sequences, started)
    save_sequences(sequences, CACHE / "trajectories.pt")
    partial_path.unlink(missing_ok=True)


def stdlib_chunks(
    tokenizer: AutoTokenizer, n_tokens: int, length: int, seed: int
) -> list[list[int]]:
    """Seeded, sorted-then-shuffled chunks of this interpreter's stdlib source (no tests)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not {"test", "tests", "site-packages", "idle_test"} & set(p.relative_to(root).parts)
    )
    random.Random(seed).shuffle(files)
    chunks: list[list[int]] = []
    for path in files:
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace")).input_ids
        chunks.extend(ids[i : i + length] for i in range(0, len(ids) - length + 1, length))
        if len(chunks) * length >= n_tokens:
            break
    return chunks[: n_tokens // length]


@torch.inference_mode()
def stage_label(args: argparse.Namespace) -> None:
    model, tokenizer = load_target()
    chunks = stdlib_chunks(tokenizer, args.stdlib_tokens, args.stdlib_length, args.seed)
    sequences: list[Sequence] = []
    started = time.perf_counter()
    for first in range(0, len(chunks), args.label_batch):
        ids = torch.tensor(chunks[first : first + args.label_batch])  # (B, L)
        hidden = model.model(input_ids=ids).last_hidden_state
        top_ids, top_logp = topk_logprobs(model, hidden[:, :-1])
        for row in range(ids.shape[0]):
            # clone: a saved view would carry its whole batch's storage with it
            labels = top_ids[row].clone(), top_logp[row].clone()
            sequences.append(Sequence(ids[row].clone(), *labels, "stdlib"))
        report_progress("label", len(sequences), len(chunks), sequences, started)
    save_sequences(sequences, CACHE / "stdlib.pt")


# ---------------------------------------------------------------- the draft and its training


def draft_config(target: LlamaConfig, shape: DraftShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=target.vocab_size,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        tie_word_embeddings=True,  # one 49,152 x d matrix: half the bytes of untied
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=dict(target.rope_parameters),
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


def kd_loss(
    logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor, ce_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || q) with the vocabulary outside the target's top-K as one bucket, plus
    ``ce_weight`` x cross-entropy on the target's argmax. Returns (loss, argmax agreement).

    logits: (N, V) draft; topk_ids, topk_logp: (N, K) target, log p sorted descending.
    """
    logq = logits.float().log_softmax(-1)  # (N, V)
    logq_k = logq.gather(-1, topk_ids.long())  # (N, K)
    logp_k = topk_logp.float()
    p_k = logp_k.exp()
    tail_p = (1 - p_k.sum(-1)).clamp(min=1e-6)
    tail_q = (1 - logq_k.exp().sum(-1)).clamp(min=1e-6)
    kl = (p_k * (logp_k - logq_k)).sum(-1) + tail_p * (tail_p.log() - tail_q.log())
    ce = -logq_k[:, 0]
    agree = (logits.argmax(-1) == topk_ids[:, 0].long()).float().mean()
    return (kl + ce_weight * ce).mean(), agree


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
    """Right-padded inputs and labels; ``keep`` drops padding and context-only positions."""
    width = max(len(s.ids) for s in sequences) - 1
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    top_ids = torch.zeros((len(sequences), width, TOP_K), dtype=torch.int32)
    top_logp = torch.zeros((len(sequences), width, TOP_K), dtype=torch.float16)
    keep = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, s in enumerate(sequences):
        n = len(s.ids) - 1
        ids[row, :n], top_ids[row, :n], top_logp[row, :n] = s.ids[:-1], s.topk_ids, s.topk_logp
        keep[row, s.loss_start : n] = True
    return ids, top_ids, top_logp, keep


def train_step(
    model: LlamaForCausalLM, batch: tuple[torch.Tensor, ...], ce_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ids, top_ids, top_logp, keep = batch
    # bf16 matmuls (AVX512-BF16) are ~1.5x faster here; the loss itself is float32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids).last_hidden_state[keep]  # (N, d) kept positions
        logits = model.lm_head(hidden)  # (N, V)
    return kd_loss(logits, top_ids[keep], top_logp[keep], ce_weight)


def prompt_lengths(sequences: list[Sequence], tokenizer: AutoTokenizer) -> list[int]:
    """For raw-completion HumanEval trajectories, the length of the prompt they continue
    (0 for every other sequence)."""
    prompts = [tokenizer(code).input_ids for code in humaneval_prompts("train")]
    lengths = []
    for s in sequences:
        head = s.ids.tolist()
        matches = [len(p) for p in prompts if head[: len(p)] == p]
        lengths.append(max(matches) if s.source.startswith("humaneval-completion") else 0)
    return lengths


def training_data(args: argparse.Namespace) -> tuple[list[Sequence], list[Sequence]]:
    """(train, valid). A few TRAIN-split trajectories are held back to monitor agreement on
    generated tokens; the HumanEval held-out split is not touched at all.

    A sampled completion shares its prompt with the greedy one, so its prompt positions are
    context only (the same labels twice would over-weight human-written docstrings, which
    the draft never has to predict at serving time). Trajectories are repeated
    ``traj_repeat`` times per epoch: they are the distribution the draft is used on.
    """
    rng = random.Random(args.seed)
    trajectories = load_sequences(CACHE / "trajectories.pt")
    stdlib = load_sequences(CACHE / "stdlib.pt")
    _, tokenizer = load_target()
    lengths = prompt_lengths(trajectories, tokenizer)
    for s, length in zip(trajectories, lengths, strict=True):
        if s.source == "humaneval-completion-t0.7":
            s.loss_start = length - 1
    greedy = [i for i, s in enumerate(trajectories) if s.source == "humaneval-completion-greedy"]
    heldback = set(rng.sample(greedy, k=max(4, len(greedy) // 20)))
    # Agreement on the generated part only, like acceptance at T = 0.
    valid = [replace(trajectories[i], loss_start=lengths[i] - 1) for i in sorted(heldback)]
    kept = [s for i, s in enumerate(trajectories) if i not in heldback]
    return kept * args.traj_repeat + stdlib, valid


def new_draft(shape: DraftShape) -> LlamaForCausalLM:
    target, _ = load_target()
    model = LlamaForCausalLM(draft_config(target.config, shape))
    with torch.no_grad():
        embedding = pca_embedding(target.model.embed_tokens.weight, shape.hidden_size)
        model.model.embed_tokens.weight.copy_(embedding)
    return model


def stage_train(args: argparse.Namespace) -> None:
    """Train, saving a resumable snapshot every ``--save-every`` steps."""
    torch.manual_seed(args.seed)
    train, valid = training_data(args)
    model = new_draft(DraftShape())
    rng = random.Random(args.seed)
    plan = [b for _ in range(args.epochs) for b in batches(train, args.batch_tokens, rng)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(len(plan), warmup=50))
    positions = sum(len(s.ids) - 1 - s.loss_start for s in train)
    print(f"train: {len(train)} sequences, {positions} labelled positions, {len(plan)} steps")
    snapshot_path, first_step = CACHE / "draft_train.partial.pt", 1
    if snapshot_path.is_file() and (snap := torch.load(snapshot_path))["plan"] == len(plan):
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        schedule.load_state_dict(snap["schedule"])
        first_step = snap["step"] + 1
        print(f"train: resuming at step {first_step}")
    started = time.perf_counter()
    for step in range(first_step, len(plan) + 1):
        model.train()
        batch = collate([train[i] for i in plan[step - 1]])
        loss, agree = train_step(model, batch, args.ce_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % args.save_every == 0 or step == len(plan):
            minutes = (time.perf_counter() - started) / 60
            print(
                f"step {step}/{len(plan)} loss {loss.item():.3f} agree {agree.item():.3f} "
                f"valid-agree {validate(model, valid):.3f} {minutes:.1f} min",
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
    torch.save(model.state_dict(), CACHE / "draft_fp32.pt")
    summary = {
        "sequences": len(train),
        "positions": positions,
        "steps": len(plan),
        "minutes_this_run": (time.perf_counter() - started) / 60,
        "valid_agree_generated": validate(model, valid),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (CACHE / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    snapshot_path.unlink(missing_ok=True)


def warmup_cosine(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


@torch.no_grad()
def validate(model: LlamaForCausalLM, valid: list[Sequence]) -> float:
    """Argmax agreement with the target on held-back TRAIN-split trajectories."""
    model.eval()
    agree = [train_step(model, collate([s]), 0.0)[1].item() for s in valid]
    return sum(agree) / max(1, len(agree))


def stage_export(args: argparse.Namespace) -> None:
    target, _ = load_target()
    model = LlamaForCausalLM(draft_config(target.config, DraftShape()))
    model.load_state_dict(torch.load(CACHE / "draft_fp32.pt"))
    model.generation_config.bos_token_id = target.generation_config.bos_token_id
    model.generation_config.eos_token_id = target.generation_config.eos_token_id
    model.generation_config.pad_token_id = target.generation_config.pad_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)  # bf16: half the committed bytes
    size = (args.out / "model.safetensors").stat().st_size
    print(f"exported {args.out} ({size / 1e6:.1f} MB)")


# ---------------------------------------------------------------- plumbing


def load_target() -> tuple[PreTrainedModel, AutoTokenizer]:
    path = target_dir()
    if not (path / "config.json").is_file():
        raise SystemExit(f"no target at {path}; run `python -m asymspec.backends.prepare` first")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def save_sequences(sequences: list[Sequence], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save([as_row(s) for s in sequences], tmp)
    tmp.rename(path)  # a cached stage output is complete or absent


def as_row(sequence: Sequence) -> dict[str, object]:
    """A Sequence as a dict, without dataclasses.asdict's deep copies of the tensors."""
    return {f.name: getattr(sequence, f.name) for f in fields(sequence)}


def load_sequences(path: Path) -> list[Sequence]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing; run the stage that makes it first")
    return [Sequence(**row) for row in torch.load(path)]


def report_progress(stage: str, done: int, total: int, made: list[Sequence], t0: float) -> None:
    tokens = sum(len(s.ids) for s in made)
    print(
        f"{stage}: {done}/{total} sequences, {tokens} tokens, {time.perf_counter() - t0:.0f} s",
        flush=True,
    )


STAGES = {
    "generate": stage_generate,
    "label": stage_label,
    "train": stage_train,
    "export": stage_export,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    parser.add_argument("--out", type=Path, default=COMMITTED_DRAFT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="use 1 on a busy machine")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--samples", type=int, default=1, help="T=0.7 samples per prompt")
    parser.add_argument("--gen-batch", type=int, default=48)
    parser.add_argument("--stdlib-tokens", type=int, default=100_000)
    parser.add_argument("--stdlib-length", type=int, default=256)
    parser.add_argument("--label-batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ce-weight", type=float, default=0.5)
    parser.add_argument("--traj-repeat", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in STAGES if args.stage == "all" else [args.stage]:
        started = time.perf_counter()
        STAGES[name](args)
        print(f"== stage {name} done in {(time.perf_counter() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
