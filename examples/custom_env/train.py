"""Train the log-count example from Python, durably: `python train.py` (from this folder)."""

from log_count import LogCount

import durable_rl

run = durable_rl.train({"env": LogCount, "n_steps": 6, "n_samples": 4})  # state in ./.durable-rl, as the CLI keeps it
for step in run.steps():
    print(f"step {step['step']}: mean reward {step['mean_reward']} over {step['n_trials']} trials")
print("status:", run.status, "· judge calls:", run.counters()["judge_calls"])
