"""The control tree's state model: rules, errno and parsers, without a mount."""

from __future__ import annotations

import copy
import errno
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpu_km.tree.model import (
    Add,
    ControlTree,
    Delete,
    Meminfo,
    TreeError,
    parse_command,
    parse_value,
)
from cgpu_km.tree.nodes import NODES, NODES_BY_LEVEL, Level


def errno_of(call: Callable[..., object], *args: object) -> int:
    with pytest.raises(TreeError) as info:
        call(*args)
    assert info.value.errno is not None  # TreeError(code, reason) always sets it
    return info.value.errno


@pytest.fixture
def tree() -> ControlTree:
    return ControlTree(2, gpu_memory=(16 << 30, 8 << 30))


def read(tree: ControlTree, path: str) -> str:
    return tree.read(path).decode()


def test_initial_values_come_from_the_node_table(tree: ControlTree) -> None:
    for node in NODES:
        if node.level is Level.GPU and node.name in ("policy", "max_inst", "prio_ratio"):
            assert read(tree, f"1/{node.name}") == f"{node.initial}\n"
    assert read(tree, "default_memsize") == "0\n"
    assert read(tree, "0/free_weight") == "16\n"
    assert tree.listdir("") == ["version", "default_memsize", "inst_ctl", "upgrade", "0", "1"]


@pytest.mark.parametrize(
    ("data", "value"),
    [(b"0", 0), (b"7\n", 7), (b"  12 \t\n", 12), (b"007", 7), (b"18446744073709551615", 2**64 - 1)],
)
def test_parse_value_accepts_decimal_with_whitespace(data: bytes, value: int) -> None:
    assert parse_value(data) == value


@pytest.mark.parametrize(
    "data", [b"", b" ", b"-1", b"+1", b"0x1", b"1 2", b"1.0", "\u0663".encode(), b"1_0", b"9" * 65]
)
def test_parse_value_rejects_everything_else(data: bytes) -> None:
    assert errno_of(parse_value, data) == errno.EINVAL


def test_write_out_of_range_is_einval_and_changes_nothing(tree: ControlTree) -> None:
    for path, bad in [("0/policy", b"6"), ("0/max_inst", b"0"), ("0/prio_ratio", b"19")]:
        before = tree.read(path)
        assert errno_of(tree.write, path, bad) == errno.EINVAL
        assert tree.read(path) == before


def test_read_only_nodes_refuse_writes(tree: ControlTree) -> None:
    tree.write("inst_ctl", b"add 0 a\n")
    for path in ["version", "0/free_weight", "0/major", "0/a/id", "0/a/meminfo"]:
        assert errno_of(tree.write, path, b"1") == errno.EPERM


def test_add_takes_options_and_defaults(tree: ControlTree) -> None:
    tree.write("inst_ctl", b"add 1 box memsize=5 weight=3 highprio=1 util_limit=40")
    assert [read(tree, f"1/box/{n}") for n in ("memsize", "weight", "highprio", "util_limit")] == [
        "5\n", "3\n", "1\n", "40\n",
    ]
    tree.write("default_memsize", b"4096")
    tree.write("inst_ctl", b"0abcdefabcdef\n")
    assert read(tree, "0/abcdefabcdef/memsize") == "4096\n"
    assert read(tree, "0/abcdefabcdef/weight") == "1\n"


def test_new_container_gets_at_most_the_free_weight(tree: ControlTree) -> None:
    tree.write("inst_ctl", b"add 0 big weight=15")
    tree.write("inst_ctl", b"add 0 mid weight=4")
    tree.write("inst_ctl", b"add 0 none")
    assert read(tree, "0/mid/weight") == "1\n"
    assert read(tree, "0/none/weight") == "0\n"
    assert read(tree, "0/free_weight") == "0\n"


def test_weight_and_max_inst_accounting(tree: ControlTree) -> None:
    tree.write("inst_ctl", b"add 0 a weight=10")
    tree.write("inst_ctl", b"add 0 b weight=5")
    assert errno_of(tree.write, "0/b/weight", b"7") == errno.ENOSPC
    assert errno_of(tree.write, "0/b/weight", b"17") == errno.EINVAL
    tree.write("0/b/weight", b"6")
    assert errno_of(tree.write, "0/max_inst", b"15") == errno.EBUSY
    tree.write("0/b/weight", b"0")
    tree.write("0/max_inst", b"10")
    assert read(tree, "0/free_weight") == "0\n"
    assert errno_of(tree.write, "0/max_inst", b"1") == errno.EBUSY


def test_container_count_limit(tree: ControlTree) -> None:
    tree.write("0/max_inst", b"2")
    tree.write("inst_ctl", b"add 0 a")
    tree.write("inst_ctl", b"add 0 b")
    assert errno_of(tree.write, "inst_ctl", b"add 0 c") == errno.ENOSPC
    assert errno_of(tree.write, "inst_ctl", b"add 0 a") == errno.EEXIST


def test_instance_ids_are_unique_and_shared_across_gpus(tree: ControlTree) -> None:
    for command in [b"add 0 a", b"add 0 b", b"add 1 a"]:
        tree.write("inst_ctl", command)
    assert read(tree, "0/a/id") == read(tree, "1/a/id")
    assert read(tree, "0/a/id") != read(tree, "0/b/id")
    tree.write("inst_ctl", b"-a")
    tree.write("inst_ctl", b"add 0 a")
    assert read(tree, "0/a/id") not in (read(tree, "0/b/id"), "1\n")


