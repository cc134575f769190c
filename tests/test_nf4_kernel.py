"""The fused NF4 kernel (trainer/model/nf4_kernel.py), run on the CPU in Triton's interpreter: it multiplies
by exactly the weights bitsandbytes' `dequantize_4bit` writes, and stands in for a `Linear4bit`."""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
bnb = pytest.importorskip("bitsandbytes")


def quantized(out_features, in_features, dtype, nested=True, blocksize=64, seed=0):
    import bitsandbytes.functional as bnbf

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", compress_statistics=nested, blocksize=blocksize)
    absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset if nested else state.absmax
    from trainer.model.nf4_kernel import byte_pairs

    return packed.view(-1), absmax.float(), byte_pairs(state.code), dequantized(packed, absmax, state, dtype)


def dequantized(packed, absmax, state, dtype):
    """What bitsandbytes' CUDA kernel writes: two weights a byte, the even one in the high nibble, each the NF4
    code times its block's fp32 absmax, rounded once to `dtype` (its CPU library rounds its own way)."""
    nibbles = torch.stack([packed.view(-1) >> 4, packed.view(-1) & 15], dim=-1).view(-1).long()
    values = state.code.float()[nibbles].view(-1, state.blocksize) * absmax.float().view(-1, 1)
    return values.view(state.shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nested,blocksize,shape", [(True, 64, (136, 320)), (False, 64, (33, 192)),
                                                    (True, 128, (72, 384)), (True, 32, (17, 96))])
def test_the_kernel_multiplies_by_the_weights_dequantize_4bit_writes(interpreted, dtype, nested, blocksize, shape):
    """One-hot rows read the weights back one column each: bit for bit what bitsandbytes' CUDA kernel
    dequantizes (tests/test_gpu.py compares with it there), over row and column counts no tile divides and input
    widths that are not a whole number of the kernel's iterations. In bf16 to one unit of the last place: the
    interpreter truncates fp32 to bf16 where a GPU rounds to nearest."""
    n, k = shape
    packed, absmax, pairs, dense = quantized(n, k, dtype, nested, blocksize)
    read = torch.cat([interpreted.nf4_linear(torch.eye(k, dtype=dtype)[i : i + 64].contiguous(), packed, absmax,
                                             pairs, None, n, blocksize) for i in range(0, k, 64)])
    assert read.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(read.T, dense, rtol=2 ** -7, atol=0)
        assert (read.T.float().abs() <= dense.float().abs()).all()  # truncated, never further out
    else:
        assert torch.equal(read.T, dense)


@pytest.mark.parametrize("rows,split", [(1, 1), (16, 1), (19, 1), (64, 1), (1, 3), (16, 2)])
def test_the_kernel_gives_a_matmul_of_the_dequantized_weights_for_any_row_count(interpreted, rows, split):
    """Its sums are fp32 over the rounded weights: a matmul's result, to one rounding of the output (fp16, which
    the interpreter rounds as a GPU does), also summed in slices of the input width (the last one empty at 3)."""
    packed, absmax, pairs, dense = quantized(80, 256, torch.float16)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    got = interpreted.nf4_linear(x, packed, absmax, pairs, bias, 80, 64, split=split)
    want = F.linear(x.float(), dense.float(), bias.float())
    assert got.shape == (rows, 80) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -10, atol=1e-3)  # fp16's ulp


@pytest.mark.parametrize("split", [1, 3])
def test_dense_rows_beside_the_nf4_weight_come_out_as_more_columns_of_the_same_launch(interpreted, split):
    """`dense` (R, K) rows in the input's dtype (a LoRA-A): their products are R more columns after the NF4
    weight's, from programs past its column blocks, summed alike; the bias only on the weight's columns."""
    packed, absmax, pairs, weight = quantized(80, 256, torch.float16)
    g = torch.Generator().manual_seed(4)
    dense, x = torch.randn(70, 256, generator=g).half(), torch.randn(5, 256, generator=g).half()
    bias = torch.randn(80, generator=g).half()
    got = interpreted.nf4_linear(x, packed, absmax, pairs, bias, 80, 64, split=split, dense=dense)
    want = torch.cat([F.linear(x.float(), weight.float(), bias.float()), F.linear(x.float(), dense.float())], -1)
    assert got.shape == (5, 150)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -10, atol=1e-3)


