"""Images that hold links at the paths cgpu-hook places files at (issue 19, items 1, 2),
an own ld.so.preload that is not clean text naming the image's own files, and
volumes of a filesystem the host has mounted too (issue 36, items 4, 5).

Each image is a copy of the attack rootfs with one edit: a link at
/etc/ld.so.preload, /etc, /run/cgpu, the library's folder or the library,
absolute or relative, to a host path, chained through /dev, /dev/shm, /proc
(which the runtime mounts, and which differ between host and container), to
/dev/zero, onto a volume of the host, onto a path the hook mounts, a loop;
and /etc/ld.so.preload as a folder, a pipe, a file over the cap. Started by
real runc with cgpu-hook, the container either starts with libcgpu enforced
(an allocation over the limit fails inside it, and its ld.so.preload names
libcgpu and nothing of the host), or the start is refused with one line
naming the path and why. Whatever the image holds, a sentinel folder of the
host stays empty and a root-only host file stays as it was and never shows
in the container. Every case runs twice: with the hook at createRuntime and
at prestart, which must place the files alike.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpu_km.container.oci.spec import START_STAGES
from cgpu_km.dataplane import region as region_mod
from cgpu_km.tree import client as treefs
from tests.attacks.hostfiles import HostFiles, host_files
from tests.attacks.node import HOOK, NOBODY, SETPRIV, Container, Node, fields

LIMIT = 256 << 20
CGPU_256 = {"ALIYUN_COM_GPU_MEM_CONTAINER": "256", "ALIYUN_COM_GPU_MEM_DEV": "15109"}
LIBRARY = region_mod.CONTAINER_LIBRARY_PATH
UNENFORCEABLE = "libcgpu cannot be enforced"
OFF_IMAGE = "a mount that is not the image's own filesystem"


Host = HostFiles


@pytest.fixture(params=START_STAGES)
def node(make_node: Callable[..., Node], request: pytest.FixtureRequest) -> Node:
    """The attack host (tests/attacks/conftest.py), its hook at one start stage."""
    made = make_node()
    made.start = request.param
    return made


@pytest.fixture
def host() -> Iterator[HostFiles]:
    with host_files() as files:
        yield files


Edit = Callable[[Path], None]


def link(path: str, target: str) -> Edit:
    """An image whose `path` is a link to `target` (what was there is removed)."""
    def edit(rootfs: Path) -> None:
        at = rootfs / path.lstrip("/")
        at.parent.mkdir(parents=True, exist_ok=True)
        if at.is_dir() and not at.is_symlink():
            shutil.rmtree(at)
        elif at.exists() or at.is_symlink():
            at.unlink()
        at.symlink_to(target)
    return edit


def both(*edits: Edit) -> Edit:
    def edit(rootfs: Path) -> None:
        for one in edits:
            one(rootfs)
    return edit


def preload_folder(rootfs: Path) -> None:
    (rootfs / "etc" / "ld.so.preload").mkdir()


def preload_pipe(rootfs: Path) -> None:
    os.mkfifo(rootfs / "etc" / "ld.so.preload")


def preload_zero_device(rootfs: Path) -> None:
    """/etc/ld.so.preload as a copy of /dev/zero's node, in the image itself."""
    os.mknod(rootfs / "etc" / "ld.so.preload", 0o644 | stat.S_IFCHR, os.makedev(1, 5))


def preload_too_large(rootfs: Path) -> None:
    (rootfs / "etc" / "ld.so.preload").write_text("#" * (64 << 10) + "\n")


def preload(data: bytes, *edits: Edit) -> Edit:
    """An image whose own /etc/ld.so.preload holds `data` (after `edits`)."""
    def edit(rootfs: Path) -> None:
        for one in edits:
            one(rootfs)
        (rootfs / "etc" / "ld.so.preload").write_bytes(data)
    return edit


def names(path: str, offset: int, why: str) -> str:
    """The refusal of an image's preload whose name at `offset` is not its own file."""
    return f"/etc/ld.so.preload in the image names {path} at offset {offset}, which {why}"


