"""The daemon's port does not take a drain answer's date on trust (attack 11's fix).

A real region, written the way a lying process writes its slot: it answers
a close late and dates the answer early. `CheckedRegionPort` counts such an
answer from when it last saw it missing; an answer it never saw missing
keeps its own date.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km import region as region_mod
from cgpu_km.daemon_plane import CheckedRegionPort

SECOND = 1_000_000_000


class Clock:
    """A monotonic clock the test sets (nanoseconds)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def region(tmp_path: Path) -> Iterator[region_mod.Region]:
    made = region_mod.Region.create(tmp_path / "liar", "liar", [region_mod.GpuSpec(1 << 30)],
                                    gates_open=True)
    yield made
    made.close()


@pytest.fixture
def slot(region: region_mod.Region) -> Iterator[region_mod.ProcGpu]:
    """Slot 0's line for GPU 0, as the container's process maps it: live and watching."""
    fd = os.open(region.path / region_mod.ACCOUNT_NAME, os.O_RDWR)
    mapping = mmap.mmap(fd, region_mod.ACCOUNT_SIZE)
    os.close(fd)
    account = region_mod.AccountLayout.from_buffer(mapping)
    account.slots_used = 1
    account.proc[0].pid = 4242
    account.proc[0].state = region_mod.SLOT_LIVE
    line = account.proc[0].gpu[0]
    line.watching = 1
    yield line
    del account, line
    with contextlib.suppress(BufferError):  # the test's view of the slot may live on
        mapping.close()


def answer(line: region_mod.ProcGpu, seq: int, drained_s: float) -> None:
    line.drained_ns = int(drained_s * SECOND)
    line.drained_seq = seq


def test_a_late_answer_dated_early_counts_from_when_it_was_last_seen_missing(
    region: region_mod.Region, slot: region_mod.ProcGpu
) -> None:
    clock = Clock()
    port = CheckedRegionPort(0, clock=clock)
    port.set_entries({"liar": (region, 0)})
    region.set_gate(0, False)  # a close: close_seq 1
    clock.now = 10 * SECOND
    assert not port.observe()["liar"].answered
    answer(slot, region.close_seq(0), drained_s=1.0)  # "my work finished at 1 s"
    clock.now = 11 * SECOND
    seen = port.observe()["liar"]
    assert seen.answered
    assert seen.drained_at == 10.0  # it was still missing at 10 s


def test_an_answer_never_seen_missing_keeps_its_date(
    region: region_mod.Region, slot: region_mod.ProcGpu
) -> None:
    clock = Clock()
    port = CheckedRegionPort(0, clock=clock)
    port.set_entries({"liar": (region, 0)})
    region.set_gate(0, False)
    answer(slot, region.close_seq(0), drained_s=12.5)
    clock.now = 13 * SECOND
    seen = port.observe()["liar"]
    assert (seen.answered, seen.drained_at) == (True, 12.5)
