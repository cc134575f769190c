"""Online RL on the shared base: rollout, the one scoring path, the PPO step, KL control, policy evaluation."""
