"""onebase-rlhf: RLHF on one frozen base with switchable LoRA adapters.

The stages are the entry points at the top (`sft.py`, `reward.py`, `dpo.py`, `ppo.py`), beside the
user tools (`pipeline.py`, `evaluate.py`, `compare.py`, `run_report.py`), the settings (`config.py`)
and the losses (`losses.py`); `model/`, `data/`, `rl/` and `engine/` hold what they are built from.
"""
