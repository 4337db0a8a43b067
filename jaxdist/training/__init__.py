"""One training run: the compiled program (step.py), the loop (loop.py) and its per-step hooks
(hooks.py), the run folder (rundir.py)."""
