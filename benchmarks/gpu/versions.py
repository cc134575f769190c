"""The versions the GPU machine runs with (every part's manifest and versions.json): Python, torch and CUDA, the libraries."""

from __future__ import annotations

import platform

LIBRARIES = ("torch", "transformers", "tokenizers", "peft", "accelerate", "bitsandbytes", "deepspeed", "trl",
             "datasets", "safetensors", "nvidia-ml-py", "pytest")


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    from foundation.provenance import library_versions

    return {**out, **library_versions(LIBRARIES)}

