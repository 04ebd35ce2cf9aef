"""RegionPort.apply writes only the gates whose want changed: after any run of
applies every region holds what one full write of the last apply would; and
a slice's end that has come is never moved while its gate stays open: the
gate closes and opens again. And a holder closes itself at its end only if
every one of its watching processes says it does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.dispatch import RegionPort
from cgpu_km.sched import IdleWatch
from tests.daemon.fakes import forged_region

NAMES = ("a", "b", "c", "d")

PAST, FUTURE = 1, 2**62  # a slice's end that has come, and one that has not

names = st.frozensets(st.sampled_from(NAMES))
ends = st.none() | st.tuples(st.sampled_from(NAMES), st.sampled_from((PAST, FUTURE, FUTURE + 1)))
applies = st.lists(
    st.tuples(names, names, st.sampled_from((0, region_mod.CONTENDED_QUEUE_NS)),
              st.none() | st.sampled_from(NAMES), st.booleans(), ends),
    min_size=1, max_size=12)
Run = tuple[frozenset[str], frozenset[str], int, str | None, bool, tuple[str, int] | None]


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, region_mod.Region]]:
    base: Path = tmp_path_factory.mktemp("regions")
    opened = {name: region_mod.Region.create(region_mod.region_path(name, base), name,
                                             [region_mod.GpuSpec(0, "", 0, 0)])
              for name in NAMES}
    yield opened
    for region in opened.values():
        region.close()


@given(applies)
# the watch moves between two holders whose gates stay open
@example(runs=[(frozenset("ab"), frozenset(), 0, "a", False, None),
               (frozenset("ab"), frozenset(), 0, "b", False, None)])
# a holder's end comes, and it is told another while its gate stays open
@example(runs=[(frozenset("a"), frozenset(), 0, None, False, ("a", PAST)),
               (frozenset("a"), frozenset(), 0, None, False, ("a", FUTURE))])
def test_apply_leaves_every_gate_as_a_full_write_would(
        regions: dict[str, region_mod.Region], runs: list[Run]) -> None:
    port = RegionPort(0)
    entries = {name: (region, 0) for name, region in regions.items()}
    port.set_entries(entries)
    port.open_all()  # every gate open, whatever the last example left
    told = dict.fromkeys(NAMES, 0)  # the ends the open gates were told
    for open_, armed, queue_ns, watched, new_entries, close_at in runs:
        if new_entries:  # a container restarted: the same regions, a new map
            port.set_entries(dict(entries))
        armed = armed - open_
        watch = None if watched is None else IdleWatch(watched, at=1.0, grace=0.002,
                                                        otherwise=2.0)
        closes = {name: region.close_seq(0) for name, region in regions.items()}
        was_open = {name for name, region in regions.items() if region.gate_is_open(0)}
        port.apply(open_, time.monotonic_ns(), queue_ns, armed, watch, close_at)
        for name in NAMES:
            end = close_at[1] if close_at is not None and close_at[0] == name else 0
            if name not in open_:
                told[name] = 0  # a closed gate's end is not read
                continue
            assert regions[name].close_at_ns(0) == end, name
            moved = name in was_open and told[name] not in (0, FUTURE, FUTURE + 1, end)
            assert regions[name].close_seq(0) == closes[name] + moved, (name, told[name], end)
            told[name] = end
        for name, region in regions.items():
            gate = (region_mod.GATE_OPEN if name in open_ else
                    region_mod.GATE_ARMED if name in armed else region_mod.GATE_CLOSED)
            assert region.gate(0) == gate, name
            assert region.queue_ns(0) == queue_ns, name
            grace = 2_000_000 if name == watched and name in open_ else 0
            assert region._gpu(0).idle_grace_ns == grace, name


def test_a_holder_closes_itself_at_its_end_only_if_every_watcher_says_so(
        tmp_path: Path) -> None:
    """A process of an older libcgpu (or one that says nothing) does not stop at
    the end it is told: while one watching process of the holder lacks
    `closes_itself` in its slot, the port says the holder does not close at its
    end (the dispatcher closes it then); a process that does not watch answers
    no close and is not asked. The holder closed itself once every watching
    process answered the close to come while its gate is open."""
    with forged_region(tmp_path, "a", 3) as (a, slots):
        port = RegionPort(0)
        port.set_entries({"a": (a, 0)})
        new, old, silent = (slot.gpu[0] for slot in slots)
        new.watching, new.closes_itself = 1, 1
        old.watching = 1

        def observed() -> tuple[bool, bool, bool]:
            seen = port.observe()["a"]
            return port.closes_at_end("a"), seen.closed_itself, seen.answered

        assert observed()[0] is False, "one watcher of two says nothing"
        old.closes_itself = 1
        assert observed()[0] is True
        new.watching = old.watching = 0
        assert observed()[0] is False, "no watcher: nobody closes it"
        new.watching = old.watching = 1

        a.set_gate(0, True)
        ahead = a.close_seq(0) + 1
        new.drained_seq = ahead
        assert observed() == (True, False, False), "one answer ahead of two"
        old.drained_seq = ahead
        silent.drained_seq = 0  # does not watch: its word is not read
        assert observed() == (True, True, False)
        a.set_gate(0, False)  # the daemon's close: the answers ahead are for it
        assert a.close_seq(0) == ahead
        assert observed() == (True, False, True)
