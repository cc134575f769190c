"""Compile DeepSpeed's CPU ops (cpu_adam, shm_comm) once, before the suite, into the cache the
DeepSpeed tests use ($TORCH_EXTENSIONS_DIR, else the project cache). Alone on the machine the build
takes ~2 min on 2 cores; inside the suite it competed with the other test worker for ~4 min.
A no-op (a few seconds) when the ops are already cached.
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
    accelerator = get_accelerator()
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        accelerator.create_op_builder(name).load(verbose=False)
    print(f"DeepSpeed CPU ops ready in {os.environ['TORCH_EXTENSIONS_DIR']}")


if __name__ == "__main__":
    main()
