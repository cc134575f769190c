"""Tensor-walk byte counts: every component equals a count made directly from the tensors."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from conftest import saved_head

from foundation.settings import ModelArguments
from profiling import components as C
from profiling.shapes import nf4_bytes
from profiling.tensors import count_tensors, quant_state_tensors
from trainer.model.shared_base import AdapterSpec, build_shared_model

VOCAB = 512


def tiny_ppo(quantization: str, **kw):
    import tempfile

    args = ModelArguments(model_name_or_path="tiny-llama", quantization=quantization, gradient_checkpointing=False,
                          lora_r=4, lora_alpha=8, **kw)
    with tempfile.TemporaryDirectory() as reward_head:
        specs = [AdapterSpec("policy", trainable=True), AdapterSpec("reference"),
                 AdapterSpec("value", trainable=True, head=True),
                 AdapterSpec("reward", head=True, head_from=saved_head(Path(reward_head), 64))]
        return build_shared_model(args, specs, vocab_size=VOCAB)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def direct_count(model) -> dict[str, int]:
    """Components from parameter names alone: an independent rule from the walker's module-type one."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():  # shared (tied) parameters come once
        parts = name.split(".")
        if any(s.startswith("lora_") for s in parts):
            key = C.adapter(parts[[s.startswith("lora_") for s in parts].index(True) + 1])
        elif parts[0] == "heads":
            key = C.head(parts[1])
        elif name.endswith("base_layer.weight"):
            key = C.BASE_WEIGHTS
        else:
            key = C.BASE_OTHER
        out[key] = out.get(key, 0) + nbytes(p)
    out[C.BASE_OTHER] += sum(nbytes(b) for b in model.buffers())
    return out


def test_walk_equals_parameter_count_times_element_size_fp32():
    model = tiny_ppo("none")
    counted = count_tensors(model).components()
    assert counted == direct_count(model)
    # tiny-llama: 2 layers of q,k,v,o (64x64, 32x64, 32x64, 64x64) + gate, up, down (172x64) in fp32
    assert counted[C.BASE_WEIGHTS] == 2 * (64 * 64 * 2 + 32 * 64 * 2 + 172 * 64 * 3) * 4
    # one adapter: r=4 x (in + out) per target, fp32
    assert counted[C.adapter("reference")] == 2 * 4 * (128 + 96 + 96 + 128 + 236 * 3) * 4
    assert counted[C.head("value")] == (64 + 1) * 4


def test_walk_counts_4bit_storage_and_every_quantization_constant():
    import bitsandbytes as bnb

    model = tiny_ppo("nf4")
    counted = count_tensors(model).components()
    packed = constants = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = module.weight
        assert weight.dtype == torch.uint8
        packed += weight.numel()
        qs = weight.quant_state
        constants += nbytes(qs.absmax) + nbytes(qs.offset) + nbytes(qs.code)
        constants += nbytes(qs.state2.absmax) + nbytes(qs.state2.code)
        assert weight.numel() == math.ceil(module.in_features * module.out_features / 2)
    assert counted[C.BASE_WEIGHTS] == packed == 45312  # 90,624 weights at 4 bits
    # per layer: 8-bit absmax per 64 weights, fp32 absmax per 256 of those, offset, NF4 and 8-bit codebooks
    assert counted[C.BASE_QUANT_CONSTANTS] == constants == 16760
    assert counted[C.BASE_OTHER] == (512 * 64 * 2 + 5 * 64) * 2 + 2 * 8 * 4  # bf16 embed, lm_head, norms; rotary


@pytest.mark.parametrize("rows, cols", [(37, 100), (300, 300), (64, 4096)])
def test_nf4_closed_form_equals_bitsandbytes_quant_state(rows, cols):
    import bitsandbytes.functional as F

    weight = torch.randn(rows, cols, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    walked = sum(nbytes(t) for t in quant_state_tensors(state))
    assert nf4_bytes(rows * cols) == (nbytes(packed), walked)


def test_tied_embeddings_are_counted_once():
    model = tiny_ppo("none", preset_overrides="tie_word_embeddings=true")
    counted = count_tensors(model).components()
    assert counted[C.BASE_OTHER] == (512 * 64 + 5 * 64) * 4 + 2 * 8 * 4


def _params(*sizes):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n)) for n in sizes]


def _one_step(optimizer, params):
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


SIZES = (5000, 300, 70000)


def test_torch_adamw_states_are_two_fp32_moments_and_a_step_counter():
    params = _params(*SIZES)
    opt = torch.optim.AdamW(params, lr=1e-3)
    _one_step(opt, params)
    assert count_tensors(optimizer=opt).components() == {C.OPTIMIZER_STATES: 8 * sum(SIZES) + 4 * len(SIZES)}


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit"])
def test_8bit_adamw_states_after_one_step_match_hand_computed_bytes(name):
    import bitsandbytes as bnb

    params = _params(*SIZES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the paged variant warns that CPU has no paging
        opt = getattr(bnb.optim, name)(params, lr=1e-3)
        _one_step(opt, params)
    expected = (
        (2 * 5000 + 2 * 4 * 20)  # two uint8 states + two fp32 absmax per 256-block (20 blocks)
        + 8 * 300  # under min_8bit_size (4096): fp32 states
        + (2 * 70000 + 2 * 4 * 274)
        + 2 * 256 * 4  # the signed and unsigned quantization maps, shared by all tensors
    )
    assert count_tensors(optimizer=opt).components() == {C.OPTIMIZER_STATES: expected}


def test_gradients_are_the_grad_tensors_present_now():
    model = tiny_ppo("none")
    ids = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    assert C.GRADIENTS not in count_tensors(model).components()
    loss = model.logits(ids, mask, "policy").pow(2).mean() + model.scores(ids, mask, "value").pow(2).mean()
    loss.backward()
    trainable = sum(p.numel() for p in model.trainable_parameters())
    assert count_tensors(model).components()[C.GRADIENTS] == 4 * trainable
    for p in model.trainable_parameters():
        p.grad = None
    assert C.GRADIENTS not in count_tensors(model).components()
