"""Plain, obviously-correct implementations: the ground truth for every fast path in lmhead.

Each function here is written for clarity, not speed — full-vocabulary sorts, full [N,V] logits, Python loops
where they make the definition plain. Tests compare lmhead's fast paths against these with
`torch.testing.assert_close` at per-dtype tolerances (see `TOLERANCES`).
"""

from __future__ import annotations

import torch

# (rtol, atol) per dtype, used by tests that compare a fast path with its reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-10, 1e-12),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    rtol, atol = TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


# --- head -------------------------------------------------------------------------------------------------

# --- sampling ---------------------------------------------------------------------------------------------

# --- loss -------------------------------------------------------------------------------------------------

# --- distributed ------------------------------------------------------------------------------------------

# --- compressed head --------------------------------------------------------------------------------------
