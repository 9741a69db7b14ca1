"""The draft's distillation (scripts/distill_draft.py): its samplers draw from the target's
distribution, batch files are found whichever sampler wrote them, and the loss over a
restricted head is the KL of the coarser partition."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from asymspec.sampling import sample_rows
from asymspec_engine.embedded import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import distill_draft
from distill_draft import Head, Job, deepen, kd_loss
from transformers import LlamaConfig, LlamaForCausalLM


def test_the_inverse_cdf_sampler_is_the_products_draw() -> None:
    probs = torch.softmax(torch.randn(8, 50, generator=torch.Generator().manual_seed(1)), -1)
    drawn = distill_draft.sample_inverse_cdf(probs, torch.Generator().manual_seed(7))
    uniforms = torch.rand(8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert drawn.tolist() == sample_rows(probs, uniforms.tolist())


def test_the_blocked_cdf_lands_where_the_sequential_cdf_does() -> None:
    """Rows spanning many 256-token blocks, some with no mass: the two-level search picks
    the token the one-level inverse CDF picks for the same uniform."""
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(2)) * 3
    logits[:, 256:512] = float("-inf")  # a whole block without mass
    logits[:, 990:] = float("-inf")  # and a row end without mass
    probs = torch.softmax(logits, -1)
    drawn = distill_draft.sample_blocked_cdf(probs, torch.Generator().manual_seed(7))
    uniforms = torch.rand(64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert drawn.tolist() == sample_rows(probs, uniforms.tolist())
    assert bool((probs.gather(1, drawn[:, None]) > 0).all())


def test_the_blocked_cdf_takes_the_last_token_with_mass_at_the_very_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A uniform of 1.0 puts the goal at the total, past every block with mass: the draw
    still lands on a token with mass, the row's last, as the sequential draw does."""
    probs = torch.zeros(1, 600)  # blocks 0..255, 256..511 and 512..767 (512.. empty)
    probs[0, [10, 300]] = torch.tensor([0.25, 0.75])
    monkeypatch.setattr(torch, "rand", lambda *_, **__: torch.ones(1, dtype=torch.float64))
    drawn = distill_draft.sample_blocked_cdf(probs, torch.Generator())
    assert drawn.tolist() == [300] == sample_rows(probs, [1.0])


@pytest.mark.parametrize("sampler", sorted(distill_draft.SAMPLERS))
def test_each_sampler_draws_the_rows_distribution(sampler: str) -> None:
    """Seeded: 20,000 draws of a 4-token row land within 4 sigma of p."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    generator = torch.Generator().manual_seed(3)
    draws = torch.cat(
        [distill_draft.SAMPLERS[sampler](p.expand(100, 4), generator) for _ in range(200)]
    )
    share = torch.bincount(draws, minlength=4).double() / len(draws)
    sigma = (p * (1 - p) / len(draws)).sqrt()
    assert ((share - p).abs() < 4 * sigma).all(), share


def test_batch_files_come_from_any_samplers_folder_the_default_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(distill_draft, "GENERATED", tmp_path)
    jobs = [Job(source="instruct-0", text="text", temperature=0.7, max_new_tokens=8)]
    plan = [[0], [0], [0]]
    folders = {s: distill_draft.generated_dir(jobs, plan, 0, s) for s in distill_draft.SAMPLERS}
    assert len(set(folders.values())) == len(folders)  # each sampler's data apart
    for sampler, numbers in (("multinomial", [0, 1]), (distill_draft.DEFAULT_SAMPLER, [1, 2])):
        folders[sampler].mkdir(parents=True)
        for n in numbers:
            (folders[sampler] / f"batch_{n:05d}.pt").touch()
    found = distill_draft.batch_files(jobs, plan, 0)
    assert sorted(found) == [0, 1, 2]
    assert found[0].parent == folders["multinomial"]
    assert found[1].parent == folders[distill_draft.DEFAULT_SAMPLER]


def test_restricted_head_loss_by_hand() -> None:
    """V = 6, head {0, 1, 2, 3}; p's top-2 is token 1 (0.6) and token 4 (0.3, outside the
    head), so p's bucket holds 0.4 and q's everything but q(1)."""
    head = Head(6, [3, 0, 2, 1])
    logits = torch.tensor([[0.0, 1.0, -1.0, 0.5]])  # over head columns = tokens 0..3
    q = torch.softmax(logits[0], -1)
    top_ids = torch.tensor([[1, 4]], dtype=torch.int32)
    top_logp = torch.tensor([[math.log(0.6), math.log(0.3)]])
    losses, agree = kd_loss(logits, top_ids, top_logp, 0.5, head)
    q1 = float(q[1])
    kl = 0.6 * math.log(0.6 / q1) + 0.4 * math.log(0.4 / (1 - q1))
    assert float(losses[0]) == pytest.approx(kl + 0.5 * -math.log(q1), rel=1e-5)
    assert agree.tolist() == [1.0]


def test_a_head_of_every_token_is_the_full_head() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 20, generator=generator)
    top = torch.log_softmax(torch.randn(7, 20, generator=generator), -1).topk(4)
    args = (logits, top.indices.to(torch.int32), top.values, 0.5)
    full = kd_loss(*args, Head(20, None))
    every = kd_loss(*args, Head(20, list(range(20))))
    assert torch.allclose(full[0], every[0]) and torch.equal(full[1], every[1])
    assert bool((full[0] >= 0).all())


def test_the_argmax_outside_the_head_adds_no_cross_entropy() -> None:
    head = Head(6, [0, 1])
    logits = torch.tensor([[2.0, 0.0]])
    top_ids = torch.tensor([[5, 0]], dtype=torch.int32)
    top_logp = torch.tensor([[math.log(0.7), math.log(0.2)]])
    with_ce = kd_loss(logits, top_ids, top_logp, 1.0, head)[0]
    without = kd_loss(logits, top_ids, top_logp, 0.0, head)[0]
    assert torch.equal(with_ce, without)


def test_a_deepened_draft_computes_the_same_function_and_learns_in_its_new_layers() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    grown = deepen(model, 3).eval()
    assert grown.config.num_hidden_layers == 3 and model.config.num_hidden_layers == 2
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, grown(input_ids=ids).logits, atol=1e-5)
    grown(input_ids=ids).logits.sum().backward()
    fresh = [layer for layer in grown.model.layers if not layer.mlp.down_proj.weight.any()]
    assert len(fresh) == 1
    assert fresh[0].mlp.down_proj.weight.grad is not None
    assert bool(fresh[0].mlp.down_proj.weight.grad.any())
