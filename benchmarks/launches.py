"""Operations launched per decoder layer by the passes RL training runs, at one or more git revisions.

    python -m benchmarks.launches d5725ff~1 HEAD      # writes benchmarks/results/launches/
    python -m benchmarks.launches HEAD@DIR HEAD --architecture qwen2 --out_dir DIR2
        # REV@DIR: DIR's libraries ahead of this environment's, e.g. another transformers unpacked there
        # (pip install --no-deps --target DIR transformers==5.17.0 huggingface_hub==1.33.0; DIR inside the
        # project, e.g. .cache/transformers-5.17, so the result names it from the root)

An eager pass on a GPU launches a kernel per operation and pays host time for each (Python, dispatcher,
autograd): where kernels are short, as in the PPO update of a 7B model in 4-bit, that host time is the pass's
time. This counts the operations torch dispatches (views left out), forward, checkpoint recompute and backward,
per decoder layer: the difference between a 4-layer and a 2-layer Llama of the `tiny-llama` shape divided by
two (`--layers`: other layer counts), so the count is what every layer of a 7B Llama adds (`--architecture
qwen2`: Qwen2's layers at those sizes). On the CPU, in bf16 under autocast, LoRA r 4 on every linear layer,
gradient checkpointing on, no dropout (PPO's and GRPO's update); the base in bf16, not
4-bit (bitsandbytes' CPU kernels are not CUDA's), except for decoding, which reads a dense copy of 4-bit
weights (`--generation_weights dequantized`). A proxy for host time per pass, not a time; on a GPU a matmul
may launch more than one kernel (a split-K GEMM and its reduction). A compiled decode step replays CUDA graphs
with no host time per operation, but each kernel in them still costs the GPU a launch: its count is the matmuls
of the step's graph after inductor's passes (pointwise work fuses around them), also per decoder layer. Its
first call is mostly compilation, which begins with dynamo tracing the step's Python bytecode: the
instructions it traces per decoder layer (a layer region traced once and reused for the others adds only
its call) are a proxy for that part of the first call, on any device.

Each revision runs from its own `git archive` tree, in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.processes import main_at_revisions, revision_tree
from foundation.cli import run
from profiling.report import table_lines

# What a revision's own code runs: the passes through public calls every revision has.
COUNTING = r'''
import json, sys, tempfile
from pathlib import Path
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trainer.config import ModelArguments
from trainer.model.shared_base import HEAD_FILE, AdapterSpec, ScalarHead, build_shared_model

NAME, OVERRIDES = sys.argv[1], sys.argv[2]  # the architecture (ARCHITECTURES) every count builds
LOW, HIGH = (int(n) for n in sys.argv[3].split(","))  # the layer counts whose difference is counted

def shape(layers):
    return dict(model_name_or_path=NAME, preset_overrides=",".join(filter(None, (OVERRIDES, f"num_hidden_layers={layers}"))))

class Count(TorchDispatchMode):
    launched = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.launched += not func.is_view
        return func(*args, **(kwargs or {}))

def counts(layers, head):
    args = ModelArguments(**shape(layers),
                          dtype="bfloat16", gradient_checkpointing=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    specs = [AdapterSpec("policy", trainable=True), AdapterSpec("reference"),
             AdapterSpec("value", trainable=True, head=True), AdapterSpec("reward", head=True, head_from=head)]
    torch.manual_seed(0)
    model = build_shared_model(args, specs, vocab_size=512).train()
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    passes = {"ppo_update": (("policy", "value"), ("logits", "scores"), True),
              "grpo_update": (("policy",), ("logits",), True),
              "ppo_scoring": (("reference", "value", "reward"), ("logits", "scores", "scores"), False),
              "grpo_scoring": (("reference", "reward"), ("logits", "scores"), False)}
    out = {}
    for name, (adapters, outputs, grad) in passes.items():
        def one_pass():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
                results = model.fused(ids, mask, adapters, outputs, keep_last=9)
                if grad:
                    sum(r.float().pow(2).mean() for r in results).backward()
        one_pass()  # first pass of a route: what is made once
        with Count() as count:
            one_pass()
        out[name] = count.launched
    return out

def nf4_policy(layers):
    """A 4-bit base with a policy adapter, and 4 prompts of 16 tokens: what the decode counts decode."""
    args = ModelArguments(**shape(layers),
                          quantization="nf4", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    torch.manual_seed(0)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=512)
    return model, torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(0))

def decoder(model, path, weights, **sampling):
    """(decode(ids), compile_anew(regions=True)) as this revision's rollouts decode: its Generator, or before it
    its decode function, whose sampling named the path and the weights."""
    import trainer.model.decode as D
    if hasattr(D, "Generator"):
        generator, chosen = D.Generator(model, path, weights), D.Sampling(**sampling)
        return lambda ids: generator.sample(ids, torch.ones_like(ids), chosen, 1, 0), generator.compile_anew
    chosen = D.Sampling(**sampling, decode=path, generation_weights=weights)
    return (lambda ids: D.decode(model, ids, torch.ones_like(ids), chosen, 1, 0),
            lambda regions=True: D.compile_anew(model.causal_lm, regions=regions))

def decode_counts(layers):
    model, ids = nf4_policy(layers)
    decode, _ = decoder(model, "eager", "dequantized", max_new_tokens=TOKENS, min_new_tokens=TOKENS, temperature=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decode(ids)
        with Count() as count:
            decode(ids)
    return count.launched

def compiled_decode_work(layers):
    """A model whose 4-bit base decodes from its dense copy, 4 prompts, and a compiled greedy decoder."""
    model, ids = nf4_policy(layers)
    return ids, decoder(model, "compiled", "dequantized", max_new_tokens=4, min_new_tokens=4, temperature=0)

def compiled_matmuls(layers):
    """Matmuls in the compiled decode step's graphs, after inductor's own graph passes (each an extern GEMM
    launched on a GPU); compiled whole, so every layer is in its graph."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    ids, (decode, compile_anew) = compiled_decode_work(layers)
    matmuls = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")
    seen = []
    torch._dynamo.reset()
    compile_anew(regions=False)
    count = lambda graph: seen.append(sum(n.op == "call_function" and str(n.target) in matmuls for n in graph.nodes))
    with inductor_config.patch(post_grad_custom_post_pass=count), torch.autocast("cpu", dtype=torch.bfloat16):
        decode(ids)
    return sum(seen)

