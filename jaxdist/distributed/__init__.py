"""Running on many devices and hosts: launch (`jax.distributed` from flags, env, SLURM, OpenMPI,
Kubernetes), mesh strings, logical sharding rules, XLA flags, host offload's memory kinds, and the
collectives a compiled program sends (hlo.py, with the ring model that costs them)."""
