"""lib/schedule.py: the learning-rate schedule of train.py and scripts/compromise.py, a pure function of
the step."""
import math

import pytest

from lib.schedule import lr_factor


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    f = [lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_factor(500, 10, 100, 0.1) == pytest.approx(0.1)


def cosine(progress, floor=0.1):
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("step, warmup, factor", [
    (0, 10, 0.1), (8, 10, 0.9), (9, 10, 1.0), (10, 10, 1.0), (11, 10, cosine(1 / 90)),
    (99, 10, cosine(89 / 90)), (100, 10, 0.1), (150, 10, 0.1), (0, 0, 1.0), (99, 200, 0.5),
], ids=["first-step", "warmup-end-minus-1", "warmup-end", "peak", "warmup-end-plus-1", "last-step",
        "max-steps", "past-it", "no-warmup", "warmup-past-the-end"])
def test_the_schedule_at_its_boundaries(step, warmup, factor):
    """lib.schedule.lr_factor, train.py's and compromise.py's, over 100 steps to a floor of 0.1:
    the warmup's first update already moves, its last is at the peak, the cosine starts there and
    ends at the floor at max_steps, and stays there; no warmup starts at the peak, one longer than
    the run ends part way up."""
    assert lr_factor(step, warmup, 100, 0.1) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("max_steps, step, factor", [(11, 10, 1.0), (11, 11, 0.1), (12, 11, 0.55), (12, 12, 0.1)],
                         ids=["one-step-start", "one-step-end", "two-steps-half-way", "two-steps-end"])
def test_a_cosine_of_one_or_two_steps(max_steps, step, factor):
    """The shortest cosines after 10 warmup steps: one step (at the peak, then at the floor at max_steps), two
    (half way at 0.55)."""
    assert lr_factor(step, 10, max_steps, 0.1) == pytest.approx(factor, rel=1e-12)
