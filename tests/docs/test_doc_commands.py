"""Every command shown in README.md and docs/ runs here, so none goes stale.

The convention (docs/developer/testing.md, "Commands in the docs"):

- A ```` ```console ```` block holds `$ command` lines, each followed by what
  it prints (stdout and stderr together). A line ending in `\\`, and the
  lines after it that start with `> `, continue the command. Output is
  compared loosely: runs of spaces count as one (a table's border lines as
  their shape), `...` inside a line stands for any text, a line that is only
  `...` for any number of lines, and a command followed by no output has
  its output unchecked. Every command must exit 0 unless its line ends with
  a comment that says `exit status N`.
- A ```` ```sh ```` block is a script; it must exit 0.
- Words after the language: `docker` runs the block with a Docker engine of
  the sandbox's own, and `norun: <reason>` leaves it unrun, with the reason
  in the docs' source. Other blocks say what they are (`text`, `yaml`,
  `json`, ...): a fence with no language, or `bash`/`shell`, fails.

The blocks of one document run in order, each in a fresh `bash` in the
repository root, against one sandbox node: a FUSE control tree (root and
`/dev/fuse`, as CI has), `cgpu-daemon`, simgpu's GPUs (two Tesla T4 of
15109 MiB, or as many as a `<!-- doc-test: gpus=N -->` line in the
document asks), and with `docker` blocks a private dockerd whose runtimes
`cgpu` and `nvidia` are cgpu_km's wrapper (as after `cgpu-node install
--nvidia-name`) and the demo's image `cgpu-demo`. In commands and output,
`/proc/cgpu_km` and `/run/cgpu_km` mean the sandbox's tree,
`/run/cgpu_km-daemon` and `/run/cgpu_km-regions` its folders, and
`127.0.0.1:9400` its daemon's `/metrics`.

Also here: every relative link in README.md and docs/ points at a file or
folder of the repository that exists (and at a heading that exists, for
`#anchors` into Markdown).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cgpu_km.container.oci.settings import CONFIG_ENV
from cgpu_km.demo.__main__ import IMAGE, WORKLOAD, json_list
from cgpu_km.demo.dockerd import PrivateDocker
from cgpu_km.demo.image import build_rootfs, rootfs_tar

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
DOCS = (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")))

COMMAND_LANGUAGES = frozenset({"console", "sh"})
OTHER_LANGUAGES = frozenset({"text", "yaml", "json", "toml", "c", "python", "promql", "diff"})
OPTIONS = frozenset({"docker"})
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<ticks>`{3,})(?P<info>[^`]*)$")
STATUS = re.compile(r"#[^#\n]*\bexit status (?P<status>\d+)\s*$")
GPUS_DIRECTIVE = re.compile(r"^<!-- doc-test: gpus=(?P<gpus>\d+) -->$", re.MULTILINE)
BLOCK_TIMEOUT = 60.0
MIB = 1 << 20
T4_MIB = 15109
RECORD = "\x1e"  # between one command's output and the next


# ---- reading the docs --------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    text: str  # continuation lines joined with newlines
    line: int  # 1-based, in the document
    expected: tuple[str, ...]
    status: int


@dataclass(frozen=True)
class Block:
    doc: str  # relative to the repository
    line: int  # the opening fence, 1-based
    language: str
    options: tuple[str, ...]
    norun: str | None  # the reason; None when the block runs
    body: tuple[str, ...]
    commands: tuple[Command, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in COMMAND_LANGUAGES and self.norun is None


class DocError(ValueError):
    """A block that breaks the convention; the message names the place."""


def parse_console(body: Sequence[str], first_line: int, where: str) -> tuple[Command, ...]:
    commands: list[Command] = []
    text: list[str] = []
    start = 0
    expected: list[str] = []

    def close() -> None:
        if text:
            found = STATUS.search(text[-1])
            status = int(found.group("status")) if found else 0
            commands.append(Command("\n".join(text), start, tuple(expected), status))

    index = 0
    while index < len(body):
        line = body[index]
        if line.startswith("$ ") or line == "$":
            close()
            start = first_line + index
            text, expected = [line[2:]], []
            while index + 1 < len(body) and (text[-1].endswith("\\")
                                             or body[index + 1].startswith("> ")):
                index += 1
                text.append(body[index].removeprefix("> "))
        elif not text:
            raise DocError(f"{where}: output before the first `$ ` command: {line!r}")
        else:
            expected.append(line)
        index += 1
    close()
    if not commands:
        raise DocError(f"{where}: a console block without a `$ ` command")
    return tuple(commands)


def parse_blocks(text: str, doc: str) -> list[Block]:
    """Every fenced block of a Markdown text, classified."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, ticks = len(opening.group("indent")), opening.group("ticks")
        info = opening.group("info").strip()
        start = index + 1
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != ticks:
            line = lines[index]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            index += 1
        if index == len(lines):
            raise DocError(f"{doc}:{start}: the block is never closed")
        index += 1
        where = f"{doc}:{start}"
        head, _, reason = info.partition("norun:")
        words = head.split()
        language = words[0] if words else ""
        options = tuple(words[1:])
        norun = reason.strip() if "norun:" in info else None
        if language in COMMAND_LANGUAGES:
            unknown = set(options) - OPTIONS
            if unknown:
                raise DocError(f"{where}: unknown options {sorted(unknown)} "
                               f"(known: {sorted(OPTIONS)}, norun: <reason>)")
            if norun == "":
                raise DocError(f"{where}: `norun:` needs a reason")
            commands = (parse_console(body, start + 1, where) if language == "console"
                        else (Command("\n".join(body), start + 1, (), 0),))
            blocks.append(Block(doc, start, language, options, norun, tuple(body), commands))
        elif language in OTHER_LANGUAGES:
            if options or norun is not None:
                raise DocError(f"{where}: options belong to command blocks only: {info!r}")
            blocks.append(Block(doc, start, language, (), None, tuple(body)))
        else:
            raise DocError(
                f"{where}: fence language {language!r}: commands go in `console` (or `sh`) "
                f"blocks, anything else says what it is ({', '.join(sorted(OTHER_LANGUAGES))})")
    return blocks


