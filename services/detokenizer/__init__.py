"""The detokenizer service."""
