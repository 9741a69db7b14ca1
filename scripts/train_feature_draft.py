"""Train the embedded feature draft (EAGLE-style) from the embedded target, on the CPU.

    python -m asymspec_engine.prepare --target-only          # once: the target in the cache
    python scripts/train_feature_draft.py --stage generate --shard 0/2 --threads 1 &
    python scripts/train_feature_draft.py --stage generate --shard 1/2 --threads 1
    python scripts/train_feature_draft.py --stage train --threads 2 --allow-partial
    python scripts/train_feature_draft.py --stage eval --threads 2
    python scripts/train_feature_draft.py --stage export

What a feature draft is: ``asymspec_engine.feature_draft``. Stages (cached under
``.cache/feature_draft/``, git-ignored):

1. ``generate``: the target writes continuations of TRAIN-split prompts (the same jobs and
   batches as ``distill_draft.py``'s plan: everyday chat, code, prose; greedy and sampled)
   on the serving engine and keeps, per sequence, the token ids and its own feature ``h_s``
   (the last hidden state after the final norm) of every position it fed, prompt included.
   Resumable, sharded, one file per batch, in a seeded order.
2. ``train``: the draft layer learns to predict ``h_s`` from ``[embed(x_s), h_{s-1}]``:
   a smooth-L1 regression on the feature plus the cross-entropy of its head's q against the
   target's own p (both through the target's head, restricted to ``head_vocab.json``). As
   served, only the first draft step of a block sees a target feature; later steps read the
   draft's own ĥ. So each batch runs ``--passes`` unrolled passes (EAGLE-3's "training-time
   test"): pass j at position s reads pass j-1's ĥ_{s-1} and attends to pass 1's keys up
   to the block's start s-j+1 and to passes 2..j at the positions after it, exactly what
   draft step j of a block starting at s-j+1 sees at serving time.
3. ``eval``: T = 0 accepted tokens per γ block on held-out chat and HumanEval prompts,
   teacher-forced on the target's greedy continuations with the same unrolled passes (at
   T = 0 a block accepts the leading run of draft steps whose argmax is the target's
   token); ``make bench`` with the draft served measures the real loop.
4. ``export``: the layer in bf16 without the embedding (``make models`` takes the target's)
   and the fc into ``models/smollm2-feature-draft/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import distill_draft  # this folder: scripts run as files
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer, LlamaConfig

from asymspec_engine.embedded import REPO_ROOT
from asymspec_engine.feature_draft import save_fc
from asymspec_engine.head_vocab import read_head_vocab, write_head_vocab
from asymspec_engine.llama import LlamaEngine
from loadtest.instructions import instructions
from loadtest.prompts import humaneval_prompts, render_prompt

CACHE = REPO_ROOT / ".cache" / "feature_draft"
GENERATED = CACHE / "generated"
OUT_DIR = REPO_ROOT / "models" / "smollm2-feature-draft"
TOKEN_DRAFT_DIR = REPO_ROOT / "models" / "smollm2-draft"  # its head_vocab.json is reused
VALID_EVERY = 25  # every 25th greedy sequence (by its place in the data) is validation


@dataclass
class Sequence:
    ids: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L - 1, hidden] bf16: h_0 .. h_{L-2}
    start: int  # the prompt's last position: generated tokens are ids[start + 1:]
    source: str


# ---------------------------------------------------------------- generation


@torch.inference_mode()
def generate_batch(
    engine: LlamaEngine,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_id: int,
    sampler: str,
) -> list[tuple[list[int], torch.Tensor]]:
    """Continue the prompts (ragged, one forward per step); per row the new tokens and the
    features of every position fed (the prompt's and each generated token's but the last)."""
    sessions = [f"gen{row}" for row in range(len(prompts))]
    for session in sessions:
        engine.open(session, [])
    pending = [list(p) for p in prompts]
    live = list(range(len(prompts)))
    tokens: list[list[int]] = [[] for _ in prompts]
    features: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        for step in range(max_new_tokens):
            counts = [len(pending[r]) for r in live]
            logits, feats = engine.forward_features(
                [(sessions[r], pending[r]) for r in live], [1] * len(live), counts
            )
            rows = torch.cat(logits)  # [b, V]
            if temperature == 0.0:
                drawn = rows.argmax(-1)
            else:
                probs = torch.softmax(rows / temperature, -1)
                drawn = distill_draft.SAMPLERS[sampler](probs, generator)
            for i, row in enumerate(live):
                features[row].append(feats[i])
                tokens[row].append(int(drawn[i]))
                pending[row] = [int(drawn[i])]
            live = [row for i, row in enumerate(live) if int(drawn[i]) != eos_id]
            if step == max_new_tokens - 1 or not live:
                break
    finally:
        for session in sessions:
            engine.close(session)
    return [(tokens[r], torch.cat(features[r])) for r in range(len(prompts))]


def plan_and_jobs(tokenizer: AutoTokenizer) -> tuple[list[distill_draft.Job], list[list[int]]]:
    """distill_draft.py's jobs and batches with its default options (the v2 plan)."""
    options = distill_draft.build_parser().parse_args([])
    jobs = distill_draft.training_jobs(tokenizer, options)
    return jobs, distill_draft.generation_plan(jobs, tokenizer)


