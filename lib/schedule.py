"""
The learning-rate schedule of every training loop here (train.py's, and scripts/compromise.py's
with its own warmup and floor): linear warmup, then cosine down to a floor. A pure function of the
step, so the step is all a resumed run needs. Importing this file has no side effects.
"""
import math


def lr_factor(step, warmup_steps, max_steps, min_lr_ratio):
    """Multiplier of each group's peak lr at update `step` (0-based): linear warmup, then cosine
    down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