# (name, the image's edit with {secret} and {sentinel} to fill, None when the
# container starts enforced, else the refusal's text after "cgpu-hook: ")
STARTS = [
    ("preload -> host file", lambda h: link("/etc/ld.so.preload", str(h.secret))),
    ("preload -> relative climb to host file",
     lambda h: link("/etc/ld.so.preload", "../../../../../../../.." + str(h.secret))),
    ("/run/cgpu -> host folder", lambda h: link("/run/cgpu", str(h.sentinel))),
    ("/run -> host folder, relative", lambda h: link("/run", "../../.." + str(h.sentinel))),
    ("/etc -> host folder", lambda h: link("/etc", str(h.sentinel))),
    ("library folder -> host folder", lambda h: link("/usr/local/lib/cgpu", str(h.sentinel))),
    ("library -> host file", lambda h: link(LIBRARY, str(h.secret))),
    ("preload -> missing folders -> host file",
     lambda h: link("/etc/ld.so.preload", "/nowhere/../nowhere2/x/../" + h.secret.name)),
    ("/run/cgpu -> a missing folder", lambda h: link("/run/cgpu", "/missing/deeper")),
]
def leads(asked: str, target: str, mount: str) -> str:
    """The refusal of a path whose first link leads onto another mount."""
    return f"{asked} in the image is a link to {target}, which leads to {mount}, {OFF_IMAGE}"


REFUSED = [
    ("preload -> ../dev/leak -> host file",
     lambda h: both(link("/etc/ld.so.preload", "../dev/leak"), link("/dev/leak", str(h.secret))),
     leads("/etc/ld.so.preload", "../dev/leak", "/dev")),
    ("preload -> /dev/shm/leak", lambda h: link("/etc/ld.so.preload", "/dev/shm/leak"),
     leads("/etc/ld.so.preload", "/dev/shm/leak", "/dev")),
    ("preload -> /dev/zero", lambda h: link("/etc/ld.so.preload", "/dev/zero"),
     leads("/etc/ld.so.preload", "/dev/zero", "/dev")),
    ("preload -> /proc/self/root/...",
     lambda h: link("/etc/ld.so.preload", f"/proc/self/root{h.secret}"),
     leads("/etc/ld.so.preload", "/proc/self/root{secret}", "/proc")),
    ("/etc -> /dev", lambda h: link("/etc", "/dev"),
     leads("/etc/ld.so.preload", "/dev", "/dev")),
    ("/run/cgpu -> /dev/shm", lambda h: link("/run/cgpu", "/dev/shm"),
     leads("/run/cgpu/control", "/dev/shm", "/dev")),
    ("library folder -> /proc/1/root/tmp", lambda h: link("/usr/local/lib/cgpu",
                                                         "/proc/1/root/tmp"),
     leads(LIBRARY, "/proc/1/root/tmp", "/proc")),
    ("/run/cgpu -> ../sys/kernel", lambda h: link("/run/cgpu", "../sys/kernel"),
     leads("/run/cgpu/control", "../sys/kernel", "/sys")),
    ("preload -> host volume /out", lambda h: link("/etc/ld.so.preload", "/out/leak"),
     leads("/etc/ld.so.preload", "/out/leak", "/out")),
    ("preload -> itself", lambda h: link("/etc/ld.so.preload", "ld.so.preload"),
     "/etc/ld.so.preload in the image is a loop of links"),
    ("preload through a file", lambda h: link("/etc/ld.so.preload", "/bin/busybox/x"),
     "/etc/ld.so.preload in the image passes through /bin/busybox, which is a file, "
     "not a folder"),
    ("preload is a folder", lambda h: preload_folder,
     "/etc/ld.so.preload in the image is a folder, not a file"),
    ("preload is a pipe", lambda h: preload_pipe,
     "/etc/ld.so.preload in the image is a pipe, not a file"),
    ("preload is a zero device node", lambda h: preload_zero_device,
     "/etc/ld.so.preload in the image is a device, not a file"),
    ("preload over 64 KiB", lambda h: preload_too_large,
     "/etc/ld.so.preload in the image is larger than 64 KiB"),
    ("preload -> the account part", lambda h: link("/etc/ld.so.preload", "/run/cgpu/account"),
     "/etc/ld.so.preload in the image is a mount (at /run/cgpu/account), not a file of the "
     "image's own filesystem"),
    ("library -> preload", lambda h: link(LIBRARY, "/etc/ld.so.preload"),
     "/etc/ld.so.preload in the image is a mount, not a file of the image's own filesystem"),
    # issue 36, item 4: the image's own preload is clean text naming its own files
    ("preload is one NUL byte", lambda h: preload(b"\0"),
     "/etc/ld.so.preload in the image has a NUL byte at offset 0"),
    ("preload with binary bytes", lambda h: preload(b"/bin/busybox\n\x7fELF\x02\x01\n"),
     "/etc/ld.so.preload in the image has the byte 0x7f at offset 13, which is not "
     "printable text"),
    ("preload names a relative library", lambda h: preload(b"# own\nlibown.so\n"),
     names("libown.so", 6, "is not an absolute path")),
    ("preload names a missing library", lambda h: preload(b"/bin/busybox /usr/lib/none.so"),
     names("/usr/lib/none.so", 13, "is not in the image")),
    ("preload names a folder", lambda h: preload(b"/etc\n"),
     names("/etc", 0, "is a folder, not a file")),
    ("preload names a file on /dev", lambda h: preload(b"/bin/busybox:/dev/shm/x.so"),
     names("/dev/shm/x.so", 13, "is on /dev, a mount that is not the image's own filesystem")),
    ("preload names a file of a host volume", lambda h: preload(b"/out/x.so"),
     names("/out/x.so", 0, "is on /out, a mount that is not the image's own filesystem")),
    ("preload names a link to /proc", lambda h: preload(
        b"/usr/lib/self.so\n", link("/usr/lib/self.so", "/proc/self/exe")),
     names("/usr/lib/self.so", 0, "is a link to /proc/self/exe, which leads to /proc, a mount "
           "that is not the image's own filesystem")),
    ("preload names the account part", lambda h: preload(b"/run/cgpu/account\n"),
     names("/run/cgpu/account", 0, "is a mount, not a file of the image's own filesystem")),
]


