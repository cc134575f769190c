"""Benchmarks that compare this trainer with others; results under benchmarks/results/."""
