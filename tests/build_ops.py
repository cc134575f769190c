"""Compile DeepSpeed's CPU Adam op (cpu_adam) once, before the suite, into the cache the DeepSpeed
tests use ($TORCH_EXTENSIONS_DIR, else the project cache): inside the suite the build would compete
with the test workers. The tests' launches skip DeepSpeed's shared-memory all-reduce op
(tests/test_distributed.py). A no-op (a few seconds) when the op is already cached.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def without_debug_info() -> None:
    """DeepSpeed's cpu_adam op compiled without debug information (-g), which the tests never read and which
    costs its build a third of its time; the same machine code. Every process that loads the op calls this:
    the build cache keys on the compiler flags, so a process with other flags would build it anew."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().get_op_builder("CPUAdamBuilder")
    flags = builder.cxx_args
    builder.cxx_args = lambda self: [flag for flag in flags(self) if flag != "-g"]


def main() -> None:
    from trainer.config import cache_dir

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:  # DeepSpeed is optional: its tests skip without it
        print(f"DeepSpeed ops not built: {err}")
        return
    without_debug_info()
    get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
    print(f"DeepSpeed's cpu_adam op ready in {os.environ['TORCH_EXTENSIONS_DIR']}")


if __name__ == "__main__":
    main()