def hook_message(stderr: str) -> list[str]:
    """cgpu-hook's lines in runc's error (runc quotes the hook's stderr)."""
    return re.findall(r"(cgpu-hook: .*?)\\n", stderr)


@pytest.mark.parametrize(("name", "make"), STARTS, ids=[case[0] for case in STARTS])
def test_an_image_link_that_stays_inside_starts_with_libcgpu_enforced(
    node: Node, host: Host, name: str, make: Callable[[Host], Edit]
) -> None:
    container, code, errors = node.try_container(CGPU_256, image=make(host))
    assert code == 0, errors
    info, alloc, under = container.run("info", f"alloc {LIMIT + 1}", f"alloc {LIMIT // 2}")
    assert fields(info)["total"] == str(LIMIT)
    assert (alloc, under) == ("alloc rc=2", "alloc rc=0")
    preload = container.sh("cat /etc/ld.so.preload")
    assert preload.splitlines() == [LIBRARY], preload
    shown = container.sh(f"cat /etc/ld.so.preload {host.secret} 2>&1 | "
                         f"grep -c {host.content.strip()}")
    assert shown.strip() == "0"
    host.untouched()


@pytest.mark.parametrize(("name", "make", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_an_image_link_off_the_image_refuses_the_start_with_one_line(
    node: Node, host: Host, name: str, make: Callable[[Host], Edit], message: str
) -> None:
    container, code, errors = node.try_container(CGPU_256, image=make(host))
    assert code != 0
    expected = f"cgpu-hook: {message.format(secret=host.secret)}; {UNENFORCEABLE}"
    assert hook_message(errors) == [expected], errors
    assert not container.region_path.exists()
    assert list(node.region_dir.iterdir()) == []
    assert not any(container.out.iterdir())
    host.untouched()


@pytest.fixture(scope="module")
def own_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library of the image's own, to preload."""
    folder = tmp_path_factory.mktemp("own-library")
    (folder / "own.c").write_text("int own_library_marker(void) { return 36; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "own.so"),
                    str(folder / "own.c")], check=True)
    return folder / "own.so"


def loaded(container: Container) -> list[str]:
    """The objects the loader maps for a process of the container, in its order."""
    trace = container.sh("LD_TRACE_LOADED_OBJECTS=1 /attacker")
    return [line.split()[0] for line in trace.splitlines() if line.startswith("\t/")]


def test_an_image_preload_that_lists_its_own_library_first_gets_libcgpu_first(
        node: Node, own_library: Path) -> None:
    """The image lists its library before libcgpu (and libcgpu by another name, and its
    library by a link): libcgpu is the first line and the first object the loader maps
    after the program, the image's library follows, once."""
    def image(rootfs: Path) -> None:
        shutil.copy2(own_library, rootfs / "usr" / "lib" / "own.so")
        link("/usr/lib/own-link.so", "own.so")(rootfs)
        own = (f"# the image's own\n/usr/lib/own.so {LIBRARY}:"
               "/usr/local/lib/cgpu/../cgpu/libcgpu.so\n/usr/lib/own-link.so\n")
        (rootfs / "etc" / "ld.so.preload").write_text(own)

    container = node.container(CGPU_256, image=image)
    assert container.sh("cat /etc/ld.so.preload").splitlines() == [
        LIBRARY, "/usr/lib/own.so", "/usr/lib/own-link.so"]
    order = [path for path in loaded(container) if path in (LIBRARY, "/usr/lib/own.so")]
    assert order == [LIBRARY, "/usr/lib/own.so"], loaded(container)
    assert container.run(f"alloc {LIMIT + 1}") == ["alloc rc=2"]


def test_a_container_that_is_not_enabled_is_untouched(node: Node, host: Host) -> None:
    container = node.container({}, image=link("/etc/ld.so.preload", "/dev/zero"))
    assert container.sh("readlink /etc/ld.so.preload; ls /run").split() == ["/dev/zero"]
    assert not container.region_path.exists()
    host.untouched()


def test_a_host_user_cannot_use_the_hook(node: Node, host: Host) -> None:
    """`nobody` on the host runs cgpu-hook's start command for a bundle of its own whose image
    links /run/cgpu and /etc/ld.so.preload to host paths, naming its own process."""
    assert SETPRIV is not None
    bundle = Path(tempfile.mkdtemp(prefix="cgpu-nobody-bundle-"))
    try:
        rootfs = bundle / "rootfs"
        for folder in ("etc", "run"):
            (rootfs / folder).mkdir(parents=True)
        (rootfs / "run" / "cgpu").symlink_to(host.sentinel)
        (rootfs / "etc" / "ld.so.preload").symlink_to(host.secret)
        env = [f"{k}={v}" for k, v in CGPU_256.items()]
        (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"},
                                                        "process": {"env": env}}))
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(bundle)], check=True)
        sleeper = subprocess.Popen([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                    "--clear-groups", "unshare", "-Urm", "sleep", "60"])
        try:
            state = json.dumps({"ociVersion": "1.0.2", "id": "nobody" + "0" * 20,
                                "status": "creating", "pid": sleeper.pid,
                                "bundle": str(bundle)})
            hook = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    str(HOOK)]
            result = subprocess.run([*hook, "--root", str(node.tree), node.start], input=state,
                                    capture_output=True, text=True, timeout=60,
                                    env={**node.env, "PATH": os.environ["PATH"]}, cwd="/")
        finally:
            sleeper.kill()
            sleeper.wait()
        assert result.returncode != 0
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith("cgpu-hook: "), result.stderr
        assert treefs.read_tree(node.tree).gpus[0].containers == {}
        assert not node.region_dir.exists() or list(node.region_dir.iterdir()) == []
    finally:
        shutil.rmtree(bundle, ignore_errors=True)
    host.untouched()


