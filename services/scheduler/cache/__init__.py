"""KV memory as the scheduling policy sees it: the pages (who holds which) and the prefix cache over them."""
