"""The fused NF4 kernel compiled for the GPUs it runs on, without one: per tile config, registers, spills, shared
memory and the instructions its main loop issues per weight, at one or more git revisions.

    python -m benchmarks.nf4_kernel 408a803 HEAD     # writes benchmarks/results/nf4_kernel/

Triton compiles for a CUDA target on any machine and its wheel ships `cuobjdump`, so the machine code of
`trainer/model/nf4_kernel.py` can be read here: each autotuned config for Ampere (sm_80), Ada (sm_89, an RTX
4090) and Hopper (sm_90), as a decode at the recipes' 16 rows of bf16 launches it at 7B's shapes (pointers, N
and K multiples of 16, 4 slices of the input width). A decode step of a memory-bound kernel runs at the
bandwidth only while the cores keep up: the loop's instructions per weight (its SASS, counted between the
backward branch and its target, over the weights a thread dequantizes per iteration) are the issue cost of
reading a weight. A static count, not a time: which config wins, and how close to the bandwidth, the GPU kit's
`speed` part measures.

Each revision runs from its own `git archive` tree, in a process of its own.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.processes import main_at_revisions, revision_tree
from foundation.cli import run

CAPABILITIES = (80, 89, 90)
# The kernel's arguments by name at any revision; what a revision's kernel does not take is left out.
POINTERS = {"x_ptr": "*bf16", "packed_ptr": "*u8", "absmax_ptr": "*fp32", "code_ptr": "*fp32", "pairs_ptr": "*i64",
            "bias_ptr": "*fp32", "dense_ptr": "*bf16", "out_ptr": "*fp32"}
INTEGERS = {"M": "i32", "N": "i32", "R": "i32", "K": "i32"}
CONSTANTS = {"HAS_BIAS": False, "FP32_DOT": False, "BLOCKSIZE": 64, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16,
             "SPLIT_K": 4}


def compile_for(jit, config, capability: int):
    """`jit` (the kernel's JITFunction) compiled with autotune `config` for sm_`capability`, launched as a decode
    at 16 rows of bf16: (compiled kernel, resource usage dict: REG, STACK, SHARED ... from cuobjdump)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = jit.arg_names
    signature = {n: POINTERS.get(n) or INTEGERS.get(n) or "constexpr" for n in names}
    constants = {k: v for k, v in {**CONSTANTS, **config.kwargs}.items() if k in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in POINTERS or n in ("N", "K")}
    source = ASTSource(fn=jit, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    usage = dumped(compiled, "--dump-resource-usage")
    return compiled, {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", usage.split("Function", 1)[-1])}


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def dumped(compiled, flag: str) -> str:
    """What cuobjdump `flag` prints of a compiled kernel's machine code (its cubin)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(cuobjdump()), flag, str(cubin)], capture_output=True, text=True,
                              check=True).stdout


def loop_instructions(compiled) -> int:
    """Instructions of the longest loop in the kernel's SASS: from a backward branch's target to the branch."""
    import re

    sass = dumped(compiled, "-sass")
    spans = [(int(at, 16) - int(to, 16)) // 16 + 1
             for at, to in re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", sass)
             if int(to, 16) < int(at, 16)]
    return max(spans, default=0)


# What a revision's own tree runs: this module's helpers, then every config of its kernel for each target.
MEASURING = r'''
import json, os
os.environ.pop("TRITON_INTERPRET", None)
from trainer.model import nf4_kernel
tuned = nf4_kernel._kernel().kernel
rows = []
for capability in CAPABILITIES:
    for config in tuned.configs:
        compiled, usage = compile_for(tuned.fn, config, capability)
        tile = {**CONSTANTS, **config.kwargs}
        weights = tile["BLOCK_N"] * tile["BLOCK_K"] / (32 * config.num_warps)  # a thread's, per iteration
        loop = loop_instructions(compiled)
        rows.append({"capability": capability, "block_n": tile["BLOCK_N"], "block_k": tile["BLOCK_K"],
                     "warps": config.num_warps, "stages": config.num_stages, "registers": usage.get("REG"),
                     "spill_bytes": usage.get("STACK"), "shared_bytes": compiled.metadata.shared,
                     "loop_instructions": loop, "instructions_per_weight": loop / weights})
print("RESULT " + json.dumps(rows))
'''


def figures(revision: str) -> dict:
    helpers = "\n".join(inspect.getsource(f) for f in (compile_for, cuobjdump, dumped, loop_instructions))
    preamble = ("import subprocess\nfrom pathlib import Path\n"
                f"CAPABILITIES = {CAPABILITIES!r}\nPOINTERS = {POINTERS!r}\nINTEGERS = {INTEGERS!r}\n"
                f"CONSTANTS = {CONSTANTS!r}\n")
    with revision_tree(revision) as (commit, tree):
        done = subprocess.run([sys.executable, "-c", preamble + helpers + MEASURING], cwd=tree, capture_output=True,
                              text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"benchmarks.nf4_kernel at {revision}: {done.stderr.strip().splitlines()[-1:]}")
    return {"revision": revision, "commit": commit, "configs": json.loads(line[len("RESULT "):])}


def markdown(data: dict) -> str:
    lines = ["# The fused NF4 kernel, compiled for sm_80, sm_89 and sm_90 (no GPU)", "",
             f"- date {data['date']}; git `{data['git_revision']}`; command: `{data['command']}`",
             "- a decode at 16 rows of bf16 at 7B's shapes; per autotune config: registers a thread, bytes spilled, "
             "shared memory a block (an RTX 4090 allows 99 KB), and the instructions its main loop issues per "
             "weight a thread dequantizes (a static count, not a time)", ""]
    for run_ in data["revisions"]:
        lines += [f"## {run_['revision']} (`{run_['commit'][:10]}`)", "",
                  "| target | BLOCK_N x BLOCK_K | warps | stages | registers | spilled bytes | shared KB "
                  "| loop instructions | per weight |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in run_["configs"]:
            lines.append(f"| sm_{r['capability']} | {r['block_n']} x {r['block_k']} | {r['warps']} | {r['stages']} | "
                         f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} | "
                         f"{r['loop_instructions']} | {r['instructions_per_weight']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    return main_at_revisions("nf4_kernel", __doc__, figures, markdown, argv)


if __name__ == "__main__":
    run(main)
