"""The scheduling policy and the engine thread that runs it: which requests run each step, rollout control."""
