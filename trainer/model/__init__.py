"""The model side: loading the base (presets, NF4, attention, checkpointing) and the shared-base
multi-adapter model."""
