"""The model runner: the model's forward over a step's flat batch, its attention and KV memory, weight updates,
and the synthetic stand-in."""