def doc_name(path: Path) -> str:
    return str(path.relative_to(REPO))


def doc_blocks(path: Path) -> list[Block]:
    return parse_blocks(path.read_text(), doc_name(path))


# ---- comparing output ----------------------------------------------------------------------

def normalize(line: str) -> str:
    """Runs of whitespace as one space, none at the end; bash's script line numbers dropped;
    a table's border lines (`+-----+==+`) without their widths."""
    line = re.sub(r"^bash: line \d+: ", "bash: ", line)
    line = " ".join(line.split())
    if re.fullmatch(r"\+[-=+]*\+", line):
        line = re.sub(r"([-=])\1+", r"\1", line)
    return line


def literal(text: str, substitute: dict[str, str]) -> str:
    """`text` as a regex; a sandboxed path in it matches itself or the sandbox's."""
    if not substitute:
        return re.escape(text)
    keys = re.compile("|".join(re.escape(k) for k in sorted(substitute, key=len, reverse=True)))
    parts, last = [], 0
    for found in keys.finditer(text):
        parts.append(re.escape(text[last:found.start()]))
        parts.append(f"(?:{re.escape(found.group())}|{re.escape(substitute[found.group()])})")
        last = found.end()
    return "".join(parts) + re.escape(text[last:])


def expected_pattern(expected: Sequence[str], substitute: dict[str, str]) -> re.Pattern[str]:
    parts = []
    for line in expected:
        line = normalize(line)
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append("[^\n]*?".join(literal(p, substitute) for p in line.split("...")) + "\n")
    return re.compile("".join(parts))


