"""Shared fixtures: the real hh-rlhf rows from ../shared and the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer.config import DATA_ENV, SHARED_DATA

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Folder of the real hh-rlhf rows ($RLHF_DATA, else ../shared/data/hh-rlhf)."""
    path = Path(os.environ.get(DATA_ENV) or SHARED_DATA)
    if not path.exists():
        pytest.fail(f"hh-rlhf rows not found at {path}; set ${DATA_ENV}")
    return path


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (converted from the package's GGUF, cached)."""
    from trainer.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture
def fresh_accelerate_state():
    """In-process runs each make an Accelerator; forget the singletons of the previous one."""
    from trainer.pipeline import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()