def generated_dir(jobs: list[distill_draft.Job], plan: list[list[int]], seed: int) -> Path:
    defined_by = [seed, [j.__dict__ for j in jobs], plan, distill_draft.DEFAULT_SAMPLER]
    return GENERATED / hashlib.sha256(json.dumps(defined_by).encode()).hexdigest()[:12]


def stage_generate(args: argparse.Namespace) -> None:
    model, tokenizer = distill_draft.load_target(torch.bfloat16)
    engine = LlamaEngine(model)
    jobs, plan = plan_and_jobs(tokenizer)
    shard, shards = (int(part) for part in args.shard.split("/"))
    mine = [n for n in range(len(plan)) if n % shards == shard]
    random.Random(args.seed).shuffle(mine)  # whatever is done is a fair sample of the plan
    folder = generated_dir(jobs, plan, args.seed)
    folder.mkdir(parents=True, exist_ok=True)
    started, made = time.perf_counter(), 0
    for number in mine:
        path = folder / f"batch_{number:05d}.pt"
        if path.exists():
            continue
        part = [jobs[i] for i in plan[number]]
        prompts = [tokenizer(job.text).input_ids for job in part]
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + number)
        outputs = generate_batch(
            engine,
            prompts,
            part[0].max_new_tokens,
            part[0].temperature,
            generator,
            tokenizer.eos_token_id,
            distill_draft.DEFAULT_SAMPLER,
        )
        rows = [
            {
                "ids": torch.tensor(prompt + new, dtype=torch.int32),
                "features": feats.to(torch.bfloat16).clone(),
                "start": len(prompt) - 1,
                "source": job.source,
            }
            for job, prompt, (new, feats) in zip(part, prompts, outputs, strict=True)
        ]
        tmp = path.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.rename(path)  # a batch file is complete or absent
        made += sum(len(new) for new, _ in outputs)
        elapsed = time.perf_counter() - started
        print(
            f"generate shard {args.shard}: batch {number} ({len(plan)} in all), "
            f"{made} new tokens in {elapsed:.0f} s ({made / elapsed:.1f}/s)",
            flush=True,
        )


# ---------------------------------------------------------------- the draft layer


