"""Inside a process, over many devices: the platform set-up (simulated CPU devices, XLA flags), mesh strings,
logical sharding rules, host offload's memory kinds, and the collectives a compiled program sends (hlo.py,
with the ring model that costs them). The processes themselves (launch, supervisor, peers) are
`jaxdist.cluster`."""
