"""What a runtime command line asks for, read the way runc reads it.

Engines call the runtime as `RUNTIME [global options] COMMAND [options] ID`:
docker and containerd's runc shim as `--root R --log L --log-format json
create --bundle B --pid-file P ID`, then `start`, `kill`, `delete`, and
`exec --process FILE` for `docker exec`. The wrapper needs the command, the
bundle of `create` and `run` (the working directory when none is given), the
process file of `exec`, and where the log goes. Options are spelled with one
or two dashes and take their value as the next word or after `=`, as in Go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# runc's global options that take a value (the others are switches).
GLOBAL_VALUED = frozenset({"log", "log-format", "root", "criu", "rootless"})
# Options of create/run/exec that take a value.
COMMAND_VALUED = frozenset({
    "bundle", "b", "console-socket", "pid-file", "preserve-fds", "process", "p", "cwd",
    "env", "e", "user", "u", "additional-gids", "g", "process-label", "apparmor", "cap", "c",
    "cgroup",
})
CREATING = frozenset({"create", "run"})


@dataclass(frozen=True)
class Invocation:
    """The parts of a runtime command line that the wrapper acts on."""

    command: str | None  # None: only global options (e.g. --version)
    bundle: Path | None  # create/run: --bundle, else the working directory
    process: Path | None  # exec: --process
    log: Path | None  # global --log
    log_format: str  # global --log-format: "text" (runc's default) or "json"


def _option(word: str) -> tuple[str, str | None] | None:
    """`--name=value` -> (name, value); `-name` -> (name, None); a non-option -> None."""
    if not word.startswith("-") or word in ("-", "--"):
        return None
    name, eq, value = word.lstrip("-").partition("=")
    return name, (value if eq else None)


def _options(words: Sequence[str], valued: frozenset[str]) -> tuple[dict[str, str], int]:
    """The leading options of `words` (last one wins) and the index of the first
    word that is not an option or an option's value."""
    found: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return found, i + 1
        parsed = _option(word)
        if parsed is None:
            return found, i
        name, value = parsed
        if value is None and name in valued and i + 1 < len(words):
            value = words[i + 1]
            i += 1
        found[name] = "" if value is None else value
        i += 1
    return found, i


def parse_argv(argv: Sequence[str], cwd: Path) -> Invocation:
    """Read a runtime command line (without the program name)."""
    global_options, at = _options(argv, GLOBAL_VALUED)
    command = argv[at] if at < len(argv) else None
    log = global_options.get("log") or None
    log_format = global_options.get("log-format") or "text"
    bundle = process = None
    if command is not None:
        options, _ = _options(argv[at + 1:], COMMAND_VALUED)
        if command in CREATING:
            given = options.get("bundle") or options.get("b")
            bundle = cwd / given if given else cwd
        elif command == "exec":
            given = options.get("process") or options.get("p")
            process = cwd / given if given else None
    return Invocation(command=command, bundle=bundle, process=process,
                      log=cwd / log if log else None, log_format=log_format)