def traced_instructions(layers):
    """Bytecode instructions dynamo traces while compiling the decode step, its decoder layers as regions (as
    rollouts compile it), under autocast from the dense copy. Dynamo traces before any backend runs: the graphs
    then run eagerly, with no code generated."""
    import torch._dynamo
    import torch._dynamo.symbolic_convert as convert
    ids, (decode, compile_anew) = compiled_decode_work(layers)
    traced, step, compile_ = [0], convert.InstructionTranslatorBase.step, torch.compile
    def counted(self):
        traced[0] += 1
        return step(self)
    def eager(model=None, *, options=None, backend=None, **kwargs):
        return compile_(model, backend="eager", **kwargs) if model is not None else (
            lambda fn: compile_(fn, backend="eager", **kwargs))
    torch._dynamo.reset()
    torch.compile, convert.InstructionTranslatorBase.step = eager, counted
    try:
        compile_anew()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            decode(ids)
    finally:
        torch.compile, convert.InstructionTranslatorBase.step = compile_, step
    return traced[0]

TOKENS = 8  # the prompt's forward and 7 steps
folder = Path(tempfile.mkdtemp())
ScalarHead(64).save(folder / HEAD_FILE)
low, high, span = counts(LOW, str(folder)), counts(HIGH, str(folder)), HIGH - LOW
per_layer = {name: (high[name] - low[name]) // span for name in low}
per_layer["decode_token"] = (decode_counts(HIGH) - decode_counts(LOW)) // (span * TOKENS)
per_layer["compiled_decode_matmuls"] = (compiled_matmuls(HIGH) - compiled_matmuls(LOW)) // span
per_layer["compiled_decode_traced"] = (traced_instructions(HIGH) - traced_instructions(LOW)) // span
import peft, transformers
print(json.dumps({"per_layer": per_layer, "versions": {"torch": torch.__version__,
                  "transformers": transformers.__version__, "peft": peft.__version__}}))
'''

PASSES = {"ppo_update": "PPO update: policy and value rows, one routed pass, forward + recompute + backward",
          "grpo_update": "GRPO update: policy rows, forward + recompute + backward",
          "ppo_scoring": "PPO scoring: reference, value and reward rows, one routed pass, no grad",
          "grpo_scoring": "GRPO scoring: reference and reward rows, one routed pass, no grad",
          "decode_token": "decoding: one forward per token from the dense copy of a 4-bit base, 4 rows, eager",
          "compiled_decode_matmuls": "decoding, compiled (`--decode compiled`): matmuls in the step's graph, each a "
                                     "GEMM launched per token on a GPU (the same copy and rows)",
          "compiled_decode_traced": "decoding, compiled: bytecode instructions dynamo traces to compile the step, "
                                    "its layers as regions (the same copy and rows)"}


# The architectures counted: the tiny Llama preset, and Qwen2's (q/k/v biases, its own modeling code) at the same
# tiny sizes. A 7B's layers are these layers' larger copies: the operations per layer are the same.
ARCHITECTURES = {"llama": ("tiny-llama", ""),
                 "qwen2": ("qwen2.5-7b", "hidden_size=64,intermediate_size=172,num_attention_heads=4,"
                                         "num_key_value_heads=2,vocab_size=512")}


def inductor_settings() -> dict[str, str]:
    """The caller's TORCHINDUCTOR_* settings (its cache folder, its CPU kernels' vectorisation): the counts are of
    graphs and dispatched operations, which they leave as they are."""
    return {key: value for key, value in os.environ.items() if key.startswith("TORCHINDUCTOR_")}


def figures(spec: str, architecture: str = "llama", layers: str = "2,4") -> dict:
    """The counts at `spec`: a git revision, or REVISION@FOLDER to import the libraries in FOLDER (an unpacked
    wheel, e.g. another transformers) ahead of this environment's; per layer from models of `layers` layers."""
    revision, _, libraries = spec.partition("@")
    with revision_tree(revision) as (sha, tree):
        path = os.pathsep.join(filter(None, (str(tree), libraries and str(Path(libraries).resolve()))))
        done = subprocess.run([sys.executable, "-c", COUNTING, *ARCHITECTURES[architecture], layers], cwd=tree,
                              capture_output=True, text=True, timeout=600,
                              env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                   "OMP_NUM_THREADS": "1", **inductor_settings()})
    if done.returncode != 0:
        raise RuntimeError(f"counting at {spec} failed: {done.stderr.strip()[-2000:]}")
    counted = json.loads(done.stdout.strip().splitlines()[-1])
    return {"revision": sha, "libraries": libraries or None, **counted}


def column(run: dict, runs: list[dict]) -> str:
    """A revision's column heading: its sha, and the library versions where the columns differ in them."""
    differ = [name for name in ("transformers", "peft", "torch")
              if len({r.get("versions", {}).get(name) for r in runs}) > 1]
    return f"`{run['revision']}`" + "".join(f" {name} {run['versions'][name]}" for name in differ)


def markdown(data: dict) -> str:
    runs = data["revisions"]
    versions = sorted({", ".join(f"{k} {v}" for k, v in r.get("versions", data["versions"]).items()) for r in runs})
    lines = ["# Operations launched per decoder layer", "", f"- date: {data['date']}; git `{data['git_revision']}`",
             f"- command: `{data['command']}`", f"- architecture: {data.get('architecture', 'llama')}",
             *([f"- layers: per layer from {data['layers'].replace(',', ' and ')} layers"]
               if data.get("layers", "2,4") != "2,4" else []),
             "- versions: " + "; ".join(versions),
             "- what: " + " ".join(__doc__.split("\n\n")[2].split()), "",
             *table_lines(["pass", *(column(r, runs) for r in runs)], "l" + "r" * len(runs),
                          [[label, *(r["per_layer"].get(key, "-") for r in runs)] for key, label in PASSES.items()])]
    return "\n".join(lines) + "\n"


def layer_pair(text: str) -> str:
    """`--layers LOW,HIGH`: two layer counts, the second the larger."""
    import argparse

    try:
        low, high = (int(n) for n in text.split(","))
    except ValueError:
        low = high = 0
    if not 1 <= low < high:
        raise argparse.ArgumentTypeError(f"{text!r}: give two layer counts, the second the larger, like 2,4")
    return f"{low},{high}"


def main(argv: Optional[list[str]] = None) -> dict:
    return main_at_revisions("launches", __doc__, figures, markdown, argv, options={
        "--architecture": dict(default="llama", choices=sorted(ARCHITECTURES),
                               help="the architecture counted: llama (tiny-llama) or qwen2 (Qwen2.5's, at its sizes)"),
        "--layers": dict(default="2,4", type=layer_pair,
                         help="the two layer counts whose models' difference, per layer, is counted (1,2: the "
                              "smallest, fewer operations to compile)")})


if __name__ == "__main__":
    run(main)
