"""Muon against the reference nobody here wrote: make `tests/fixtures/muon/torch_muon.npz` with
`torch.optim.Muon` (torch >= 2.9; not a suite dependency).

    /work/venvs/ref/bin/python scripts/make_muon_fixture.py

Fixed float32 matrices and, per step, fixed gradients (seeded normal draws; 4 steps) go through
`torch.optim.Muon(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True|False, adjust_lr_fn=...)`;
the parameters after every step are saved. Cases: `match_rms_adamw` (Moonlight's 0.2·sqrt(max(A,B)),
jaxdist's default) and `original` (sqrt(max(1, A/B))), with and without Nesterov, each twice:

- `bf16`: torch exactly as shipped (its Newton–Schulz runs in bfloat16);
- `f32`: the same torch code with the bfloat16 cast of the Newton–Schulz input made a float32 copy
  (`torch.Tensor.bfloat16` patched for the duration of `step()`), everything else torch's.

torch's weights are (out, in); jaxdist stores (in, out) and stacks layers: the fixture's tensors are
saved in jaxdist's layout (`w_DF` (in 16, out 24), `w_FD` (in 24, out 16), `stack_LDF` 3 layers of
(in 8, out 12), `wo_LNHD` 2 layers of (in 2 heads × 4 head_dim, out 16)) and torch sees each matrix
transposed. tests/test_optimizers.py::test_muon_matches_torch runs jaxdist's Muon on the same inputs.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "muon" / "torch_muon.npz"
STEPS, LR, WD = 4, 0.02, 0.1
# name -> (jaxdist shape, number of leading stacked axes, number of fan-in axes after them)
SHAPES = {
    "w_DF": ((16, 24), 0, 1),
    "w_FD": ((24, 16), 0, 1),
    "stack_LDF": ((3, 8, 12), 1, 1),
    "wo_LNHD": ((2, 2, 4, 16), 1, 2),
}


@contextlib.contextmanager
def float32_newton_schulz():
    """torch's Newton–Schulz casts its input with `.bfloat16()`: make that a float32 copy."""
    cast = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *a, **k: self.clone()
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = cast


def matrices(x: np.ndarray, stacked: int, fan_in: int) -> np.ndarray:
    """jaxdist layout -> (matrices, in, out)."""
    lead = int(np.prod(x.shape[:stacked])) if stacked else 1
    rest = x.shape[stacked:]
    return x.reshape(lead, int(np.prod(rest[:fan_in])), int(np.prod(rest[fan_in:])))


def run(params0: dict, grads: list[dict], scale: str, nesterov: bool, f32: bool) -> list[dict]:
    torch_params, layout = [], []
    for name, x in params0.items():
        _, stacked, fan_in = SHAPES[name]
        for m in matrices(x, stacked, fan_in):
            torch_params.append(torch.nn.Parameter(torch.tensor(m.T.copy())))  # (out, in)
            layout.append(name)
    opt = torch.optim.Muon(torch_params, lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov, adjust_lr_fn=scale)
    out = []
    for g in grads:
        flat = [m for name, x in g.items() for m in matrices(x, *SHAPES[name][1:])]
        for p, m in zip(torch_params, flat):
            p.grad = torch.tensor(m.T.copy())
        with float32_newton_schulz() if f32 else contextlib.nullcontext():
            opt.step()
        after = {}
        for name, x in params0.items():
            ms = [p.detach().numpy().T for p, n in zip(torch_params, layout) if n == name]
            after[name] = np.stack(ms).reshape(x.shape)
        out.append(after)
    return out


def main() -> int:
    print(f"torch {torch.__version__}")
    rng = np.random.default_rng(0)
    params0 = {k: (0.05 * rng.standard_normal(s)).astype(np.float32) for k, (s, _, _) in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, (s, _, _) in SHAPES.items()} for _ in range(STEPS)]
    arrays = {f"param0/{k}": v for k, v in params0.items()}
    arrays.update({f"grad{t}/{k}": v for t, g in enumerate(grads) for k, v in g.items()})
    for scale in ("match_rms_adamw", "original"):
        for nesterov in (True, False):
            for f32 in (True, False):
                case = f"{scale}/{'nesterov' if nesterov else 'plain'}/{'f32' if f32 else 'bf16'}"
                for t, after in enumerate(run(params0, grads, scale, nesterov, f32)):
                    arrays.update({f"{case}/step{t}/{k}": v for k, v in after.items()})
    arrays["lr_wd_steps"] = np.array([LR, WD, STEPS])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(arrays)} arrays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
