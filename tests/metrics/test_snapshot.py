"""The snapshot: JSON round trip, strict loading, atomic file, liveness of its daemon."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cgpu_km.daemon.snapshot import (
    DEFAULT_STATE_DIR,
    STATE_DIR_ENV,
    Snapshot,
    SnapshotError,
    read_snapshot,
    resolve_state_dir,
    snapshot_path,
    write_snapshot,
)
from cgpu_km.smi import daemon_status


def test_json_round_trip_keeps_every_field(known_snapshot: Snapshot) -> None:
    again = Snapshot.from_json(known_snapshot.to_json())
    assert again == known_snapshot
    assert again.containers[0].processes[1].memory_bytes == 512 << 20
    assert again.gpus[1].utilization is None
    assert json.loads(known_snapshot.to_json())["format"] == 1


def test_lookup_by_gpu_and_name(known_snapshot: Snapshot) -> None:
    web = known_snapshot.container(0, "web")
    assert web is not None
    assert web.highprio
    assert known_snapshot.container(1, "web") is None
    gpu = known_snapshot.gpu(1)
    assert gpu is not None
    assert gpu.uuid.endswith("001")
    assert known_snapshot.gpu(2) is None


def _mutated(snapshot: Snapshot, path: tuple[str | int, ...], value: object) -> str:
    data = snapshot.to_dict()
    node: Any = data  # objects and arrays on the way down: str and int keys
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("format",), 2, "snapshot: format 2, expected 1"),
        (("gpus", 0, "index"), "0", "snapshot.gpus[0].index: expected int"),
        (("gpus", 0, "index"), True, "snapshot.gpus[0].index: expected an integer"),
        (("containers", 0, "processes"), {}, "snapshot.containers[0].processes: expected a list"),
        (("containers", 1, "name"), None, "snapshot.containers[1].name: expected str"),
        (("gpus", 1, "bogus"), 1, "snapshot.gpus[1]: unknown field 'bogus'"),
        (("pid",), 1.5, "snapshot.pid: expected int"),
    ],
)
def test_malformed_fields_are_named(known_snapshot: Snapshot, path: tuple[str | int, ...],
                                    value: object, message: str) -> None:
    with pytest.raises(SnapshotError, match="^" + re.escape(message)):
        Snapshot.from_json(_mutated(known_snapshot, path, value))


def test_missing_field_and_bad_json(known_snapshot: Snapshot) -> None:
    data = known_snapshot.to_dict()
    del data["gpus"][0]["uuid"]
    with pytest.raises(SnapshotError, match=r"snapshot.gpus\[0\]: missing field 'uuid'"):
        Snapshot.from_dict(data)
    with pytest.raises(SnapshotError, match="not JSON"):
        Snapshot.from_json('{"format": 1,')
    with pytest.raises(SnapshotError, match="expected a JSON object"):
        Snapshot.from_json("[]")


def test_int_accepted_where_float_expected(known_snapshot: Snapshot) -> None:
    loaded = Snapshot.from_json(_mutated(known_snapshot, ("period_seconds",), 1))
    assert loaded.period_seconds == 1.0
    assert isinstance(loaded.period_seconds, float)


def test_write_is_atomic_and_readable_by_all(known_snapshot: Snapshot, tmp_path: Path) -> None:
    path = tmp_path / "state" / "snapshot.json"
    write_snapshot(known_snapshot, path)
    assert read_snapshot(path) == known_snapshot
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["snapshot.json"]  # no temporary left


def test_read_absent_is_none_and_corrupt_is_an_error(tmp_path: Path) -> None:
    assert read_snapshot(tmp_path / "snapshot.json") is None
    (tmp_path / "snapshot.json").write_text("garbage")
    with pytest.raises(SnapshotError):
        read_snapshot(tmp_path / "snapshot.json")


def test_concurrent_readers_never_see_a_torn_file(known_snapshot: Snapshot,
                                                  tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    small = dataclasses.replace(known_snapshot, containers=())
    write_snapshot(known_snapshot, path)
    seen: list[int | None] = []
    errors: list[Exception] = []
    done = threading.Event()

    def read_all() -> None:
        while not done.is_set():
            try:
                loaded = read_snapshot(path)
            except (SnapshotError, OSError) as error:  # a torn or missing file
                errors.append(error)
                return
            seen.append(None if loaded is None else len(loaded.containers))

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        for i in range(300):
            write_snapshot(small if i % 2 else known_snapshot, path)
    finally:
        done.set()
        reader.join()
    assert errors == []
    assert set(seen) <= {0, 3}
    assert len(seen) > 10
    assert len(list(tmp_path.iterdir())) == 1


def test_state_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    assert resolve_state_dir() == DEFAULT_STATE_DIR == Path("/run/cgpu_km-daemon")
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert snapshot_path() == tmp_path / "snapshot.json"
    assert resolve_state_dir("/elsewhere") == Path("/elsewhere")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_daemon_running_needs_a_live_pid_and_a_fresh_snapshot(known_snapshot: Snapshot) -> None:
    def running(snapshot: Snapshot | None, now: float) -> bool:
        return daemon_status(snapshot, "", now).running

    now = time.time()
    live = dataclasses.replace(known_snapshot, pid=os.getpid(), timestamp=now - 1)
    assert running(live, now)
    assert not running(None, now)
    assert not running(dataclasses.replace(live, pid=_dead_pid()), now)
    # Period 0.05 s: stale after max(5 s, 10 periods) = 5 s.
    assert running(dataclasses.replace(live, timestamp=now - 4.9), now)
    assert not running(dataclasses.replace(live, timestamp=now - 5.1), now)
    # A long period stretches the limit to 10 periods.
    slow = dataclasses.replace(live, period_seconds=2.0, timestamp=now - 19)
    assert running(slow, now)
