"""What every stage runs in: setup, the harness (resume, progress, metrics, NaN policy, evaluation and
checkpoint cadence, memory phases), launch modes, optimizers, checkpoints, the memory budget check."""