def test_delete_forms(tree: ControlTree) -> None:
    for command in [b"add 0 a", b"add 1 a", b"add 1 b"]:
        tree.write("inst_ctl", command)
    tree.write("inst_ctl", b"del 1 a")
    assert tree.listdir("1")[-1:] == ["b"]
    assert errno_of(tree.write, "inst_ctl", b"del 1 a") == errno.ENOENT
    assert errno_of(tree.write, "inst_ctl", b"del 5 a") == errno.ENODEV
    tree.write("inst_ctl", b"del b")
    tree.write("inst_ctl", b"-a")
    assert errno_of(tree.write, "inst_ctl", b"-a") == errno.ENOENT
    assert errno_of(tree.lookup, "0/a") == errno.ENOENT


def test_meminfo_feed_and_rendering(tree: ControlTree) -> None:
    tree.write("inst_ctl", b"add 0 a memsize=1000")
    tree.write("inst_ctl", b"meminfo 0 a 30=100 7=200")
    assert read(tree, "0/a/meminfo") == "Free: 700\nPID: 7 Mem: 200\nPID: 30 Mem: 100\n"
    tree.write("inst_ctl", b"meminfo 0 a 7=5000")
    assert read(tree, "0/a/meminfo") == "Free: 0\nPID: 7 Mem: 5000\n"
    tree.write("inst_ctl", b"add 1 whole")
    tree.write("inst_ctl", b"meminfo 1 whole 9=1024")
    assert read(tree, "1/whole/memsize") == "0\n"
    assert read(tree, "1/whole/meminfo") == f"Free: {(8 << 30) - 1024}\nPID: 9 Mem: 1024\n"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (b"add 0 a", Add(0, "a", {})),
        (b"add 3 a.b_c-d weight=0 memsize=9\n", Add(3, "a.b_c-d", {"weight": 0, "memsize": 9})),
        (b"5abcdefghijkl", Add(5, "abcdefghijkl", {})),
        (b"-abcdefghijkl\n", Delete(None, "abcdefghijkl")),
        (b"del x", Delete(None, "x")),
        (b"del 2 x", Delete(2, "x")),
        (b"meminfo 0 x 5=6", Meminfo(0, "x", {5: 6})),
    ],
)
def test_parse_command(command: bytes, expected: object) -> None:
    assert parse_command(command) == expected


@pytest.mark.parametrize(
    "command",
    [b"add 0 free_weight", b"add 0 policy", b"add 0 ..", b"add 0 a/b", b"abcdefghijklm", b"-",
     b"add 0 a weight", b"add 0 a =1", b"meminfo 0 a -1=5", b"meminfo 0 a 1=-5", b"add\x00 0 a",
     b"add 0 \xff"],
)
def test_parse_command_rejects(command: bytes) -> None:
    assert errno_of(parse_command, command) == errno.EINVAL


def test_bad_initial_values_are_refused() -> None:
    bad: list[Callable[[], ControlTree]] = [
        lambda: ControlTree(1, policy=6),
        lambda: ControlTree(1, max_inst=0),
        lambda: ControlTree(1, prio_ratio=100),
    ]
    for make in bad:
        with pytest.raises(ValueError, match="must be"):
            make()
    with pytest.raises(ValueError, match="gpus"):
        ControlTree(17)


# --- fuzzing: any bytes give either a clear errno or a valid change -------------

CONTRACT_ERRNOS = {errno.EINVAL, errno.ENODEV, errno.EEXIST, errno.ENOENT, errno.ENOSPC,
                   errno.EBUSY, errno.EPERM}


def _state(tree: ControlTree) -> object:
    return copy.deepcopy((tree.values, tree.gpus, tree._next_ident))


def _populated() -> ControlTree:
    tree = ControlTree(2)
    tree.write("inst_ctl", b"add 0 a weight=3 memsize=100")
    tree.write("inst_ctl", b"add 1 b")
    tree.write("inst_ctl", b"meminfo 0 a 1=10")
    return tree


def _check_invariants(tree: ControlTree) -> None:
    for gpu in tree.gpus:
        assert 0 <= gpu.free_weight() <= gpu.values["max_inst"]
        assert len(gpu.containers) <= gpu.values["max_inst"]
        for node in NODES_BY_LEVEL[Level.GPU].values():
            tree.read(f"{gpu.index}/{node.name}")
        for name in gpu.containers:
            assert tree.read(f"{gpu.index}/{name}/meminfo").startswith(b"Free: ")


command_words = st.sampled_from(
    ["add", "del", "meminfo", "0", "1", "2", "a", "b", "-a", "weight=", "memsize=", "highprio=",
     "util_limit=", "=", "5", "16", "99999999999999999999999", " ", "\n", "0abcdefabcdef"]
)
commands = st.one_of(
    st.binary(max_size=80),
    st.lists(command_words, max_size=8).map(lambda words: " ".join(words).encode()),
)
paths = st.sampled_from(
    ["inst_ctl", "default_memsize", "upgrade", "version", "0/policy", "0/max_inst",
     "1/prio_ratio", "0/free_weight", "0/a/weight", "0/a/memsize", "0/a/highprio",
     "0/a/util_limit", "1/b/weight", "0/a/id", "0/a/meminfo"]
)


@settings(max_examples=400, deadline=None)
@given(path=paths, data=st.one_of(commands, st.binary(max_size=24)))
def test_any_write_is_a_valid_change_or_a_clean_error(path: str, data: bytes) -> None:
    tree = _populated()
    before = _state(tree)
    try:
        tree.write(path, data)
    except TreeError as error:
        assert error.errno in CONTRACT_ERRNOS
        assert _state(tree) == before, "a failed write changed the tree"
    _check_invariants(tree)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40))
def test_parse_value_never_crashes(data: bytes) -> None:
    try:
        value = parse_value(data)
    except TreeError as error:
        assert error.errno == errno.EINVAL
    else:
        assert data.strip(b" \t\n\v\f\r").isdigit()
        assert value == int(data)
