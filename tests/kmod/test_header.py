"""The kernel module's checked-in node table matches the Python node table."""

from __future__ import annotations

import re
from pathlib import Path

from cgpu_km.tree import kmod_header as gen_kmod_header
from cgpu_km.tree.nodes import MAX_INST, NODES, Kind


def test_checked_in_header_is_fresh() -> None:
    checked_in = gen_kmod_header.HEADER_PATH.read_text()
    assert checked_in == gen_kmod_header.render(), (
        "kmod/cgpu_km_nodes.h is stale: run `make -C kmod header`"
    )


def test_header_describes_every_node() -> None:
    text = gen_kmod_header.render()
    for node in NODES:
        start = rf"\[CGPU_NODE_{node.name.upper()}\] = "
        block = re.search(start + r"\{(.*?)\n\t\},", text, re.S)
        assert block is not None, node.name
        fields = dict(re.findall(r"\.(\w+) = ([^,]+),", block.group(1)))
        assert fields["name"] == f'"{node.name}"'
        assert int(fields["mode"], 8) == node.mode
        assert fields["kind"] == f"CGPU_KIND_{node.kind.name}"
        assert fields["min"] == f"{node.minimum}ULL"
        if node.maximum == MAX_INST:
            assert fields["max_is_max_inst"] == "true"
        else:
            assert fields["max"] == f"{node.maximum}ULL"
        assert fields["initial"] == f"{node.initial}ULL"
        assert (fields["slot"] == "-1") == (node.kind is not Kind.VALUE)


def test_main_writes_the_header(tmp_path: Path) -> None:
    out = tmp_path / "nodes.h"
    assert gen_kmod_header.main([str(out)]) == 0
    assert out.read_text() == gen_kmod_header.render()
    assert gen_kmod_header.main(["a", "b"]) == 2