TMPFS_RUN = {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=755"]}


@pytest.mark.parametrize("make", [
    lambda h: None, lambda h: link("/run", "/tmp/run"),
], ids=["tmpfs /run", "/run -> a tmpfs /tmp/run"])
def test_a_tmpfs_of_the_container_s_own_takes_the_region(
    node: Node, host: Host, make: Callable[[Host], Edit | None]
) -> None:
    """ctr and `--tmpfs` mount a fresh tmpfs of the container's own: /run/cgpu goes there."""
    mount = TMPFS_RUN if make(host) is None else {**TMPFS_RUN, "destination": "/tmp"}
    container = node.container(CGPU_256, image=make(host), mounts=[mount])
    assert container.run(f"alloc {LIMIT + 1}") == ["alloc rc=2"]
    assert container.sh("cat /etc/ld.so.preload").splitlines() == [LIBRARY]
    host.untouched()


@pytest.fixture
def host_tmpfs() -> Iterator[Path]:
    """A tmpfs mounted on the host (as kubelet mounts a memory-backed emptyDir)."""
    folder = Path(tempfile.mkdtemp(prefix="cgpu-host-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=755", "none", str(folder)],
                   check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.rmdir()


def bind(source: str | Path, destination: str) -> dict[str, object]:
    return {"destination": destination, "type": "bind", "source": str(source),
            "options": ["bind", "rw"]}


def on(asked: str, mount: str) -> str:
    return f"{asked} in the image is on {mount}, {OFF_IMAGE}"


@pytest.mark.parametrize(("source", "at", "message"), [
    ("/run", "/run", on("/run/cgpu/control", "/run")),
    ("/dev/shm", "/run", on("/run/cgpu/control", "/run")),
    (None, "/run", on("/run/cgpu/control", "/run")),
    (None, "/etc", on("/etc/ld.so.preload", "/etc")),
], ids=["host /run at /run", "host /dev/shm at /run", "host tmpfs at /run",
        "host tmpfs at /etc"])
def test_a_volume_of_a_filesystem_the_host_has_mounted_is_refused(
        node: Node, host: Host, host_tmpfs: Path, source: str | None, at: str,
        message: str) -> None:
    """The host's /run or /dev/shm bound into the container, or a tmpfs of the host (a
    memory-backed emptyDir), is a volume like a disk's: the hook creates and mounts
    nothing there, and the start is refused with one line."""
    shared = Path(source) if source is not None else host_tmpfs
    before = sorted(path.name for path in shared.iterdir())
    container, code, errors = node.try_container(CGPU_256, mounts=[bind(shared, at)])
    try:
        assert code != 0
        assert hook_message(errors) == [f"cgpu-hook: {message}; {UNENFORCEABLE}"], errors
        assert not container.region_path.exists()
        assert list(node.region_dir.iterdir()) == []
    finally:
        made = [path for path in ("cgpu", "ld.so.preload")
                if path not in before and (shared / path).exists()]
        for path in made:  # what a hook that got this wrong left on the host
            subprocess.run(["rm", "-rf", str(shared / path)], check=False)
    assert made == []
    if source is None:
        assert list(shared.iterdir()) == []
    host.untouched()


# Swaps /etc and /run for links onto /dev and back, by renames that keep
# what is mounted below them (a name that is itself a mount point in another
# container is not touched: see the security model), until /stop exists.
RACER = """
while [ ! -e /stop ]; do
    mv /etc /etc.real && ln -s ../dev /etc && rm /etc && mv /etc.real /etc
    mv /run /run.real && ln -s /dev/shm /run && rm /run && mv /run.real /run
    echo swapped
done
"""
PARTS = ("/run/cgpu/control", "/run/cgpu/account")
RACE_REFUSALS = (leads("/etc/ld.so.preload", "../dev", "/dev"),
                 *(leads(part, "/dev/shm", "/dev") for part in PARTS),
                 *(f"{path} in the container is not the file the hook mounted there"
                   for path in (LIBRARY, *PARTS, "/etc/ld.so.preload")),
                 *(f"{path} in the image keeps changing"
                   for path in (LIBRARY, *PARTS, "/etc/ld.so.preload")))


def test_links_swapped_while_the_hook_walks_never_lead_it_out(node: Node, host: Host) -> None:
    """A container on the same root filesystem swaps /etc and /run for links onto /dev
    and back, as fast as it can, while containers start on it: each start passes the
    hook's check from the container's side or is refused with one line, and the host
    is untouched. (What the racer's folder moves do after a start is the folder-move
    bypass of the security model, not the hook's walk.)"""
    racer = node.container({}, user=0)
    swapping = subprocess.Popen(racer.exec_args(["/bin/sh", "-c", RACER]),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    started: list[object] = []
    refused: list[str] = []
    try:
        for _ in range(12):
            container, code, errors = node.try_container(CGPU_256, rootfs_of=racer)
            if code == 0:
                started.append(container)
                continue
            lines = hook_message(errors)
            assert len(lines) == 1, errors
            refused.append(lines[0].removeprefix("cgpu-hook: ").removesuffix(
                f"; {UNENFORCEABLE}"))
    finally:
        (racer.rootfs / "stop").touch()
        swaps, _ = swapping.communicate(timeout=60)  # its last moves may fail: no status
    assert swaps.count("swapped") > 12  # it raced all along
    assert len(started) + len(refused) == 12
    # a file moved between the walk and the mount fails that mount: one line too
    unexpected = [why for why in refused if why not in RACE_REFUSALS
                  and not why.startswith("placing libcgpu in the container failed: ")]
    assert unexpected == [], refused
    host.untouched()
