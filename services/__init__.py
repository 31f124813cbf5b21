"""flatwire: an LLM serving pipeline whose top-k logprobs travel as flat arrays."""
