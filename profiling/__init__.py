"""VRAM accounting: measure, predict, render. It imports `foundation` and nothing from `trainer/`.

- measure: `recorder.MemoryRecorder` (per-phase memory of a running stage: tensor walks on any
  device, allocator statistics and NVML on CUDA), `tensors`, `saved`, `device`, `decode`.
- predict: `predict` (the estimator; `shapes`, `optimizers`, `activations` hold the formulas),
  `resolve` (what 'auto' settings become), `advice` (what to change), `plan` (settings that fit a
  budget); `estimate` is its command line.
- render: `report` (JSON / Markdown / PNG and the report command), `chart`, `components` (the names).
"""
