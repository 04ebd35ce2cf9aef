"""Everything that restates the node table is generated from it or checked against it."""

from __future__ import annotations

import argparse
import errno
import re
from dataclasses import fields
from pathlib import Path

import pytest

from cgpu_km.tree import doctable, kmod_header
from cgpu_km.tree.model import (
    Add,
    ControlTree,
    TreeError,
    add_tree_arguments,
    parse_command,
    tree_from_arguments,
)
from cgpu_km.tree.nodes import MAX_GPUS, NODES_BY_LEVEL, Kind, Level
from cgpu_km.tree.views import CONTAINER_NODES, GpuNodes

REPO = Path(__file__).resolve().parents[2]


def test_doc_tables_are_fresh() -> None:
    for page in doctable.PAGES:
        text = page.read_text()
        assert doctable.replace(text) == text, (
            f"{page.name}: node table stale: run `python -m cgpu_km.tree.doctable`")


def test_doc_table_row_shows_range_initial_and_doc() -> None:
    rows = doctable.render().splitlines()
    assert "| `<gpu>/max_inst` | rw | `1`..`25` | `16` | most containers" in "\n".join(rows)
    assert "| `<gpu>/<ctr>/weight` | rw | `0`..`max_inst` | `1` |" in "\n".join(rows)
    assert "| `inst_ctl` | rw |  |  | the command channel" in "\n".join(rows)


def test_module_parameters_take_their_descriptions_from_the_table() -> None:
    source = (REPO / "kmod" / "cgpu_km.c").read_text()
    described = dict(re.findall(r"MODULE_PARM_DESC\((\w+), (\w+|\"[^\"]*\")\);", source))
    gpu_values = [n for n in NODES_BY_LEVEL[Level.GPU].values() if n.kind is Kind.VALUE]
    for name in ["gpus", *(n.name for n in gpu_values)]:
        assert described[name] == f"CGPU_PARM_DESC_{name.upper()}", name
    descriptions = kmod_header.parameter_descriptions()
    for node in gpu_values:
        assert f"{node.minimum}..{node.maximum} (default {node.initial})" in descriptions[
            node.name]
    assert f"1..{MAX_GPUS}" in descriptions["gpus"]


def test_server_options_default_to_the_initial_values() -> None:
    parser = argparse.ArgumentParser()
    add_tree_arguments(parser)
    args = parser.parse_args([])
    options = {a.dest: a for a in parser._actions}
    for node in NODES_BY_LEVEL[Level.GPU].values():
        if node.kind is Kind.VALUE:
            assert getattr(args, node.name) == node.initial
            assert f"{node.minimum}..{node.maximum}" in (options[node.name].help or "")
    tree = tree_from_arguments(args)
    assert tree.gpus[0].values == {n: getattr(args, n) for n in tree.gpus[0].values}


def test_new_tree_and_container_take_the_initial_values() -> None:
    tree = ControlTree(MAX_GPUS)
    with pytest.raises(ValueError, match=f"1..{MAX_GPUS}"):
        ControlTree(MAX_GPUS + 1)
    tree.write("inst_ctl", b"add 0 c1")
    for level, values in ((Level.ROOT, tree.values), (Level.GPU, tree.gpus[0].values),
                          (Level.CONTAINER, tree.gpus[0].containers["c1"].values)):
        stored = {n.name: n.initial for n in NODES_BY_LEVEL[level].values()
                  if n.kind is Kind.VALUE}
        assert values == stored, level


def test_daemon_reads_nodes_of_the_table() -> None:
    gpu = {n.name for n in NODES_BY_LEVEL[Level.GPU].values() if n.kind is Kind.VALUE}
    assert {f.name for f in fields(GpuNodes)} - {"containers"} == gpu
    assert set(CONTAINER_NODES) <= set(NODES_BY_LEVEL[Level.CONTAINER])


@pytest.mark.parametrize("separator", [b" ", b"\t", b"\n", b"\v", b"\f", b"\r", b" \t "])
def test_command_words_split_on_the_contract_whitespace(separator: bytes) -> None:
    words = [b"add", b"0", b"c1", b"weight=2"]
    assert parse_command(separator.join(words)) == Add(0, "c1", {"weight": 2})


@pytest.mark.parametrize("separator", [bytes([c]) for c in range(0x1C, 0x20)] + [b"\xa0"])
def test_other_bytes_do_not_split_words(separator: bytes) -> None:
    with pytest.raises(TreeError) as caught:
        parse_command(b"add" + separator + b"0 c1")
    assert caught.value.errno == errno.EINVAL
