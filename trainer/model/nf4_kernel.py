"""Decoding straight from a bitsandbytes NF4 weight: a Triton kernel reads the packed 4-bit weights and their
block scales, dequantizes them in registers to the values bitsandbytes' `dequantize_4bit` writes (the NF4 code
times the block's fp32 absmax, rounded once to the compute dtype) and multiplies a few rows of tokens by them.
A decode step then reads about 0.56 bytes a weight, where a dense copy reads 2 and bitsandbytes' own path
writes and reads a dense temporary per layer and token.

    FusedNF4Linear(layer)  # stands in for a `bnb.nn.Linear4bit` while a decode runs (trainer.model.decode)

The absmax of double quantization is dequantized once (bitsandbytes' `dequantize_blockwise`), so the kernel
reads the same fp32 scales the training forward computes. Passes of more than `MAX_ROWS` tokens (a prompt's
prefill) run the layer's own forward: there a dequantized temporary feeds a compute-bound matmul. The kernel
runs on CUDA; on the CPU only in Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

try:  # module globals: Triton's interpreter finds the language where the kernel's globals hold it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_ROWS = 64  # tokens per call up to which the kernel runs; more, and the layer's own forward does


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on the CPU), read when the kernel is first built."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


MIN_CAPABILITY = (8, 0)  # Ampere: bf16 tensor-core dots, which the kernel's tiles use


def unavailable(device: torch.device) -> Optional[str]:
    """Why the kernel cannot run on `device`, or None."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"the fused NF4 kernel runs on CUDA (here {device.type})"
    if triton is None:
        return "Triton is not installed"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else MIN_CAPABILITY
    if capability < MIN_CAPABILITY:
        return f"the fused NF4 kernel needs compute capability 8.0 or newer (here {capability[0]}.{capability[1]})"
    return None


def unfit(layer: nn.Module) -> Optional[str]:
    """Why the kernel cannot multiply by this 4-bit layer's weight, or None."""
    state = getattr(layer.weight, "quant_state", None)
    if state is None or state.quant_type != "nf4":
        return "not an NF4 weight"
    if len(state.shape) != 2 or layer.weight.data.numel() * 2 != state.shape[0] * state.shape[1]:
        return "its packed weight is not the row-major NF4 layout"
    if state.blocksize not in (32, 64, 128) or state.shape[1] % state.blocksize:
        return f"blocksize {state.blocksize} over {state.shape[1]} input features"
    return None


