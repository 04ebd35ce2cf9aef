"""What the OCI hook's steps share: the container they work on, the undo
list, and the error they raise (so the steps' modules need not import the
hook's program)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from cgpu_km.container.envplan import DISABLED, Plan

PROG = "cgpu-hook"
ID_LENGTH = 12
EXIT_FAILED = 1
EXIT_BAD_VALUE = 2


class HookError(Exception):
    """A failure with a one-line message for the runtime to show."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Undo:
    """Actions that reverse completed steps, run newest first."""

    actions: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    def push(self, what: str, action: Callable[[], None]) -> None:
        self.actions.append((what, action))

    def run(self, stderr: TextIO) -> None:
        while self.actions:
            what, action = self.actions.pop()
            try:
                action()
            except Exception as error:
                print(f"{PROG}: warning: undoing {what} failed: {error}", file=stderr)


@dataclass
class HookContext:
    """What the steps work from: one container and its plan."""

    root: Path
    container_id: str
    bundle: Path
    env: dict[str, str]
    plan: Plan = DISABLED
    pid: int | None = None  # the container's init (at its start), from the OCI state

    @property
    def id12(self) -> str:
        return self.container_id[:ID_LENGTH]


PrestartStep = Callable[[HookContext, Undo], None]
PoststopStep = Callable[[HookContext], None]
