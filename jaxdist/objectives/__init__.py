"""The training objective (the `objective` config section): `registry` maps each `objective.method` to what
it brings; the preference losses as TRL computes them (losses.py); their gradient stage, reference and
held-out sums (pairs.py)."""
