"""Memory-optimized RLHF on one 4-bit base with switchable LoRA adapters."""