def normalized_output(output: str) -> str:
    lines = [normalize(line) for line in output.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "".join(f"{line}\n" for line in lines)


def matches(expected: Sequence[str], output: str, substitute: dict[str, str]) -> bool:
    if not expected:
        return True
    pattern = expected_pattern(expected, substitute)
    return pattern.fullmatch(normalized_output(output)) is not None


@dataclass(frozen=True)
class Outcome:
    command: Command
    output: str
    status: int

    def problem(self, substitute: dict[str, str]) -> str | None:
        """Why this outcome is not what the doc shows, or None."""
        if self.status != self.command.status:
            return f"exit status {self.status}, the doc says {self.command.status}"
        if not matches(self.command.expected, self.output, substitute):
            return "the output differs from what the doc shows"
        return None


def replace_all(text: str, substitute: dict[str, str]) -> str:
    if not substitute:
        return text
    keys = re.compile("|".join(re.escape(k) for k in sorted(substitute, key=len, reverse=True)))
    return keys.sub(lambda found: substitute[found.group()], text)


def block_script(block: Block, substitute: dict[str, str]) -> str:
    """One bash script: each command, then a record of its exit status."""
    return "".join(f"{replace_all(c.text, substitute)}\nprintf '{RECORD}%d{RECORD}\\n' $?\n"
                   for c in block.commands)


def run_block(block: Block, env: dict[str, str], substitute: dict[str, str]) -> list[Outcome]:
    """Run the block's commands in one bash; a block past BLOCK_TIMEOUT is killed whole."""
    with subprocess.Popen(["bash", "-c", block_script(block, substitute)], cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as shell:
        try:
            output, _ = shell.communicate(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            output, _ = shell.communicate()
            output += f"\n(killed after {BLOCK_TIMEOUT:g} s)\n"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)  # what the block left running
    pieces = re.split(f"{RECORD}(\\d+){RECORD}\n", output)
    outcomes = [Outcome(command, pieces[2 * i], int(pieces[2 * i + 1]))
                for i, command in enumerate(block.commands) if 2 * i + 1 < len(pieces)]
    if len(outcomes) < len(block.commands):  # the script ended early (an `exit`, a timeout)
        command = block.commands[len(outcomes)]
        outcomes.append(Outcome(command, pieces[2 * len(outcomes)], -1))
    return outcomes


def report(block: Block, outcome: Outcome, problem: str) -> str:
    shown = "\n".join(f"    {line}" for line in outcome.command.expected) or "    (nothing)"
    got = "\n".join(f"    {line}" for line in outcome.output.splitlines()) or "    (nothing)"
    return (f"{block.doc}:{outcome.command.line}: {problem}\n  $ {outcome.command.text}\n"
            f"  the doc shows:\n{shown}\n  it printed:\n{got}")


# ---- the sandbox node ----------------------------------------------------------------------

def uuid(index: int) -> str:
    return f"GPU-7e4b0c2a-5d13-4f6e-8a90-3c1d2e4f5a{index:02x}"


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until(what: str, ready: Sequence[Path], process: subprocess.Popen[bytes],
               log: Path, mounted: bool = False) -> None:
    deadline = time.monotonic() + 30
    while not all(os.path.ismount(p) if mounted else p.exists() for p in ready):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


@dataclass
class Sandbox:
    """A simulated GPU node in a folder: FUSE tree, daemon, simgpu, maybe dockerd."""

    folder: Path
    gpus: int
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    metrics_port: int = 0
    docker: PrivateDocker | None = None

    @property
    def tree(self) -> Path:
        return self.folder / "cgpu_km"

    @property
    def devices(self) -> str:
        return ",".join(f"Tesla T4:{T4_MIB}MiB:{uuid(i)}" for i in range(self.gpus))

    @property
    def substitute(self) -> dict[str, str]:
        return {"/proc/cgpu_km": str(self.tree), "/run/cgpu_km-daemon": str(self.folder / "daemon"),
                "/run/cgpu_km-regions": str(self.folder / "regions"),
                "/run/cgpu_km": str(self.tree),
                "127.0.0.1:9400": f"127.0.0.1:{self.metrics_port}"}

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CGPU_", "SIMGPU_", "LD_", "DOCKER_", "PYTEST_"))}
        env.update({
            "PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin:{os.environ.get('PATH', '')}",
            "COLUMNS": "80", "TZ": "UTC", "LANG": "C", "LC_ALL": "C",
            "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(REPO / "simgpu"),
            "CGPU_KM_ROOT": str(self.tree),
            "CGPU_STATE_DIR": str(self.folder / "daemon"),
            "CGPU_REGION_DIR": str(self.folder / "regions"),
            "CGPU_HOOK_STATE_DIR": str(self.folder / "claims"),
            "SIMGPU_DEVICES": self.devices,
            "SIMGPU_STATE": str(self.folder / "simgpu-state"),
            "SIMGPU_CONTEXT_MEM": "0",
        })
        if self.docker is not None:
            env["DOCKER_HOST"] = f"unix://{self.docker.socket}"
        return env

    def start(self) -> None:
        self.tree.mkdir()
        memory = ",".join([str(T4_MIB * MIB)] * self.gpus)
        self._spawn("cgpu-fuse", [str(VENV_BIN / "cgpu-fuse"), "--root", str(self.tree),
                                  "--gpus", str(self.gpus), "--gpu-memory", memory],
                    [self.tree], mounted=True)
        with socket.socket() as probe:  # a free port for /metrics (9400 in the docs)
            probe.bind(("127.0.0.1", 0))
            self.metrics_port = probe.getsockname()[1]
        self._spawn("cgpu-daemon", [str(VENV_BIN / "cgpu-daemon"), "--period", "0.05",
                                    "--metrics-listen", f"127.0.0.1:{self.metrics_port}"],
                    [self.folder / "daemon" / "snapshot.json"])

    def _spawn(self, name: str, argv: list[str], ready: list[Path], mounted: bool = False) -> None:
        log = self.folder / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.processes.append((name, process))
        wait_until(name, ready, process, log, mounted)

    def start_docker(self) -> None:
        """dockerd with cgpu_km's runtime as `cgpu` and `nvidia`, and the demo's image."""
        etc = self.folder / "etc"
        (etc / "docker").mkdir(parents=True)
        (etc / "docker" / "daemon.json").write_text("{}\n")
        (self.folder / "docker").mkdir()
        engine = PrivateDocker(self.folder / "docker", config_file=etc / "docker" / "daemon.json",
                               env={CONFIG_ENV: str(etc / "cgpu_km" / "runtime.toml")})
        self.docker = engine
        engine.start()
        node = [str(VENV_BIN / "cgpu-node"), "install", "--no-build", "--nvidia-name",
                "--engines", "docker", "--etc", str(etc), "--bin-dir", str(self.folder / "bin"),
                "--state-dir", str(self.folder / "node-state"), "--docker-pidfile",
                str(engine.pidfile), "--no-services", "--tree-root", str(self.tree),
                "--simulate", "on", "--simgpu-state", str(self.folder / "simgpu-state"),
                "--simgpu-devices", self.devices,
                "--hook-env", f"CGPU_REGION_DIR={self.folder / 'regions'}",
                "--hook-env", f"CGPU_HOOK_STATE_DIR={self.folder / 'claims'}",
                "--hook-env", "SIMGPU_CONTEXT_MEM=0", "--prefix", str(self.folder / "opt")]
        if os.environ.get("PYTHONPATH"):  # the hook imports the code under test, as we do
            node += ["--hook-env", f"PYTHONPATH={os.environ['PYTHONPATH']}"]
        installed = subprocess.run(node, env=self.env, capture_output=True, text=True,
                                   timeout=120, check=False)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        build_rootfs(self.folder / "image")
        (self.folder / "image.tar").write_bytes(rootfs_tar(self.folder / "image"))
        engine.check("import", "--change", "ENV PATH=/bin:/usr/bin", "--change",
                     f"CMD {json_list(WORKLOAD)}", str(self.folder / "image.tar"), IMAGE)

    def close(self) -> None:
        if self.docker is not None:
            self.docker.stop()  # its containers' poststop hooks need the tree: first
        for name, process in reversed(self.processes):
            if name == "cgpu-fuse":
                subprocess.run(["fusermount", "-u", "-z", str(self.tree)], check=False,
                               capture_output=True)
            stop(process)


def sandbox_missing(docker: bool) -> str | None:
    """Why a sandbox cannot run here, or None."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("fusermount") is None:
        return "the sandbox mounts a FUSE tree: needs root, /dev/fuse and fusermount"
    for built in ("simgpu/libcuda.so.1", "simgpu/libnvidia-ml.so.1", "simgpu/nvidia-smi",
                  "simgpu/cuworkload", "libcgpu/libcgpu.so"):
        if not (REPO / built).is_file():
            return f"{built} is not built (make build)"
    if docker:
        for program in ("dockerd", "containerd", "runc", "busybox"):
            if shutil.which(program) is None:
                return f"docker blocks need {program} (apt-get install docker.io busybox-static)"
    return None


@pytest.fixture
def sandbox_folder() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="cgpu-docs-"))
    folder.chmod(0o755)  # the conformance suite reads the tree as a non-root user too
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---- the tests -----------------------------------------------------------------------------

def all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in doc_blocks(doc)]


def test_every_block_runs_or_says_why_not() -> None:
    """Parsing fails on a block outside the convention; every command block is accounted for."""
    blocks = all_blocks()
    commands = [b for b in blocks if b.language in COMMAND_LANGUAGES]
    run = [b for b in commands if b.runs]
    unrun = [b for b in commands if not b.runs]
    assert run, "no command block runs"
    assert all(b.norun for b in unrun), [b.where for b in unrun if not b.norun]
    # Not-run blocks stay few: each needs a cluster, a kernel, an install on the host...
    assert len(unrun) < len(run), (
        f"{len(unrun)} command blocks are not run against {len(run)} that are: "
        + ", ".join(f"{b.where} ({b.norun})" for b in unrun))


def has_runs(doc: Path) -> bool:
    try:
        return any(b.runs for b in doc_blocks(doc))
    except DocError:
        return True  # test_doc_commands reports it


RUN_DOCS = [doc for doc in DOCS if has_runs(doc)]


@pytest.mark.parametrize("doc", RUN_DOCS, ids=[doc_name(d) for d in RUN_DOCS])
@pytest.mark.timeout(240)
def test_doc_commands(doc: Path, sandbox_folder: Path) -> None:
    blocks = [b for b in doc_blocks(doc) if b.runs]
    docker = any("docker" in b.options for b in blocks)
    why = sandbox_missing(docker)
    if why is not None:
        pytest.skip(why)
    found = GPUS_DIRECTIVE.search(doc.read_text())
    sandbox = Sandbox(sandbox_folder, int(found.group("gpus")) if found else 2)
    try:
        sandbox.start()
        if docker:
            sandbox.start_docker()
        failures = []
        for block in blocks:
            for outcome in run_block(block, sandbox.env, sandbox.substitute):
                problem = outcome.problem(sandbox.substitute)
                if problem is not None:
                    failures.append(report(block, outcome, problem))
                    break  # later commands of the block depend on this one
        assert not failures, "\n\n".join(failures)
    finally:
        sandbox.close()


# -- the harness can fail: the same machinery on made-up documents

SELF_TEST = """\
```console
$ echo one; echo '  two   spaces'
one
two spaces
$ printf 'a\\nb\\nc\\n'
a
...
$ sh -c 'echo oops >&2; exit 3'   # exit status 3
...oops
```
"""


def run_text(text: str) -> list[str | None]:
    blocks = parse_blocks(text, "self-test.md")
    return [outcome.problem({}) for block in blocks
            for outcome in run_block(block, dict(os.environ), {})]


def test_harness_passes_what_the_doc_shows() -> None:
    assert run_text(SELF_TEST) == [None, None, None]


@pytest.mark.parametrize(("wrong", "problem"), [
    ("one\ntwo spaces", "one\ntwo  tabs"),  # changed output
    ("$ printf", "$ printf_typo"),  # a wrong command (127)
    ("exit status 3", "exit status 2"),  # another exit status
    ("a\n...\n", "a\nc\n"),  # a line missing
])
def test_harness_fails_what_differs(wrong: str, problem: str) -> None:
    problems = run_text(SELF_TEST.replace(wrong, problem, 1))
    assert any(p is not None for p in problems), problems


def test_harness_catches_a_failing_command_without_output() -> None:
    assert run_text("```console\n$ false\n```\n") == ["exit status 1, the doc says 0"]
    assert run_text("```sh\ntrue\nfalse\n```\n") == ["exit status 1, the doc says 0"]


@pytest.mark.parametrize("text", [
    "```\nls\n```\n",  # no language
    "```bash\nls\n```\n",  # commands outside the convention
    "```console norun:\n$ ls\n```\n",  # no reason
    "```console fast\n$ ls\n```\n",  # unknown option
    "```console\nls\n```\n",  # output before any command
    "```text norun: why\nls\n```\n",  # norun on a non-command block
])
def test_blocks_outside_the_convention_are_refused(text: str) -> None:
    with pytest.raises(DocError):
        parse_blocks(text, "self-test.md")


def test_continuation_lines_and_exit_status() -> None:
    [block] = parse_blocks("```console\n$ echo a \\\n>   b   # exit status 0\na b\n"
                           "$ ls /nonexistent   # not there: exit status 2\n```\n", "x.md")
    assert [c.text for c in block.commands] == [
        "echo a \\\n  b   # exit status 0", "ls /nonexistent   # not there: exit status 2"]
    assert [c.status for c in block.commands] == [0, 2]
    assert block.commands[0].expected == ("a b",)
    assert [c.line for c in block.commands] == [2, 5]


# ---- links -----------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+).*?\1", re.DOTALL)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:")


def without_fences(text: str) -> str:
    kept, fence = [], None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening is not None:
            fence = opening.group("ticks")
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            kept.append(line)
    return "\n".join(kept)


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found: set[str] = set()
    for line in without_fences(markdown).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(doc: Path, root: Path = REPO) -> list[str]:
    """Relative links (outside code) whose file, folder or heading does not exist."""
    broken = []
    for match in LINK.finditer(CODE_SPAN.sub("", without_fences(doc.read_text()))):
        target = match.group("target")
        if SCHEME.match(target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif path != root and root not in path.parents:
            broken.append(f"{target}: outside the repository")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=[doc_name(d) for d in DOCS])
def test_relative_links_point_at_files(doc: Path) -> None:
    assert broken_links(doc) == []


def test_link_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    doc = tmp_path / "repo" / "x.md"
    (tmp_path / "outside.md").write_text("")
    doc.write_text("# A `code` title\n[a](missing.md) [b](x.md#a-code-title) [c](#nowhere) "
                   "`[d](gone.md)` [e](../outside.md) [f](https://example.com/x)\n")
    assert broken_links(doc, tmp_path / "repo") == [
        "missing.md: no such file", "#nowhere: no heading #nowhere in x.md",
        "../outside.md: outside the repository"]


# A path that leaves the repository: `../x` that names nothing in it (resolved from
# the file's folder and from the repository's root, as comments name paths both
# ways; a build output that git ignores counts as in it), or a path in the folder
# where this machine keeps its checkouts.
_RELATIVE_PATH = re.compile(r"(?<![\w./])((?:\.\./)+[\w.-][\w./-]*)")
_MACHINE_PATH = re.compile(r"(?<![\w.])/work/[\w.-]")


def _in_repository(path: Path, root: Path) -> bool:
    if path != root and root not in path.parents:
        return False
    ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=root, check=False)
    return path.exists() or ignored.returncode == 0


def paths_outside(text: str, folder: Path, root: Path = REPO) -> list[str]:
    """The paths in `text` (a file in `folder`) that point outside `root` or nowhere."""
    outside = [m.group(0) for m in _MACHINE_PATH.finditer(text)]
    for match in _RELATIVE_PATH.finditer(text):
        target = match.group(1)
        if not any(_in_repository(Path(os.path.normpath(base / target)), root)
                   for base in (folder, root)):
            outside.append(target)
    return outside


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    files = []
    for name in filter(None, names):
        path = REPO / name
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if path.is_file() and b"\0" not in path.read_bytes()[:4096]:
                path.read_text()
                files.append(path)
    return files


# Files whose `../` paths are the targets of links inside a container image (the
# attacks the hook must refuse), not paths of this machine: only the checkouts'
# folder and documents outside the repository are looked for there.
IMAGE_LINK_FILES = frozenset({
    "docs/operator/security.md", "tests/attacks/test_image_links.py",
    "tests/containers/test_docker_images.py", "tests/hook/test_inroot.py",
})


def outside_paths_of(path: Path, root: Path = REPO) -> list[str]:
    """What `paths_outside` finds in a tracked file, image-link files read as above."""
    found = paths_outside(path.read_text(), path.parent, root)
    if str(path.relative_to(root)) in IMAGE_LINK_FILES:
        return [p for p in found if not p.startswith("../") or p.endswith(".md")]
    return found


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs a git checkout")
def test_no_tracked_file_points_outside_the_repository() -> None:
    """Everything a file refers to is in the clone: the contract is docs/design.md."""
    found = {str(f.relative_to(REPO)): outside_paths_of(f)
             for f in tracked_text_files() if f != Path(__file__).resolve()}  # its examples
    assert {name: paths for name, paths in found.items() if paths} == {}


def test_outside_paths_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("")
    text = "see ../notes/CONTRACT.md, /work/main/x, ../docs/a.md and ../../up"
    assert paths_outside(text, tmp_path / "docs", tmp_path) == [
        "/work/m", "../notes/CONTRACT.md", "../../up"]
    # In a file of image links, a link target is no path of this machine; a document is.
    (tmp_path / "docs" / "operator").mkdir()
    links = tmp_path / "docs" / "operator" / "security.md"
    links.write_text("see ../notes/CONTRACT.md, /work/main/x and ../dev/leak")
    assert outside_paths_of(links, tmp_path) == ["/work/m", "../notes/CONTRACT.md"]


def test_the_design_is_in_the_repository_and_linked() -> None:
    design = REPO / "docs" / "design.md"
    assert design.is_file()
    for page in (REPO / "README.md", REPO / "docs" / "developer" / "architecture.md"):
        targets = [(page.parent / t.split("#")[0]).resolve()
                   for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text())]
        assert design in targets, page.name
