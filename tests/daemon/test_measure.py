"""`attribution.measure` against a real region and a real process in a pid namespace of its
own: which processes count as having bypassed libcgpu, and what is published for libcgpu."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Set
from pathlib import Path

import pytest

from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.attribution import Attribution, measure
from cgpu_km.dataplane.plane import RegionPlane
from cgpu_km.dataplane.registry import Registry

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None,
                                reason="a pid namespace needs unshare(1)")
MIB = 1 << 20


def claim_slot(region_dir: Path, info: kernelview.ProcessInfo, index: int = 0) -> None:
    """Write a live slot for the process, as its libcgpu does before it makes a context."""
    fd = os.open(region_dir / region_mod.ACCOUNT_NAME, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, region_mod.ACCOUNT_SIZE)
    finally:
        os.close(fd)
    account = region_mod.AccountLayout.from_buffer(mapped)
    slot = account.proc[index]
    slot.pid, slot.pidns, slot.start_time = info.inner_pid, info.pidns, info.start_time
    slot.state = region_mod.SLOT_LIVE
    account.slots_used = max(account.slots_used, index + 1)
    del slot, account
    mapped.close()


class ClaimingNvml:
    """NVML that lists `pid` with `size` bytes on GPU 0; with `claim_at_read`, the process
    claims its slot just before NVML shows its context (after the daemon's first look)."""

    def __init__(self, region_dir: Path, info: kernelview.ProcessInfo, size: int,
                 claim_at_read: bool) -> None:
        self.region_dir, self.info, self.size = region_dir, info, size
        self.claim_at_read = claim_at_read

    def memory_by_pid(self) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        if self.claim_at_read:
            claim_slot(self.region_dir, self.info)
        return {(0, self.info.pid): self.size}, {0: self.size}


@pytest.fixture
def container(tmp_path: Path) -> Iterator[tuple[Registry, kernelview.ProcessInfo]]:
    """A region for container "c" whose owner is a `sleep` in a new pid namespace."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    try:
        inner = 0
        for _ in range(200):
            children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
            if children:
                inner = int(children[0])
                break
            time.sleep(0.01)
        info = kernelview.process_info(inner)
        assert info is not None
        assert info.inner_pid == 1
        region = region_mod.Region.create(tmp_path / "c", "c", [region_mod.GpuSpec(512 * MIB)])
        region.close()
        owner = kernelview.owner_of(inner)
        assert owner is not None
        kernelview.write_owner(tmp_path / "c", owner)
        registry = Registry(tmp_path)
        registry.attach({0: {"c"}})
        yield registry, info
    finally:
        outer.kill()
        outer.wait()


@pytest.mark.parametrize("claim_at_read", [False, True], ids=["no-slot", "slot-claimed-late"])
def test_a_process_is_unmanaged_only_if_it_has_no_slot_after_nvml_saw_it(
    container: tuple[Registry, kernelview.ProcessInfo], tmp_path: Path, claim_at_read: bool
) -> None:
    registry, info = container
    nvml = ClaimingNvml(tmp_path / "c", info, 64 * MIB, claim_at_read)
    view = measure(registry, nvml, Attribution())  # type: ignore[arg-type]
    found = view.by_container[0, "c"]
    assert dict(found.procs) == {info.pid: 64 * MIB}
    assert found.unmanaged == (frozenset() if claim_at_read else frozenset({info.pid}))
    assert view.seen == {"c": (region_mod.Seen(0, info.pidns, 1, info.start_time, 64 * MIB),)}


def test_the_plane_publishes_what_it_measured_in_the_region(
    container: tuple[Registry, kernelview.ProcessInfo], tmp_path: Path
) -> None:
    registry, info = container
    nvml = ClaimingNvml(tmp_path / "c", info, 64 * MIB, claim_at_read=False)
    plane = RegionPlane(tmp_path, nvml)  # type: ignore[arg-type]
    plane.registry = registry
    plane.memory()
    plane.memory()
    with region_mod.Region.open(tmp_path / "c") as region:
        assert region.seen_rounds == 2
        assert region.seen() == [region_mod.Seen(0, info.pidns, 1, info.start_time, 64 * MIB)]


def test_a_slot_claimed_while_the_daemon_reclaims_is_not_taken(
    container: tuple[Registry, kernelview.ProcessInfo], tmp_path: Path
) -> None:
    """A reclaim round asks the kernel about the slots it saw, then frees those it
    found gone: a slot claimed in between was never asked about, so it is left
    for the next round (a process starting then lost its slot, and the memory
    counted in it, before)."""
    registry, info = container
    claim_slot(tmp_path / "c", info)
    found = kernelview.process_info(os.getpid())
    assert found is not None
    newcomer: kernelview.ProcessInfo = found  # narrowed for the class below

    class ClaimingAttribution(Attribution):
        def running(self, slots: Set[tuple[int, int, int]]) -> set[tuple[int, int, int]]:
            claim_slot(tmp_path / "c", newcomer, index=1)  # after the round's look
            return super().running(slots)

    plane = RegionPlane(tmp_path, nvml=None)
    plane.registry = registry
    plane.attribution = ClaimingAttribution()
    assert plane.reclaim() == 0
    with region_mod.Region.open(tmp_path / "c") as region:
        assert sorted(view.slot for view in region.processes()) == [0, 1]


def test_the_owner_index_is_built_once_for_each_attachment(
    container: tuple[Registry, kernelview.ProcessInfo], tmp_path: Path
) -> None:
    registry, info = container
    attribution = Attribution()
    keys = registry.keys()
    index = registry.owner_index(keys, attribution.host, attribution.proc)
    assert index.find(info) == "c"
    assert registry.owner_index(keys, attribution.host, attribution.proc) is index
    assert registry.owner_index(keys, attribution.host, str(tmp_path)) is not index
    # A container that leaves: the next attachment's keys, a new index without it.
    registry.attach({0: set()})
    after = registry.owner_index(registry.keys(), attribution.host, attribution.proc)
    assert after is not index
    assert after.find(info) is None
