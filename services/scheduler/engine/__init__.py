"""The engine: its thread and step (engine.py), the scheduling policy it runs (policy.py), and rollout control
(rollout.py, the commands in control.py)."""