class FeatureDraftNet(nn.Module):
    """The draft layer for training: the arithmetic of ``LlamaEngine`` on a one-layer Llama
    (the parameter names are transformers', so export is a rename), with unrolled passes."""

    embed: torch.Tensor  # buffers, registered in __init__
    head: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(
        self, config: LlamaConfig, embed: torch.Tensor, head: torch.Tensor, norm: torch.Tensor
    ) -> None:
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = h // self.heads
        self.eps = config.rms_norm_eps
        self.register_buffer("embed", embed, persistent=False)  # [V, h] the target's, frozen
        self.register_buffer("head", head, persistent=False)  # [H, h] its restricted rows
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = nn.Parameter(norm.clone().float())
        theta = float(cast(float, (config.rope_parameters or {})["rope_theta"]))
        dims = torch.arange(0, self.head_dim, 2).float() / self.head_dim
        self.register_buffer("inv_freq", 1.0 / theta**dims, persistent=False)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(positions.float(), self.inv_freq)  # [L, D/2]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, prev: torch.Tensor, passes: int) -> list[torch.Tensor]:
        """ids [B, L]; prev [B, L, h] = h_{s-1} (zeros at s = 0). Per pass the output ĥ."""
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device)
        embedded = self.embed[ids].to(prev.dtype)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for j in range(1, passes + 1):
            feature_in = prev if j == 1 else F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            x = self.fc(torch.cat([embedded, feature_in.to(embedded.dtype)], -1))
            normed = self.rms(x, self.input_layernorm)
            q = self.q_proj(normed).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(normed).view(batch, length, self.kv_heads, -1).transpose(1, 2)
            v = self.v_proj(normed).view(batch, length, self.kv_heads, -1).transpose(1, 2)
            q, k = self.rope(q, positions), self.rope(k, positions)
            keys.append(k)
            values.append(v)
            mask = unrolled_mask(length, j, ids.device)  # [L, j L]
            attn = F.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
            )
            x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))
            mlp_in = self.rms(x, self.post_attention_layernorm)
            x = x + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
            outs.append(self.rms(x, self.norm))
        return outs


def unrolled_mask(length: int, j: int, device: torch.device) -> torch.Tensor:
    """[L, j L] bool: pass j's query at s sees pass 1's keys up to its block's start
    s - j + 1 and pass p's key at s - (j - p) for p = 2 .. j (draft step j of that block)."""
    s = torch.arange(length, device=device)[:, None]
    t = torch.arange(length, device=device)[None]
    parts = [t <= (s - j + 1).clamp(min=0)]
    parts += [t == s - (j - p) for p in range(2, j + 1)]
    return torch.cat(parts, dim=1)


# ---------------------------------------------------------------- training


def load_sequences(folder: Path) -> list[Sequence]:
    return [
        Sequence(row["ids"].long(), row["features"], int(row["start"]), row["source"])
        for path in sorted(folder.glob("batch_*.pt"))
        for row in torch.load(path)
    ]


