"""cgpu_km.container.inroot on a folder of this host (no container, no root needed):
every walk stays inside the folder, whatever its links say, and says where
it would leave the folder's own mount."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpu_km.container.inroot import (
    PRELOAD_CAP,
    InRootError,
    MountInfo,
    Root,
    container_tmpfs,
    parse_mountinfo,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[tuple[Path, Root]]:
    folder = tmp_path / "rootfs"
    (folder / "etc").mkdir(parents=True)
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        yield folder, Root(fd)
    finally:
        os.close(fd)


def made(root: Root, path: str) -> str:
    """Make the file at `path` as the hook does; the container's path it landed at."""
    entry = root.file_target(path)
    entry.close()
    return entry.path


def test_links_resolve_inside_the_root_and_folders_are_made_there(
        root: tuple[Path, Root], tmp_path: Path) -> None:
    folder, walker = root
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "etc" / "ld.so.preload").symlink_to(outside / "x")
    (folder / "run").symlink_to("../../../../.." + str(outside))
    assert made(walker, "/etc/ld.so.preload") == f"{outside}/x"
    assert (folder / str(outside).lstrip("/") / "x").is_file()
    assert made(walker, "/run/cgpu/control") == f"{outside}/cgpu/control"
    assert list(outside.iterdir()) == []


def test_a_file_of_the_image_is_used_not_truncated(root: tuple[Path, Root]) -> None:
    folder, walker = root
    (folder / "etc" / "ld.so.preload").write_text("/lib/own.so\n")
    assert made(walker, "/etc/ld.so.preload") == "/etc/ld.so.preload"
    assert walker.read_small_file("/etc/ld.so.preload") == b"/lib/own.so\n"
    assert walker.read_small_file("/etc/missing") is None
    assert walker.read_small_file("/nowhere/missing") is None


@pytest.mark.parametrize(("build", "message"), [
    (lambda f: (f / "etc" / "ld.so.preload").symlink_to("ld.so.preload"),
     "/etc/ld.so.preload in the image is a loop of links"),
    (lambda f: (f / "etc" / "ld.so.preload").mkdir(),
     "/etc/ld.so.preload in the image is a folder, not a file"),
    (lambda f: os.mkfifo(f / "etc" / "ld.so.preload"),
     "/etc/ld.so.preload in the image is a pipe, not a file"),
    (lambda f: (f / "etc" / "ld.so.preload").write_bytes(b"#" * (PRELOAD_CAP + 1)),
     "/etc/ld.so.preload in the image is larger than 64 KiB"),
    (lambda f: ((f / "bin").write_text(""), (f / "etc" / "ld.so.preload").symlink_to("/bin/x")),
     "/etc/ld.so.preload in the image passes through /bin, which is a file, not a folder"),
])
def test_what_is_not_a_small_regular_file_is_refused(
        root: tuple[Path, Root], build: object, message: str) -> None:
    folder, walker = root
    assert callable(build)
    build(folder)
    with pytest.raises(InRootError) as caught:
        walker.read_small_file("/etc/ld.so.preload")
    assert str(caught.value) == message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["..", ".", "etc", "a", "/", "l1", "l2", "//"]), max_size=12),
       st.sampled_from(["/", "..", "../..", "/etc", "a/..", "/l2"]),
       st.sampled_from(["/", "..", "etc/..", "/l1/../.."]))
def test_no_walk_ends_outside_the_root(parts: list[str], one: str, two: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "rootfs"
        (folder / "etc").mkdir(parents=True)
        (folder / "l1").symlink_to(one)
        (folder / "l2").symlink_to(two)
        fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
        try:
            entry = Root(fd).resolve("/" + "/".join(parts) + "/leaf", make_folders=False)
        except (FileNotFoundError, InRootError):
            return
        finally:
            os.close(fd)
        try:
            where = os.readlink(f"/proc/self/fd/{entry.parent}")
            assert Path(where) == folder or folder in Path(where).parents, where
            assert entry.path.endswith("/leaf")
        finally:
            entry.close()


MOUNTINFO = """\
1 0 0:1 / / rw - overlay overlay rw
2 1 0:2 / /dev rw,nosuid - tmpfs tmpfs rw,mode=755
3 1 0:3 / /run rw master:4 - tmpfs tmpfs rw
4 1 0:4 /volumes/x /data rw shared:9 - ext4 /dev/sda1 rw
5 1 0:5 / /tmp rw shared:7 - tmpfs tmpfs rw
6 1 0:6 / /proc rw - proc proc rw
bad line
"""


def test_mountinfo_and_the_container_s_own_tmpfs() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert sorted(mounts) == [1, 2, 3, 4, 5, 6]
    assert mounts[4] == MountInfo("/volumes/x", "ext4", True, "0:4")
    assert [container_tmpfs(mounts[i], path) for i, path in
            [(2, "/dev"), (2, "/dev/shm"), (3, "/run"), (4, "/data"), (5, "/tmp"),
             (6, "/proc")]] == [False, False, True, False, False, False]
    assert not container_tmpfs(None, "/run")


def test_a_tmpfs_the_host_has_mounted_too_is_not_the_container_s_own() -> None:
    """A bind of the host's /run or /dev/shm, a memory-backed emptyDir: the same
    filesystem (major:minor) is mounted in the host's mount namespace."""
    run = parse_mountinfo(MOUNTINFO)[3]
    assert container_tmpfs(run, "/run", frozenset({"0:1", "0:5"}))
    assert not container_tmpfs(run, "/run", frozenset({"0:1", "0:3"}))
    assert not container_tmpfs(run, "/etc", frozenset({"0:3"}))


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare is not installed")
def test_a_mount_named_in_bytes_that_are_not_utf8_is_read(tmp_path: Path) -> None:
    """Docker mounts an image's VOLUMEs where the image says, in any bytes: the
    container's mounts are still read, the odd one among them. (Integration:
    it mounts a tmpfs, as root, in a mount namespace of its own.)"""
    target = os.fsencode(tmp_path) + b"/vol\xff)"
    os.mkdir(target)
    look = ("import os; from cgpu_km.container.inroot import Root; "
            "root = Root(os.open('/', os.O_PATH | os.O_DIRECTORY)); "
            "print(sum(m.fstype == 'tmpfs' and m.root == '/' for m in root.mounts.values()))")
    mount_and_look = 'mount -t tmpfs none "$1" && exec "$2" -c "$3"'
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           mount_and_look, "sh", target, sys.executable, look],
                          capture_output=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert int(done.stdout) >= 1
