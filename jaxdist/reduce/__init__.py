"""The gradient stage and the data-parallel reduction (the `reduce` config section): `registry` maps
each `reduce.method` to what it brings; token-weighted gradients and micro-batch accumulation
(gradients.py), explicit reduction (explicit.py), codecs (compress.py), DGC, DeMo, DiLoCo."""