def linear4bit(in_features, out_features, bias=True, dtype=torch.bfloat16):
    torch.manual_seed(3)
    dense = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=dtype, quant_type="nf4",
                              compress_statistics=True)
    layer.load_state_dict(dense.state_dict())
    return layer.to("cpu")  # quantized here


def test_it_stands_in_for_a_linear4bit_and_passes_larger_calls_to_its_forward(interpreted, monkeypatch):
    """Up to MAX_ROWS tokens the kernel multiplies the layer's own packed weights (no copy), input cast to the
    compute dtype and output back to the input's, as the layer's forward does; more tokens (a prefill) run the
    layer's forward itself."""
    layer = linear4bit(128, 40)
    fused = interpreted.FusedNF4Linear(layer)
    assert fused.packed.untyped_storage().data_ptr() == layer.weight.data.untyped_storage().data_ptr()
    assert len(fused.held) == 1 and fused.held[0] is fused.absmax and fused.absmax.dtype == torch.float32
    assert interpreted.FusedNF4Linear(linear4bit(64, 8)).pairs is fused.pairs  # one table for every layer
    calls = []
    monkeypatch.setattr(type(layer), "forward", lambda self, x: calls.append(x.shape) or torch.zeros(()))
    x = torch.randn(2, 3, 128)
    with torch.no_grad():
        got = fused(x)
        fused(torch.randn(2, interpreted.MAX_ROWS, 128))
    assert calls == [(2, interpreted.MAX_ROWS, 128)]
    monkeypatch.undo()
    with torch.no_grad():
        want = layer(x)
    assert got.shape == (2, 3, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)  # one bf16 rounding each, apart


def test_the_input_width_is_split_for_two_programs_a_processor_within_a_quarter_of_the_weights_traffic():
    from trainer.model.nf4_kernel import split_k

    assert split_k(16, 4096, 4096, 132) == 4  # 64 programs: 8 would write as much as a quarter of the weights
    assert split_k(1, 4096, 4096, 132) == 8  # 512 programs past 2 a processor
    assert split_k(16, 11008, 4096, 132) == 2
    assert split_k(16, 4096, 11008, 132) == 8
    assert split_k(64, 4096, 4096, 132) == 1
    assert split_k(1, 4096, 384, 132) == 1  # no slice under 256
    assert split_k(16, 4096, 4096, 1) == 1  # the interpreter's one processor


@pytest.mark.parametrize("capability", [80, 89, 90])
def test_every_tile_config_compiles_for_the_gpus_it_runs_on_without_spilling(capability, monkeypatch):
    """Each autotuned config, compiled by Triton for Ampere, Ada (an RTX 4090) and Hopper on this machine with
    the compiler it ships, as a launch at 7B's shapes specializes it (`benchmarks.nf4_kernel.compile_for`): at 16
    rows of bf16 (a decode at the recipes' rows) no register spills to local memory and at most 99 KB of shared
    memory a block, what an RTX 4090 allows, so none is lost to a launch failure."""
    from benchmarks.nf4_kernel import compile_for, cuobjdump
    from trainer.model import nf4_kernel

    if not cuobjdump().exists():
        pytest.skip("Triton ships no cuobjdump here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    nf4_kernel._kernel.cache_clear()
    try:
        tuned = nf4_kernel._kernel().kernel
    finally:
        nf4_kernel._kernel.cache_clear()
    for config in tuned.configs:
        compiled, usage = compile_for(tuned.fn, config, capability)
        assert usage["STACK"] == 0 and compiled.metadata.shared <= 99 * 1024, (config, usage, compiled.metadata.shared)


def test_what_the_kernel_cannot_run_on_or_multiply_by_is_said_in_one_line(monkeypatch):
    from trainer.model import nf4_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert nf4_kernel.unavailable(torch.device("cpu")) == "the fused NF4 kernel runs on CUDA (here cpu)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a Turing card
    assert nf4_kernel.unavailable(torch.device("cuda", 0)) == (
        "the fused NF4 kernel needs compute capability 8.0 or newer (here 7.5)")
    assert nf4_kernel.unfit(linear4bit(128, 40)) is None
    assert nf4_kernel.unfit(linear4bit(96, 40)) == "blocksize 64 over 96 input features"
    assert nf4_kernel.unfit(torch.nn.Linear(64, 8)) == "not an NF4 weight"