@functools.cache
def _kernel():
    """The Triton kernel, built at first use (Triton reads TRITON_INTERPRET when it builds one): autotuned over
    the inner tile and pipelining on a GPU, one tile in the interpreter. Only builtins of triton.language
    inside: the interpreter cannot run its jit-compiled helpers once Triton was loaded without it."""

    @triton.jit
    def nf4_linear(x_ptr, packed_ptr, absmax_ptr, pairs_ptr, bias_ptr, dense_ptr, out_ptr, M, N, R, K,
                   HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[M, N + R] = x[M, K] @ [W; D]^T: W (N, K) the NF4 weight, row-major, two weights a byte (the even one
        # in the high nibble), one absmax per BLOCKSIZE consecutive weights of a row; D (R, K) dense rows in x's
        # dtype (LoRA-A weights), BLOCK_R a program, from the programs past W's column blocks. Program (n, m, s)
        # sums the s-th of SPLIT_K slices of K (whole blocks); with SPLIT_K > 1 it writes fp32 partial sums to
        # out[s], which the caller adds. The two branches name their values apart: Triton types them as one.
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        per_split = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
        start = tl.program_id(2) * per_split
        stop = tl.minimum(start + per_split, K)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        nf4_blocks = (N + BLOCK_N - 1) // BLOCK_N
        if tl.program_id(0) < nf4_blocks:
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            halves = tl.arange(0, BLOCK_K // 2)
            blocks = tl.arange(0, BLOCK_K // BLOCKSIZE)
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(start, stop, BLOCK_K):
                # even input features meet the high nibbles, odd ones the low: two dots, no weight interleaved
                x = tl.load(x_ptr + rows[:, None] * K + (k0 + ks)[None, :],
                            mask=row_ok[:, None] & (k0 + ks < stop)[None, :], other=0.0)
                x_even, x_odd = tl.split(x.reshape(BLOCK_M, BLOCK_K // 2, 2))
                packed = tl.load(packed_ptr + cols[:, None] * (K // 2) + (k0 // 2 + halves)[None, :],
                                 mask=col_ok[:, None] & (k0 // 2 + halves < stop // 2)[None, :], other=0)
                scales = tl.load(absmax_ptr + cols[:, None] * (K // BLOCKSIZE) + (k0 // BLOCKSIZE + blocks)[None, :],
                                 mask=col_ok[:, None] & (k0 // BLOCKSIZE + blocks < stop // BLOCKSIZE)[None, :],
                                 other=0.0)[:, :, None]
                pair = tl.load(pairs_ptr + packed.to(tl.int32))  # one load a byte: both its values' fp32 bits
                high = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
                low = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
                high = high.reshape(BLOCK_N, BLOCK_K // BLOCKSIZE, BLOCKSIZE // 2)
                low = low.reshape(BLOCK_N, BLOCK_K // BLOCKSIZE, BLOCKSIZE // 2)
                w_even = (high * scales).reshape(BLOCK_N, BLOCK_K // 2).to(x_even.dtype)
                w_odd = (low * scales).reshape(BLOCK_N, BLOCK_K // 2).to(x_even.dtype)
                if FP32_DOT:  # exact products of the rounded weights either way, summed in fp32
                    acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even).to(tl.float32), input_precision="ieee")
                    acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd).to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(x_even, tl.trans(w_even))
                    acc += tl.dot(x_odd, tl.trans(w_odd))
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + tl.program_id(2) * M * (N + R) + rows[:, None] * (N + R) + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        else:  # BLOCK_R of the dense rows a program: a LoRA rank needs a tile of its own size, not BLOCK_N's
            lora_cols = (tl.program_id(0) - nf4_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
            lora_ok = lora_cols < R
            lora_acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
            for k0 in tl.range(start, stop, BLOCK_K, num_stages=1):  # a few rows: no buffers to pipeline
                x = tl.load(x_ptr + rows[:, None] * K + (k0 + ks)[None, :],
                            mask=row_ok[:, None] & (k0 + ks < stop)[None, :], other=0.0)
                lora_a = tl.load(dense_ptr + lora_cols[:, None] * K + (k0 + ks)[None, :],
                                  mask=lora_ok[:, None] & (k0 + ks < stop)[None, :], other=0.0)
                if FP32_DOT:
                    lora_acc += tl.dot(x.to(tl.float32), tl.trans(lora_a).to(tl.float32), input_precision="ieee")
                else:
                    lora_acc += tl.dot(x, tl.trans(lora_a))
            tl.store(out_ptr + tl.program_id(2) * M * (N + R) + rows[:, None] * (N + R) + (N + lora_cols)[None, :],
                     lora_acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lora_ok[None, :])

    if interpreting():
        return Launch(nf4_linear, {"BLOCK_N": 64, "BLOCK_K": 128}, interpreted=True)
    # (BLOCK_N, BLOCK_K, warps, stages): a BLOCK_N x BLOCK_K tile of fp32 values lives in registers and each
    # stage buffers x, the packed bytes and the scales in shared memory. At 16 rows of bf16 each compiles for
    # sm_80, sm_89 and sm_90 without spilling, in at most 79 KB: an RTX 4090 gives a block 99 (a test compiles
    # them for those targets, no GPU needed). Wider tiles issue fewer instructions a weight
    # (benchmarks.nf4_kernel counts them), narrower ones make more programs.
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
               for n, k, warps, stages in ((64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 8, 3), (128, 128, 8, 3),
                                           (64, 256, 8, 2), (32, 128, 4, 3))]
    return Launch(triton.autotune(configs, key=["M", "N", "K", "SPLIT_K"])(nf4_linear), {}, interpreted=False)


@dataclass(frozen=True)
class Launch:
    """The kernel and what its launches pass beside the tensors. Taken once, outside any compiled code: a
    compiled step then traces the launch alone, not the kernel's build."""

    kernel: object
    fixed: dict
    interpreted: bool  # the interpreter multiplies 16-bit tiles in fp32 (its 16-bit `tl.dot` is wrong in 3.9)


BLOCK_N = 64  # output features per program, as split_k counts them (the autotuned tile may take 32)
BLOCK_R = 16  # dense rows per program: a LoRA rank's worth, the smallest tile a tensor-core dot takes


def processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split_k(rows: int, out_features: int, in_features: int, processors: int) -> int:
    """Slices of the input width summed apart: enough programs to give every processor two, each slice at least
    256 wide, and the fp32 partial sums written and read (slices x rows x out_features x 8 bytes) at most a
    quarter of the packed weights read."""
    programs = -(-out_features // BLOCK_N) * -(-rows // block_rows(rows))
    split = 1
    while (programs * split < 2 * processors and in_features // (2 * split) >= 256
           and 2 * split <= max(1, in_features // (64 * rows))):
        split *= 2
    return split


def block_rows(rows: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Token rows a program: 16 (a tensor-core tile's least) up to 64; fp32 tiles stay at 16, whose wider
    buffers would not fit a block's shared memory."""
    return 16 if rows <= 16 or dtype == torch.float32 else 32 if rows <= 32 else 64


def byte_pairs(code: torch.Tensor) -> torch.Tensor:
    """For each of the 256 bytes, the fp32 bits of its two NF4 values (`code`, the 16 levels) as one int64: the
    high nibble's in the low word, the low nibble's in the high word. The kernel reads a byte's two values with
    one load."""
    bits = code.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    every = torch.arange(256, device=code.device)
    return bits[every >> 4] | (bits[every & 15] << 32)


_PAIRS: dict[tuple, torch.Tensor] = {}


def _shared_pairs(code: torch.Tensor) -> torch.Tensor:
    """One `byte_pairs` table (2 KB) per device and code for every layer: it stays in the cache as layers go."""
    key = (str(code.device), tuple(code.tolist()))
    if key not in _PAIRS:
        _PAIRS[key] = byte_pairs(code)
    return _PAIRS[key]


def nf4_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, pairs: torch.Tensor,
               bias: Optional[torch.Tensor], out_features: int, blocksize: int, split: Optional[int] = None,
               launch: Optional[Launch] = None, dense: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (M, K) contiguous in the compute dtype times the NF4 weight (out_features, K): (M, out_features), and
    with `dense` (R, K) rows in x's dtype, their products too as R more columns (one launch for both).
    `split`: slices of K summed apart (default `split_k`'s pick; their partial sums added here in fp32, the
    bias after, rounded once)."""
    m, k = x.shape
    extra = 0 if dense is None else dense.shape[0]
    split = split or split_k(m, out_features, k, processors(x.device))
    launch = launch or _kernel()
    rows = block_rows(m, x.dtype)
    width = out_features + extra
    out = torch.empty(split, m, width, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = lambda meta: (-(-out_features // meta["BLOCK_N"]) + -(-extra // BLOCK_R), -(-m // rows), split)  # noqa: E731
    launch.kernel[grid](x, packed, absmax, pairs, absmax if bias is None else bias, x if dense is None else dense,
                        out, m, out_features, extra, k,  # (the stand-ins for no bias or rows are never read)
                        HAS_BIAS=bias is not None and split == 1,
                        FP32_DOT=x.dtype == torch.float32 or launch.interpreted, BLOCKSIZE=blocksize, BLOCK_M=rows,
                        BLOCK_R=BLOCK_R, SPLIT_K=split, **launch.fixed)
    if split == 1:
        return out[0]
    total = out.sum(0)
    if bias is not None:
        total[:, :out_features] += bias.float()
    return total.to(x.dtype)


class FusedNF4Linear(nn.Module):
    """A bitsandbytes NF4 `Linear4bit` whose passes of up to MAX_ROWS tokens run the fused kernel on its own
    packed weights (no copy; the layer stays a child, `quantized`, and runs larger passes). Holds the absmax
    dequantized to fp32: 4 bytes per block of weights, 1/16 of the packed weights at blocksize 64. Input cast
    to the compute dtype and output back to the input's, as the layer's forward does.

    `lora_rank` > 0 holds that many dense rows in the compute dtype for the LoRA-A weights of the adapter a
    decode multiplies (`trainer.model.decode.lora_compute_copies` fills them): while `rows_for` names that
    adapter, the one launch gives the base output and the LoRA-A products side by side, the last `lora_rank`
    columns, where a separate small matmul would launch per layer and token (as `DequantizedLinear`'s rows)."""

    def __init__(self, layer: nn.Module, lora_rank: int = 0):
        import bitsandbytes.functional as bnbf

        super().__init__()
        state = layer.weight.quant_state
        self.quantized = layer
        self.dtype = layer.compute_dtype or state.dtype
        (self.out_features, self.in_features), self.blocksize = state.shape, state.blocksize
        self.lora_rank, self.rows_for = lora_rank, None
        absmax = state.absmax
        if state.nested:
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        device = layer.weight.device
        # buffers, so that a compiled step reads them as inputs rather than baking them in
        self.register_buffer("absmax", absmax.float().contiguous(), persistent=False)
        self.register_buffer("pairs", _shared_pairs(state.code.to(device)), persistent=False)
        self.register_buffer("packed", layer.weight.data.view(-1), persistent=False)  # the weight's storage
        bias = None if layer.bias is None else layer.bias.detach().to(self.dtype)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("lora_rows", torch.zeros(lora_rank, self.in_features, dtype=self.dtype, device=device)
                             if lora_rank else None, persistent=False)
        # plain values, settled here: a compiled step's trace reads them, it neither builds nor asks the device
        self.launch, self.processors = _kernel(), processors(device)

    @property
    def held(self) -> list[torch.Tensor]:
        """What it adds to the model's memory (generation_weights): the fp32 absmax, the LoRA-A rows."""
        return [t for t in (self.absmax, self.lora_rows) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > MAX_ROWS * self.in_features:  # a prefill: bitsandbytes' matmul, the rows' own beside it
            out = self.quantized(x)
            if self.rows_for is None:
                return out
            return torch.cat([out, torch.nn.functional.linear(x.to(self.dtype), self.lora_rows).to(out.dtype)], -1)
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        split = split_k(flat.shape[0], self.out_features, self.in_features, self.processors)
        dense = self.lora_rows if self.rows_for is not None else None  # (..., out_features + lora_rank)
        out = nf4_linear(flat, self.packed, self.absmax, self.pairs, self.bias, self.out_features, self.blocksize,
                         split, self.launch, dense)
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
