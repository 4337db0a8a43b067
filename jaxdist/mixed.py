"""Float32 results from low-precision matmuls: weight gradients that are reduced in float32.

A weight gradient is a matmul that contracts the batch; under sharding, XLA reduces its partial sums
(all-reduce / reduce-scatter over the batch axes) in the matmul's output dtype, so a bf16 matmul
followed by `.astype(float32)` reduces in bf16 (checked in the partitioned HLO). Asking the matmul
itself for a float32 result keeps the reduction in float32 while the operands stay bf16. The dot
names its algorithm (bf16 operands, float32 accumulation: `DotAlgorithmPreset.BF16_BF16_F32`), which
XLA:CPU runs for these 2-D weight-gradient dots; it rejects some others ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32", seen with a 3-D einsum result), so callers flatten to 2-D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_F32 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32


def dot_general_f32(a, b, dimension_numbers):
    """`jax.lax.dot_general` with a float32 result, accumulated in float32."""
    precision = BF16_F32 if a.dtype == b.dtype == jnp.bfloat16 else None
    return jax.lax.dot_general(a, b, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)
