"""simgpu's kernel trace (SIMGPU_KERNEL_TRACE, fifo engine): every kernel it booked."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    """One kernel as simgpu booked it (CLOCK_MONOTONIC ns)."""

    pid: int
    launch: int
    start: int
    end: int

    @property
    def us(self) -> int:
        return round((self.end - self.start) / 1000)


def parse_trace(text: str) -> list[Kernel]:
    """The lines of a trace, in booking order."""
    kernels = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] != ["kernel"]:
            raise ValueError(f"not a kernel line: {line!r}")
        fields = dict(word.split("=", 1) for word in words[1:])
        kernels.append(Kernel(int(fields["pid"]), int(fields["launch"]), int(fields["start"]),
                              int(fields["end"])))
    return kernels


def waiting_at_launch(kernels: list[Kernel], index: int) -> int:
    """How many kernels booked before kernels[index] had not started when it was launched."""
    launch = kernels[index].launch
    return sum(1 for other in kernels[:index] if other.start >= launch)
