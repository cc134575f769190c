"""VRAM accounting, estimation and flag benchmarks.

- `recorder.MemoryRecorder`: per-phase memory of a running stage (tensor walks on any device,
  allocator statistics and NVML on CUDA); `report`: its JSON / Markdown / PNG and the report CLI.
- `estimate`: the analytic estimator and its CLI (`shapes`, `optimizers`, `activations` hold the
  formulas, `advice` what to change, `seed` the comparison with seed 000's breakdown).
- `components`: the component names and byte units shared by all of them.
"""
