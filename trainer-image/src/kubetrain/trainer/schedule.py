"""Linear warmup then cosine decay to minLr, as a LambdaLR factor of the peak lr."""

from __future__ import annotations

import math

from kubetrain.core.api import OptimizerSpec


def lr_factor(step: int, opt: OptimizerSpec, max_steps: int) -> float:
    """Multiplier of ``opt.lr`` for the optimizer step with 0-based index ``step``."""
    if opt.warmup_steps > 0 and step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    decay = max(1, max_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / decay)
    floor = opt.min_lr / opt.lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
