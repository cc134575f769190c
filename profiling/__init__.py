"""VRAM accounting, estimation and flag benchmarks; the lowest layer: it imports nothing from `trainer/`.

- measure: `recorder.MemoryRecorder` (per-phase memory of a running stage: tensor walks on any
  device, allocator statistics and NVML on CUDA), `tensors`, `saved`, `device`.
- predict: `predict` (the estimator; `shapes`, `optimizers`, `activations` hold the formulas),
  `advice` (what to change), `seed` (the comparison with seed 000's breakdown); `estimate` is its CLI.
- render: `report` (JSON / Markdown / PNG and the report CLI), `chart`, `provenance`.
- shared with the trainer: `stages` (which adapters each stage has), `resolve` (what 'auto' settings
  become), `cli` (argument parsing, checks and one-line errors), `files` (atomic writes), `components`.
- `bench`: the flag ladder, running the real stage scripts.
"""
