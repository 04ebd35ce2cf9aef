"""Differential test: the same random operations on a real tree and on the model.

`generate(seed, count)` makes a deterministic list of reads and writes on the
control tree, many of them malformed or out of range.  `shell_script(ops)`
turns it into a busybox sh script that performs them on `$CGPU_KM_ROOT` and
prints one result line each; `expected(ops)` gives the lines that the state
model `cgpu_km/tree/model.py` predicts.  The kernel-module VM test runs the script
on /proc/cgpu_km and compares (see kmod/vm/run-vm.sh); the same script runs
on the FUSE tree in tests/kmod/test_difftest.py.

    python tests/kmod/difftest.py script|expected|params [--seed S] [--count N]
    python tests/kmod/difftest.py compare EXPECTED ACTUAL
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cgpu_km.tree.model import ControlTree, TreeError
from cgpu_km.tree.nodes import NODES_BY_LEVEL, Level

GPUS = 2
GPU_MEMORY = (1_000_000, 0)  # GPU 1 has no known size: Free of a whole-device container is 0
DEFAULT_SEED = 20261129
DEFAULT_COUNT = 1500
DUMP_EVERY = 25
BEGIN = "CGPU-DIFF: begin"
END = "CGPU-DIFF: end"

NAMES = ["c1", "c2", "c3", "abcdef012345", "x.y-z_9"]
BAD_NAMES = ["policy", "free_weight", ".", "..", "a" * 65, "bad/x", "a\xe9", "", "a*"]
ERRNO_TEXT = {os.strerror(code): errno.errorcode[code] for code in errno.errorcode}
ERRNO_TEXT["nonexistent directory"] = "ENOENT"  # how busybox sh reports ENOENT on create


@dataclass(frozen=True)
class Op:
    """One operation: a write of `data` to `path`, a read of `path`, or a dump."""

    kind: str  # "w", "r" or "dump"
    path: str = ""
    data: bytes = b""


def _numbers(rng: random.Random, low: int, high: int) -> list[str]:
    picks = [low, high, low - 1, high + 1, rng.randint(max(low, 0), high)]
    return [str(p) for p in picks if p >= 0]


def _value_data(rng: random.Random, low: int, high: int) -> bytes:
    kind = rng.random()
    if kind < 0.55:
        text = rng.choice(_numbers(rng, low, high))
        return rng.choice(["{}", "{}\n", " {} ", "\t{}\n", "{}\r\n", "0{}"]).format(text).encode()
    return rng.choice(
        [
            b"",
            b" ",
            b"abc",
            b"+1",
            b"-1",
            b"0x10",
            b"1 2",
            b"1\x00",
            b"\xc2\xb2",
            b"18446744073709551615",
            b"18446744073709551616",
            b"9" * 70,
            b" " * 66 + b"1",
            b"1\x1c",
            b"3.0",
            b"\n",
        ]
    )


def _gpu_token(rng: random.Random) -> str:
    return rng.choice(["0", "0", "1", "1", "2", "99", "00", "x", "-1", "99999999999999999999999"])


def _name(rng: random.Random) -> str:
    return rng.choice(NAMES) if rng.random() < 0.85 else rng.choice(BAD_NAMES)


def _option(rng: random.Random) -> str:
    key = rng.choice(["memsize", "weight", "highprio", "util_limit", "weight", "foo", ""])
    value = rng.choice(["0", "1", "2", "4", "16", "17", "95", "96", "4096", "x", "", "=1"])
    return f"{key}={value}" if rng.random() < 0.95 else key


def _command(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.35:
        words = ["add", _gpu_token(rng), _name(rng)]
        words += [_option(rng) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
    elif kind < 0.5:
        words = ["del", _gpu_token(rng), _name(rng)] if rng.random() < 0.6 else ["del", _name(rng)]
    elif kind < 0.7:
        pairs = [
            f"{rng.choice(['1', '2', '10', '01', '0', '2147483648', 'x'])}="
            f"{rng.choice(['0', '100', '5000', '999999', '18446744073709551616', ''])}"
            for _ in range(rng.choice([0, 1, 2, 3]))
        ]
        words = ["meminfo", _gpu_token(rng), _name(rng), *pairs]
    elif kind < 0.8:
        words = ["-" + _name(rng)]
    elif kind < 0.92:
        words = [
            rng.choice("0123x")
            + rng.choice(["abcdef012345", "c1c1c1c1c1c1", "short", "toolong000000"])
        ]
    else:
        words = [rng.choice(["frob", "add", "del", "meminfo", "", "add 0"])]
    separator = rng.choice([" ", " ", " ", "  ", "\t", "\x1c"])
    text = separator.join(words)
    return (text + rng.choice(["", "\n", "\n", " \n"])).encode("latin-1")


def _paths(rng: random.Random) -> tuple[str, Level]:
    level = rng.choice([Level.ROOT, Level.GPU, Level.GPU, Level.CONTAINER, Level.CONTAINER])
    node = rng.choice([n for n in NODES_BY_LEVEL[level] if n != "major"])
    if level is Level.ROOT:
        return node, level
    gpu = rng.choice(["0", "0", "1"])
    if level is Level.GPU:
        return f"{gpu}/{node}", level
    return f"{gpu}/{rng.choice(NAMES)}/{node}", level


def generate(seed: int = DEFAULT_SEED, count: int = DEFAULT_COUNT) -> list[Op]:
    """A deterministic mix of commands, value writes, reads and dumps."""
    rng = random.Random(seed)
    ops: list[Op] = []
    for i in range(count):
        choice = rng.random()
        if choice < 0.8:
            if choice < 0.4:
                path, data = "inst_ctl", _command(rng)
            else:
                path, level = _paths(rng)
                node = NODES_BY_LEVEL[level][path.rsplit("/", 1)[-1]]
                high = 25 if node.maximum < 0 else node.maximum
                data = _value_data(rng, node.minimum, high)
            # A shell cannot write zero bytes (`echo -n ""` makes no write).
            ops.append(Op("w", path, data or b"\n"))
        else:
            ops.append(Op("r", _paths(rng)[0]))
        if i % DUMP_EVERY == DUMP_EVERY - 1:
            ops.append(Op("dump"))
    ops.append(Op("dump"))
    return ops


def _render(data: bytes) -> str:
    return data.decode("latin-1").replace("\n", "|")


def _dump(tree: ControlTree) -> list[str]:
    lines = []
    for path in ["default_memsize", "upgrade"]:
        lines.append(f"D {path} {_render(tree.read(path))}")
    for gpu in range(GPUS):
        names = sorted(tree.listdir(str(gpu)))
        lines.append(f"D {gpu} {' '.join(names)}")
        for node in ["policy", "max_inst", "prio_ratio", "free_weight"]:
            lines.append(f"D {gpu}/{node} {_render(tree.read(f'{gpu}/{node}'))}")
        for name in names:
            if name in NODES_BY_LEVEL[Level.GPU]:
                continue
            for node in NODES_BY_LEVEL[Level.CONTAINER]:
                path = f"{gpu}/{name}/{node}"
                lines.append(f"D {path} {_render(tree.read(path))}")
    return lines


def expected(ops: Sequence[Op], gpu_memory: tuple[int, ...] = GPU_MEMORY) -> list[str]:
    """The result lines the state model predicts for `ops` on a fresh tree."""
    tree = ControlTree(GPUS, gpu_memory=gpu_memory)
    lines = []
    for index, op in enumerate(ops):
        if op.kind == "dump":
            lines += [f"{index} {line}" for line in _dump(tree)]
            continue
        try:
            if op.kind == "w":
                tree.write(op.path, op.data)
                lines.append(f"{index} OK")
            else:
                lines.append(f"{index} = {_render(tree.read(op.path))}")
        except TreeError as exc:
            assert exc.errno is not None  # TreeError(code, reason) always sets it
            lines.append(f"{index} ERR {errno.errorcode[exc.errno]}")
    return lines


def module_params() -> str:
    """The kernel module's parameters that give the tree the model starts from."""
    return f"gpus={GPUS} gpu_mem={','.join(str(m) for m in GPU_MEMORY)}"


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _echo_escapes(data: bytes) -> str:
    """Every byte as `echo -e`'s \\0NNN escape, so any byte (NUL too) survives."""
    return "".join(f"\\0{byte:03o}" for byte in data)


