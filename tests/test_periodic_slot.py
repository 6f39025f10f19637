"""Each pod's periodic saves fall at its own point of every interval: the same on every replica, spread over the
interval, and a late save does not push the next one later."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.checkpoint.periodic import periodic_slot

pods = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=40)
intervals = st.floats(min_value=0.5, max_value=3600)
times = st.floats(min_value=1e9, max_value=2e9)


@given(pods, intervals, times)
def test_the_next_slot_is_after_the_moment_and_within_an_interval(pod: str, interval: float, after: float) -> None:
    slot = periodic_slot(pod, interval, after)
    assert after < slot <= after + interval * (1 + 1e-9)


@given(pods, intervals, times, st.floats(min_value=0.0, max_value=0.49))
def test_a_late_start_keeps_the_next_save_one_interval_after_the_slot(
    pod: str, interval: float, after: float, late: float
) -> None:
    slot = periodic_slot(pod, interval, after)
    started = slot + late * interval  # the save began late (its slot was busy)
    following = periodic_slot(pod, interval, started + interval / 2)
    assert abs(following - (slot + interval)) <= interval * 1e-6


def test_a_fleets_slots_are_spread_over_the_interval() -> None:
    interval, now = 60.0, 1_800_000_000.0
    offsets = sorted(periodic_slot(f"pod-{i}", interval, now) - now for i in range(2000))
    tenths = [sum(1 for o in offsets if k * 6 <= o < (k + 1) * 6) for k in range(10)]
    assert min(tenths) > 120 and max(tenths) < 280, tenths  # ~200 each, none crowded
