"""MXFP4 de-quantisation of gpt-oss's published expert tensors, as transformers' own
`transformers.integrations.mxfp4.convert_moe_packed_tensors` does it (numpy; no JAX, no torch).

The checkpoints store each expert matrix as `<name>_blocks` (E, R, G, 16) uint8 — 32 FP4 (e2m1) codes
per block, two per byte, the low nibble first — and `<name>_scales` (E, R, G) uint8, one e8m0 exponent per
block (2^(s - 127)). The value is e2m1(code) x 2^(s - 127); the result (E, R, G x 32) is transposed to
(E, G x 32, R): gate_up_proj_blocks (E, 2F, D/32, 16) -> (E, D, 2F), down_proj_blocks (E, D, F/32, 16) ->
(E, F, D), the layouts of the de-quantised checkpoint's `gate_up_proj` / `down_proj`.

Every e2m1 value times a power of two is exact in float32 (and in bfloat16: at most 2 significant bits)
as long as it stays in range, so float32 here equals transformers' bfloat16 output entry for entry.
"""

from __future__ import annotations

import numpy as np

# e2m1 codes 0..15: sign bit, 2 exponent bits, 1 mantissa bit (transformers' FP4_VALUES)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(E, R, G, 16) uint8 codes and (E, R, G) uint8 exponents -> (E, G x 32, R) float32."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.ndim != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} must be (E, R, G, 16) and (E, R, G)")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    with np.errstate(over="ignore"):  # 6 x 2^127 is inf, in transformers' bfloat16 too
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    E, R, G, _ = blocks.shape
    return np.ascontiguousarray(values.reshape(E, R, G * 32).transpose(0, 2, 1))
