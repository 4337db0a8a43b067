"""The processes of a multi-host run, apart from what runs inside them: `jax.distributed` initialised from
flags, env, SLURM, OpenMPI or Kubernetes (launch.py), and each command's supervisor and its peers, which
name a dead peer instead of hanging (supervisor.py, peers.py, peer_lines.py, peer_wire.py). JAX-free at
import: the supervisor never loads JAX."""