SHELL_PRELUDE = r"""#!/bin/sh
# Generated by tests/kmod/difftest.py: do not edit.
R=${CGPU_KM_ROOT:?}
err() {
	case "$1" in
	*"Invalid argument"*) echo "$2 ERR EINVAL" ;;
	*"No space left on device"*) echo "$2 ERR ENOSPC" ;;
	*"resource busy"*) echo "$2 ERR EBUSY" ;;
	*"No such device"*) echo "$2 ERR ENODEV" ;;
	*"File exists"*) echo "$2 ERR EEXIST" ;;
	# busybox sh words ENOENT of a redirection its own way
	*"No such file or directory"* | *"nonexistent directory"* | *"no such file"*)
		echo "$2 ERR ENOENT" ;;
	*"Operation not permitted"*) echo "$2 ERR EPERM" ;;
	*"Permission denied"*) echo "$2 ERR EACCES" ;;
	*) echo "$2 ERR ? $1" ;;
	esac
}
w() {
	# echo, not printf: busybox printf fails silently on a write error.
	if out=$(echo -ne "$3" 2>&1 >"$R/$2"); then echo "$1 OK"; else err "$out" "$1"; fi
}
# Builtins only (no fork) where no error is expected: the VM is slow at exec.
content() { v=; while IFS= read -r l; do v="$v$l|"; done <"$1"; }
r() {
	if out=$(content "$R/$2" 2>&1 && echo "$v"); then echo "$1 = $out"; else err "$out" "$1"; fi
}
show() { content "$R/$2"; echo "$1 D $2 $v"; }
dump() {
	show "$1" default_memsize
	show "$1" upgrade
	for g in 0 1; do
		names=
		for e in "$R/$g"/*; do names="$names ${e##*/}"; done
		echo "$1 D $g${names}"
		for n in policy max_inst prio_ratio free_weight; do show "$1" "$g/$n"; done
		for e in "$R/$g"/*; do
			[ -d "$e" ] || continue
			for n in id memsize meminfo weight highprio util_limit; do
				show "$1" "$g/${e##*/}/$n"
			done
		done
	done
}
"""


