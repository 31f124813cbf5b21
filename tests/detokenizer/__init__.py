"""The detokenizer: incremental decoding and stop strings in process, and the service between a real scheduler
and its owners."""
