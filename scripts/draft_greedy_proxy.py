"""Fast, exact T=0 acceptance of a draft checkpoint, for iterating on the draft.

    python scripts/draft_greedy_proxy.py --draft .cache/distill/export

At temperature 0 speculative decoding outputs the target's greedy continuation, and a
block starting at position s accepts the leading run of positions s, s+1, ... (at most
gamma) where the draft's argmax, given the target's own prefix, equals the target's token.
So once the target's greedy continuations of the held-out prompts are known (generated
once, batched, and cached under .cache/measure/), any draft is scored with one
teacher-forced forward per prompt: seconds instead of minutes. ``measure_draft.py`` is
the authoritative measurement (a real speculative loop, and T=0.7).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from asymspec_engine.embedded import EMBEDDED_TARGET, REPO_ROOT, embedded_path
from asymspec.prompts import humaneval_prompts

CACHE = REPO_ROOT / ".cache" / "measure"


@torch.inference_mode()
def target_greedy(target_path: Path, n_new: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation) for every held-out prompt, cached."""
    path = CACHE / f"heldout_greedy_{n_new}.pt"
    if path.is_file():
        return torch.load(path)
    tokenizer = AutoTokenizer.from_pretrained(target_path, padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    prompts = humaneval_prompts("heldout")
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    # Batched (left-padded) greedy can differ from batch-1 greedy at rare near-ties: this
    # is a proxy for iterating, measure_draft.py runs the real loop.
    out = target.generate(**batch, max_new_tokens=n_new, do_sample=False)
    width = batch.input_ids.shape[1]
    pairs = [
        (tokenizer(p).input_ids, until_eos(out[i, width:].tolist(), tokenizer.eos_token_id))
        for i, p in enumerate(prompts)
    ]
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(pairs, path)
    return pairs


def until_eos(tokens: list[int], eos_id: int) -> list[int]:
    """A finished row is padded after its EOS; the loop would have stopped there."""
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def greedy_blocks(matches: list[bool], gamma: int, n_tokens: int) -> list[int]:
    """Accepted draft tokens per block; matches[j]: draft argmax == target token j."""
    accepted, position = [], 0
    while position < n_tokens:
        run = 0
        while run < gamma and position + run < len(matches) and matches[position + run]:
            run += 1
        accepted.append(run)
        position += run + 1  # the accepted tokens, then the correction or bonus token
    return accepted


@torch.inference_mode()
def draft_matches(draft: PreTrainedModel, prompt: list[int], continuation: list[int]) -> list[bool]:
    ids = torch.tensor([prompt + continuation[:-1]])
    predicted = draft(input_ids=ids).logits[0, len(prompt) - 1 :].argmax(-1)
    return (predicted == torch.tensor(continuation)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pairs = target_greedy(embedded_path(EMBEDDED_TARGET), args.max_new_tokens + args.gamma + 1)
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    blocks: list[int] = []
    agree = total = 0
    for prompt, continuation in pairs:
        matches = draft_matches(draft, prompt, continuation)
        blocks += greedy_blocks(matches, args.gamma, min(args.max_new_tokens, len(matches)))
        agree, total = agree + sum(matches), total + len(matches)
    per_position = [sum(b > i for b in blocks) / len(blocks) for i in range(args.gamma)]
    print(
        json.dumps(
            {
                "prompts": len(pairs),
                "blocks": len(blocks),
                "mean_accepted_per_block": sum(blocks) / len(blocks),
                "accepted_per_position": per_position,
                "token_agreement": agree / total,
            }
        )
    )


if __name__ == "__main__":
    main()
