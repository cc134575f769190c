"""The online-RL methods, each its maths on the shared step (`trainer.rl.step`): PPO (a critic, GAE, a KL
penalty in the reward), GRPO (group z-scores, a k3 loss term) and RLOO (leave-one-out, the KL in the reward)."""
