"""VRAM accounting, estimation and flag benchmarks."""
