"""The wire layer (protos, generated stubs, the logprob arrays) and what every service shares (configuration,
stream following)."""
