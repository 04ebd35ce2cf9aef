"""`ProcessRests`: how long a process rested before it launched or waited, from the
caller's looks alone."""

from __future__ import annotations

import pytest

from cgpu_km.sched import ProcessRests


def looks(rests: ProcessRests, *seen: tuple[float, int, bool]) -> list[float]:
    """One process looked at at each (time, launches, waiting); its rest at each look."""
    got = []
    for now, launches, waiting in seen:
        got.append(rests.look("p", launches, waiting, now))
        rests.end_round()
    return got


def test_a_process_first_seen_has_not_rested() -> None:
    assert looks(ProcessRests(), (5.0, 0, True)) == [0.0]


def test_a_wait_after_a_quiet_spell_is_a_rest_since_it_was_last_active() -> None:
    got = looks(ProcessRests(), (1.0, 3, False), (1.2, 3, False), (1.5, 3, True), (1.6, 3, True))
    assert got == [0.0, 0.0, pytest.approx(0.5), 0.0], "counted once, as the wait begins"


def test_a_launch_between_two_looks_rested_at_least_until_the_first() -> None:
    got = looks(ProcessRests(), (1.0, 3, False), (1.4, 3, False), (1.5, 4, False))
    assert got == [0.0, 0.0, pytest.approx(0.4)]


def test_a_busy_process_never_rests() -> None:
    seen = [(1.0 + i / 100, i, i % 2 == 0) for i in range(20)]
    assert set(looks(ProcessRests(), *seen)) == {0.0}


def test_a_process_not_looked_at_in_a_round_is_forgotten() -> None:
    rests = ProcessRests()
    rests.look("p", 1, False, 1.0)
    rests.end_round()
    rests.end_round()  # a round without it: it is gone
    assert rests.look("p", 1, True, 9.0) == 0.0, "a new process under an old name"
