"""The optimizer (the `optim` config section): `optim.name` -> its optax transformation (registry.py:
AdamW, Muon, Lion), the LR schedules (adamw.py, WSD in schedules.py)."""
