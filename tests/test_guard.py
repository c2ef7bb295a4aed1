"""StabilityGuard: non-finite norms always skipped; spikes judged against the running median."""
import math

import pytest

from yatt.algos.guard import StabilityGuard


def test_non_finite_norms_are_always_skipped():
    guard = StabilityGuard(min_history=2, window=4)
    assert guard(math.nan) and guard(math.inf) and guard.skipped_non_finite == 2
    assert not guard(1.0) and list(guard.history) == [1.0]


def test_spikes_are_judged_once_there_is_history():
    guard = StabilityGuard(spike_factor=10.0, window=3, min_history=2)
    assert not guard(1.0) and not guard(50.0)  # one norm is not yet a history
    assert guard(300.0) and guard.skipped_spike == 1  # median(1, 50) = 25.5 -> limit 255
    assert not guard(200.0)
    for x in (2.0, 2.0, 2.0):  # the window forgets old norms
        assert not guard(x)
    assert list(guard.history) == [2.0, 2.0, 2.0] and guard(25.0)


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError):
        StabilityGuard(spike_factor=1.0)
    with pytest.raises(ValueError):
        StabilityGuard(window=2, min_history=3)


def test_zero_norms_do_not_drag_the_median_down():
    guard = StabilityGuard(spike_factor=10.0, window=4, min_history=2)
    for x in (2.0, 0.0, 0.0, 0.0, 3.0):  # steps whose groups all had equal rewards: grad norm 0
        assert not guard(x)
    assert list(guard.history) == [2.0, 3.0] and not guard(20.0) and guard(31.0)  # median 3 after 20
