"""The chunked log-prob and entropy kernels against values worked out by hand and against autograd of a
plain log-softmax."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from profiling.activations import head_chunk_positions
from trainer.model.logprobs import entropy_from_logits, head_logprobs, shift_for_next_token, token_logprobs

LN2 = math.log(2.0)
# softmax of these logits is (1/4, 1/2, 1/4): log-probs -2 ln2, -ln2, -2 ln2.
QUARTER_HALF_QUARTER = [0.0, LN2, 0.0]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def reference_logprobs(logits, labels):
    # fp32 at least, fp64 kept: an fp32 reference cannot be held to fp64 tolerances.
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != -100, picked, 0.0)


def random_case(dtype=torch.float32, batch=3, time=5, vocab=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, time, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    labels[0, :2] = -100
    labels[-1, -1] = -100
    return logits, labels


# ---------------------------------------------------------------- token_logprobs / entropy


def test_token_logprobs_matches_hand_computed_values_and_zero_on_ignored_labels():
    logits = t([[QUARTER_HALF_QUARTER, QUARTER_HALF_QUARTER, QUARTER_HALF_QUARTER]])
    labels = torch.tensor([[1, 0, -100]])
    assert_close(token_logprobs(logits, labels), t([[-LN2, -2 * LN2, 0.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equals_log_softmax_gather_on_random_logits(dtype):
    logits, labels = random_case(dtype)
    out = token_logprobs(logits, labels, chunk_size=4)
    assert out.dtype == torch.float32
    assert_close(out, reference_logprobs(logits, labels))


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 7, 10, 1000])
def test_token_logprobs_chunked_equals_unchunked(chunk_size):
    logits, labels = random_case()
    assert_close(token_logprobs(logits, labels, chunk_size), token_logprobs(logits, labels, 10**6), rtol=0, atol=0)


def test_token_logprobs_gradient_matches_autograd_of_log_softmax_on_shifted_logits():
    logits, labels = random_case(torch.float64)
    weights = torch.randn(labels.shape[0], labels.shape[1] - 1, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))  # not the global RNG: order-free
    mine = logits.clone().requires_grad_(True)
    ref = logits.clone().requires_grad_(True)
    shifted_logits, shifted_labels = shift_for_next_token(mine, labels)
    (token_logprobs(shifted_logits, shifted_labels, chunk_size=3) * weights).sum().backward()
    ref_logits, ref_labels = shift_for_next_token(ref, labels)
    (reference_logprobs(ref_logits.double(), ref_labels).double() * weights).sum().backward()
    assert_close(mine.grad, ref.grad)
    assert torch.all(mine.grad[:, -1] == 0)  # the last position predicts nothing after a shift


def test_token_logprobs_passes_gradcheck_in_float64():
    logits, labels = random_case(torch.float64, batch=2, time=3, vocab=5)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, chunk_size=2), (logits,))


def test_token_logprobs_gradient_keeps_bf16_dtype():
    logits, labels = random_case(torch.bfloat16)
    logits.requires_grad_(True)
    token_logprobs(logits, labels, chunk_size=4).sum().backward()
    assert logits.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- head_logprobs: the output layer, chunked


def head_case(dtype=torch.float64, n=7, hidden=4, vocab=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[2] = -100
    return h, w, b, labels


def test_head_logprobs_matches_hand_computed_values_and_zero_on_ignored_labels():
    # hidden (1, 0) through rows (0, ln2, 0) of the weight: the logits QUARTER_HALF_QUARTER of the tests above.
    hidden = t([[1.0, 0.0], [1.0, 0.0]])
    weight = t([[0.0, 5.0], [LN2, 5.0], [0.0, 5.0]])
    assert_close(head_logprobs(hidden, weight, None, torch.tensor([1, -100])), t([-LN2, 0.0]))
    # a bias of (0, -ln2, 0) evens the logits out: 1/3 each
    assert_close(head_logprobs(hidden, weight, t([0.0, -LN2, 0.0]), torch.tensor([2, 0])), t([-math.log(3)] * 2))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_head_logprobs_equals_token_logprobs_of_the_full_logits_in_value_and_in_every_gradient(chunk):
    h, w, b, labels = head_case()
    weights = torch.randn(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = [x.clone().requires_grad_(True) for x in (h, w, b)]
    ref = [x.clone().requires_grad_(True) for x in (h, w, b)]
    out = head_logprobs(*mine, labels, chunk=chunk)
    expected = reference_logprobs(torch.nn.functional.linear(*ref).unsqueeze(0), labels.unsqueeze(0)).squeeze(0)
    assert_close(out, expected.double())
    (out * weights).sum().backward()
    (expected.double() * weights).sum().backward()
    for got, want in zip(mine, ref):
        assert_close(got.grad, want.grad)


def test_head_logprobs_passes_gradcheck_in_float64_and_leaves_a_frozen_weight_without_gradient():
    h, w, b, labels = head_case(n=5, hidden=3, vocab=4)
    h.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, y: head_logprobs(x, y, b, labels, chunk=2), (h, w))
    frozen = w.detach()
    head_logprobs(h, frozen, None, labels, chunk=2).sum().backward()
    assert frozen.grad is None and h.grad is not None


def test_head_logprobs_in_bf16_returns_fp32_log_probs_and_a_bf16_gradient():
    h, w, b, labels = head_case(torch.bfloat16)
    h.requires_grad_(True)
    out = head_logprobs(h, w, None, labels, chunk=3)
    assert out.dtype == torch.float32
    assert_close(out, reference_logprobs(torch.nn.functional.linear(h.float(), w.float()).unsqueeze(0),
                                         labels.unsqueeze(0)).squeeze(0), atol=0.1, rtol=0.05)
    out.sum().backward()
    assert h.grad.dtype == torch.bfloat16


def test_head_chunks_are_2_to_the_24_logits_whatever_the_vocabulary():
    assert head_chunk_positions(49152) == 341 and head_chunk_positions(32000) == 524
    assert head_chunk_positions(2 ** 25) == 1
    with pytest.raises(ValueError, match="head_logprobs takes"):
        head_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), None, torch.zeros(3))


def test_shift_for_next_token_pairs_position_t_with_label_t_plus_one_without_copy():
    logits = torch.arange(24.0).view(1, 4, 6)
    labels = torch.tensor([[10, 11, 12, 13]])
    shifted_logits, shifted_labels = shift_for_next_token(logits, labels)
    assert shifted_logits.shape == (1, 3, 6) and shifted_labels.tolist() == [[11, 12, 13]]
    assert shifted_logits.data_ptr() == logits.data_ptr()


def test_entropy_from_logits_matches_hand_computed_entropies():
    logits = t([[[0.0, 0.0, 0.0, 0.0], QUARTER_HALF_QUARTER + [-1e4]]])
    # uniform over 4: ln 4; (1/4, 1/2, 1/4, ~0): -(2 * 1/4 ln 1/4 + 1/2 ln 1/2) = 1.5 ln 2
    assert_close(entropy_from_logits(logits), t([[2 * LN2, 1.5 * LN2]]))


def test_entropy_from_logits_chunked_values_and_gradient_match_autograd_reference():
    logits, _ = random_case(torch.float64)
    mine = logits.clone().requires_grad_(True)
    ref = logits.clone().requires_grad_(True)
    weights = torch.randn(logits.shape[:2], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ent = entropy_from_logits(mine, chunk_size=2)
    ref_logp = torch.log_softmax(ref, dim=-1)
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    assert_close(ent, ref_ent)
    assert_close(entropy_from_logits(logits, chunk_size=10**6), ent.detach(), rtol=0, atol=0)
    (ent * weights).sum().backward()
    (ref_ent * weights).sum().backward()
    assert_close(mine.grad, ref.grad)


def test_bf16_logits_at_a_temperature_give_the_chunked_head_s_log_probs():
    """Sampling's log-probs (bf16 logits of the decode step) and the update's (the chunked head) are taken at
    the sampling temperature from the same bf16 logits: upcast first, then divided, on both sides. Dividing
    the bf16 logits before the upcast rounds them again (up to 0.19 nats per token at T 0.7 in SmolLM2)."""
    from trainer.rl.scoring import next_token_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(64, 32).to(torch.bfloat16)
    weight = (torch.randn(500, 32) * 2).to(torch.bfloat16)
    labels = torch.randint(0, 500, (64,))
    logits = F.linear(hidden, weight)  # bf16, as a bf16 model's head gives them
    for temperature in (0.7, 1.3):
        head, head_entropy = head_logprobs(hidden, weight, None, labels, temperature=temperature, with_entropy=True)
        sampled, entropy = next_token_logprobs(logits[None], labels[None], temperature, with_entropy=True)
        assert_close(sampled[0], head, rtol=0, atol=1e-5)
        assert_close(entropy[0], head_entropy, rtol=0, atol=1e-5)
