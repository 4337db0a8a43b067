"""The optimizer (the `optim` config section): one optax chain, clip + AdamW + schedule (adamw.py)."""
