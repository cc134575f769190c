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


def main() -> None:
    from trainer.config import cache_dir

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:  # DeepSpeed is optional: its tests skip without it
        print(f"DeepSpeed ops not built: {err}")
        return
    get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
    print(f"DeepSpeed's cpu_adam op ready in {os.environ['TORCH_EXTENSIONS_DIR']}")


if __name__ == "__main__":
    main()
