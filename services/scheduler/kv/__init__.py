"""The KV memory: what each kind of layer keeps per token (specs.py), the tensors that hold it (pool.py), its
pages (pages.py) and prefix cache (prefix_cache.py), and their one owner, the KV manager (manager.py)."""