def shell_script(ops: Sequence[Op]) -> str:
    """A busybox sh script that performs `ops` and prints one result line each."""
    lines = [SHELL_PRELUDE, f"echo '{BEGIN}'"]
    for index, op in enumerate(ops):
        if op.kind == "dump":
            lines.append(f"dump {index}")
        elif op.kind == "w":
            lines.append(f"w {index} {_sh_quote(op.path)} '{_echo_escapes(op.data)}'")
        else:
            lines.append(f"r {index} {_sh_quote(op.path)}")
    lines.append(f"echo '{END}'")
    return "\n".join(lines) + "\n"


def extract(output: str) -> list[str]:
    """The result lines between the begin and end markers of a console log."""
    lines = [line.rstrip("\r") for line in output.splitlines()]
    if BEGIN not in lines:
        return []
    body = lines[lines.index(BEGIN) + 1 :]
    return body[: body.index(END)] if END in body else body


def compare(want: Sequence[str], got: Sequence[str], ops: Sequence[Op] | None = None) -> list[str]:
    """Human-readable differences; empty when the results agree."""
    problems = []
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            op = ""
            if ops is not None:
                index = int(a.split(" ", 1)[0])
                op = f" after {ops[index]!r}" if index < len(ops) else ""
            problems.append(f"line {i}: model {a!r}, tree {b!r}{op}")
            if len(problems) >= 10:
                break
    if len(want) != len(got):
        problems.append(f"model gave {len(want)} lines, tree {len(got)}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["script", "expected", "params", "compare"])
    parser.add_argument("files", nargs="*", help="compare: EXPECTED ACTUAL (a console log)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT)
    args = parser.parse_args(argv)
    ops = generate(args.seed, args.count)
    if args.action == "script":
        sys.stdout.write(shell_script(ops))
    elif args.action == "params":
        print(module_params())
    elif args.action == "expected":
        sys.stdout.write("\n".join(expected(ops)) + "\n")
    else:
        if len(args.files) != 2:
            parser.error("compare needs EXPECTED and ACTUAL")
        want = Path(args.files[0]).read_text().splitlines()
        got = extract(Path(args.files[1]).read_text(errors="replace"))
        problems = compare(want, got, ops)
        for line in problems:
            print(f"difftest: {line}")
        print(
            f"difftest: {len(ops)} operations, {len(got)} result lines, "
            f"{'agree' if not problems else 'DIFFER'} with the model"
        )
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
