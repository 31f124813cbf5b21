"""The scheduler: its outputs against transformers, batching policy, sampling, logit adjustments, structured
output, the step journal, the synthetic engine, rollout control."""