def split(sequences: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """(train, valid): every VALID_EVERY-th greedy sequence is held back, by its place."""
    train, valid = [], []
    greedy = 0
    for s in sequences:
        if s.source.endswith("greedy"):
            greedy += 1
            if greedy % VALID_EVERY == 0:
                valid.append(s)
                continue
        train.append(s)
    return train, valid


def batches(
    sequences: list[Sequence], batch_tokens: int, rng: random.Random
) -> list[list[Sequence]]:
    """Sequences of similar length together (little padding), in a shuffled order."""
    order = sorted(sequences, key=lambda s: len(s.ids))
    out: list[list[Sequence]] = [[]]
    for s in order:
        width = max([len(s.ids), *(len(x.ids) for x in out[-1])])
        if out[-1] and width * (len(out[-1]) + 1) > batch_tokens:
            out.append([])
        out[-1].append(s)
    rng.shuffle(out)
    return out


def collate(part: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L-1] (inputs x_0 .. x_{L-2}), prev [B, L-1, h], goal [B, L-1, h] (h_s),
    valid [B, L-1] (real positions). Right-padded: causality keeps pads out of real rows."""
    width = max(len(s.ids) for s in part) - 1
    hidden = part[0].features.shape[1]
    ids = torch.zeros((len(part), width), dtype=torch.long)
    prev = torch.zeros((len(part), width, hidden), dtype=torch.bfloat16)
    goal = torch.zeros((len(part), width, hidden), dtype=torch.bfloat16)
    valid = torch.zeros((len(part), width), dtype=torch.bool)
    for b, s in enumerate(part):
        n = len(s.ids) - 1
        ids[b, :n] = s.ids[:n]
        prev[b, 1:n] = s.features[: n - 1]
        goal[b, :n] = s.features
        valid[b, :n] = True
    return ids, prev, goal, valid


def pass_losses(
    net: FeatureDraftNet,
    outs: list[torch.Tensor],
    goal: torch.Tensor,
    valid: torch.Tensor,
    cls_weight: float,
    cls_share: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Σ_j 0.8^(j-1) (smooth-L1(ĥ, h) + w·CE(p, q)) over each pass's real positions; and
    per pass the share of positions whose argmax agrees with the target's.

    The CE goes through the 16k-row head, which costs about twice the draft layer itself:
    ``cls_share`` < 1 scores a random share of the positions (the same for every pass), an
    unbiased estimate of the mean at that fraction of the head's cost."""
    pick = valid.clone()
    if cls_share < 1.0:
        pick &= torch.rand(valid.shape, generator=generator) < cls_share
    p = torch.softmax((goal[pick] @ net.head.T).float(), -1)  # [N, H] the target's own p
    target_top = p.argmax(-1)
    total = torch.zeros(())
    agree = []
    for j, out in enumerate(outs, start=1):
        rows = valid.clone()
        rows[:, : j - 1] = False  # no block starts before position 0
        reg = F.smooth_l1_loss(out[rows].float(), goal[rows].float())
        scored = pick.clone()
        scored[:, : j - 1] = False
        among = scored[pick]  # which of the N picked rows this pass scores
        logq = torch.log_softmax((out[scored] @ net.head.T).float(), -1)
        cls = -(p[among] * logq).sum(-1).mean()
        total = total + 0.8 ** (j - 1) * (reg + cls_weight * cls)
        agree.append(float((logq.argmax(-1) == target_top[among]).float().mean()))
    return total, agree


def new_net(target, head_ids: list[int], init: str = "last") -> FeatureDraftNet:
    """The draft layer, initialised from the target's last layer (fc passes h_{s-1} on) or
    at random (``init="random"``, as EAGLE does)."""
    config = target.config
    embed = target.model.embed_tokens.weight.detach().float()
    net = FeatureDraftNet(config, embed, embed[head_ids].clone(), target.model.norm.weight)
    if init == "random":
        return net
    last = target.model.layers[-1]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(net, name).weight.copy_(getattr(last.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(net, name).weight.copy_(getattr(last.mlp, name).weight)
        net.input_layernorm.copy_(last.input_layernorm.weight)
        net.post_attention_layernorm.copy_(last.post_attention_layernorm.weight)
        hidden = config.hidden_size
        net.fc.weight.zero_()
        net.fc.weight[:, :hidden].copy_(torch.eye(hidden))  # starts as the token's embedding
        net.fc.weight[:, hidden:].copy_(torch.eye(hidden) * 0.5)
    return net


def warmup_cosine(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def stage_train(args: argparse.Namespace) -> None:
    target, tokenizer = distill_draft.load_target(torch.float32)
    jobs, plan = plan_and_jobs(tokenizer)
    folder = generated_dir(jobs, plan, args.seed)
    sequences = load_sequences(folder)
    done = len(list(folder.glob("batch_*.pt")))
    if done < len(plan) and not args.allow_partial:
        raise SystemExit(f"{done} of {len(plan)} batches generated; --allow-partial to train")
    train, valid = split(sequences)
    tokens = sum(len(s.ids) for s in train)
    print(f"train: {done} batches, {len(train)} sequences ({tokens} tokens), {len(valid)} valid")
    head_ids = read_head_vocab(TOKEN_DRAFT_DIR)
    assert head_ids is not None
    net = (
        new_net(target, head_ids, args.init_from)
        if args.init is None
        else load_net(target, args.init)
    )
    rng = random.Random(args.seed)
    cls_rng = torch.Generator().manual_seed(args.seed)
    plan_batches = [b for _ in range(args.epochs) for b in batches(train, args.batch_tokens, rng)]
    if args.max_steps:
        plan_batches = plan_batches[: args.max_steps]
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(len(plan_batches), min(100, len(plan_batches) // 10 + 1))
    )
    run_dir = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log: list[dict[str, object]] = []
    for step, part in enumerate(plan_batches, start=1):
        ids, prev, goal, valid_rows = collate(part)
        net.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            outs = net(ids, prev, args.passes)
            loss, agree = pass_losses(
                net, outs, goal, valid_rows, args.cls_weight, args.cls_share, cls_rng
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % 10 == 0 or step == len(plan_batches):
            elapsed = time.perf_counter() - started
            print(
                f"step {step}/{len(plan_batches)} loss {float(loss.detach()):.4f} agree "
                + " ".join(f"{a:.3f}" for a in agree)
                + f" ({elapsed / step:.2f} s/step)",
                flush=True,
            )
        if step % args.save_every == 0 or step == len(plan_batches):
            torch.save(net.state_dict(), run_dir / "net.pt")
            row: dict[str, object] = {"step": step}
            row["minutes"] = round((time.perf_counter() - started) / 60, 1)
            row.update(validate(net, valid[: args.valid_sequences], args.gamma))
            log.append(row)
            print("valid", row, flush=True)
            (run_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def load_net(target, path: Path) -> FeatureDraftNet:
    head_ids = read_head_vocab(TOKEN_DRAFT_DIR)
    assert head_ids is not None
    net = new_net(target, head_ids)
    net.load_state_dict(torch.load(path / "net.pt"))
    return net


# ---------------------------------------------------------------- evaluation


def greedy_accepted(matches: list[list[bool]], first: int, end: int, gamma: int) -> list[int]:
    """Accepted per block of a T = 0 loop whose first block drafts position ``first`` on:
    matches[j-1][s] says draft step j of the block starting at s - j + 1 is the target's
    token (teacher-forced, so it counts only after steps 1 .. j-1 were right)."""
    accepted, start = [], first
    while start < end:
        n = 0
        while n < gamma and start + n < end and matches[n][start + n]:
            n += 1
        accepted.append(n)
        start += n + 1
    return accepted


@torch.no_grad()
def validate(net: FeatureDraftNet, sequences: list[Sequence], gamma: int) -> dict[str, object]:
    """Per draft step, the share of positions whose argmax is the target's, and accepted per
    γ block of a T = 0 loop over the generated part (teacher-forced, unrolled passes)."""
    net.eval()
    step_agree: list[list[bool]] = [[] for _ in range(gamma)]
    blocks: list[int] = []
    for s in sequences:
        ids, prev, goal, _valid_rows = collate([s])
        outs = net(ids, prev.float(), gamma)
        truth = (goal[0].float() @ net.head.T).argmax(-1)
        matches = [((o[0] @ net.head.T).argmax(-1) == truth).tolist() for o in outs]
        n = len(s.ids) - 1
        for j in range(gamma):
            step_agree[j] += matches[j][s.start + j : n]
        blocks += greedy_accepted(matches, s.start, n, gamma)
    return {
        "agree": [round(sum(a) / max(1, len(a)), 4) for a in step_agree],
        "accepted_per_block": round(sum(blocks) / max(1, len(blocks)), 3),
    }


def heldout_sequences(args: argparse.Namespace, which: str) -> list[Sequence]:
    """The target's greedy continuations (with features) of held-out prompts, cached."""
    path = CACHE / f"heldout_{which}_{args.eval_prompts}x{args.eval_tokens}.pt"
    if path.is_file():
        return [Sequence(**row) for row in torch.load(path)]
    target, tokenizer = distill_draft.load_target(torch.bfloat16)
    engine = LlamaEngine(target)
    if which == "chat":
        held = instructions("heldout")
        step = max(1, len(held) // args.eval_prompts)
        texts = [
            render_prompt([{"role": "user", "content": i.text}], "chat", tokenizer)
            for i in held[::step][: args.eval_prompts]
        ]
    else:
        texts = list(humaneval_prompts("heldout"))[: args.eval_prompts]
    prompts = [tokenizer(t).input_ids for t in texts]
    out = generate_batch(
        engine, prompts, args.eval_tokens, 0.0, torch.Generator(), tokenizer.eos_token_id, ""
    )
    sequences = [
        Sequence(torch.tensor(p + new), feats.to(torch.bfloat16), len(p) - 1, which)
        for p, (new, feats) in zip(prompts, out, strict=True)
    ]
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save([vars(seq) for seq in sequences], path)
    return sequences


def stage_eval(args: argparse.Namespace) -> None:
    target, _ = distill_draft.load_target(torch.float32)
    net = load_net(target, args.run_dir)
    result = {
        which: validate(net, heldout_sequences(args, which), args.gamma)
        for which in ("chat", "humaneval")
    }
    print(json.dumps(result, indent=1))


# ---------------------------------------------------------------- export


def stage_export(args: argparse.Namespace) -> None:
    """The committed folder: config.json (a one-layer Llama), model.safetensors (the layer
    and the final norm in bf16, no embedding: ``make models`` adds the target's), the fc,
    and head_vocab.json."""
    target, _ = distill_draft.load_target(torch.float32)
    net = load_net(target, args.run_dir)
    config = target.config.to_dict()
    config.update(num_hidden_layers=1, tie_word_embeddings=True)
    for key in ("_name_or_path", "transformers_version"):
        config.pop(key, None)
    prefix = "model.layers.0."
    renames = {
        "input_layernorm": prefix + "input_layernorm.weight",
        "post_attention_layernorm": prefix + "post_attention_layernorm.weight",
        "norm": "model.norm.weight",
    }
    tensors = {}
    for name, value in net.state_dict().items():
        if name == "fc.weight":
            continue
        if name in renames:
            key = renames[name]
        else:
            module = name.removesuffix(".weight")
            group = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            key = f"{prefix}{group}.{module}.weight"
        tensors[key] = value.to(torch.bfloat16).contiguous()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_fc(out, net.fc.weight.detach().to(torch.bfloat16))
    head_ids = read_head_vocab(TOKEN_DRAFT_DIR)
    assert head_ids is not None
    write_head_vocab(out, head_ids, {"source": "models/smollm2-draft/head_vocab.json"})
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"exported {out} ({size / 1e6:.1f} MB of weights)")


STAGES = {
    "generate": stage_generate,
    "train": stage_train,
    "eval": stage_eval,
    "export": stage_export,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=list(STAGES), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="use 1 per generate shard")
    parser.add_argument("--shard", default="0/1", help="generate: this shard of N, 'k/N'")
    parser.add_argument("--allow-partial", action="store_true", help="train on what is there")
    parser.add_argument("--run-dir", type=Path, default=CACHE / "run")
    parser.add_argument("--init", type=Path, default=None, help="train: continue this run dir")
    parser.add_argument("--init-from", choices=["last", "random"], default="last")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, help="0: every batch")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--passes", type=int, default=4, help="unrolled draft steps")
    parser.add_argument("--cls-weight", type=float, default=1.0)
    parser.add_argument(
        "--cls-share", type=float, default=0.25, help="share of positions the CE scores"
    )
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--valid-sequences", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=20)
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    STAGES[args.stage](args)
    print(f"== stage {args.stage} done in {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
