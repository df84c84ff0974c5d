"""hcstudy/durations.py: durations as people read them, one way everywhere."""
import pytest

from hcstudy import durations


@pytest.mark.parametrize("seconds, text", [((45,), "45 s"), ((0.12, 0.19), "120-190 ms"), ((1800, 3600), "30-60 min"),
                                           ((9000, 18360), "2.5-5.1 h"), ((37800, 70920), "10.5-19.7 h"), ((5e-4,), "500 us")])
def test_durations_in_the_unit_that_suits_the_largest(seconds, text):
    assert durations.duration(*seconds) == text


def test_a_clock_rounds_up_and_keeps_hours_past_a_day():
    assert durations.clock(9000) == "2:30:00" and durations.clock(0.2) == "0:00:01"
    assert durations.clock(26 * 3600 + 61) == "26:01:01" and durations.clock(float("nan")) == "–"
