"""Generate the kernel module's C node table from the Python node table.

`python -m cgpu_km.tree.kmod_header [OUTPUT]` writes `kmod/cgpu_km_nodes.h`
(to stdout without OUTPUT).  The header is checked in; a test fails when it
differs from a fresh generation, so the module and the FUSE tree cannot
drift apart.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from cgpu_km import __version__
from cgpu_km.tree.nodes import (
    COMMAND_WRITE_MAX,
    ID_MAX_LEN,
    INST_CTL_USAGE,
    LEGACY_ID_LEN,
    MAX_GPUS,
    MAX_INST,
    NODES,
    VALUE_WRITE_MAX,
    Kind,
    Level,
    Node,
)

HEADER_PATH = Path(__file__).resolve().parents[2] / "kmod" / "cgpu_km_nodes.h"

_LEVEL_C = {Level.ROOT: "ROOT", Level.GPU: "GPU", Level.CONTAINER: "CONTAINER"}


def _c_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _u64(value: int) -> str:
    return f"{value}ULL"


def _node_enum(node: Node) -> str:
    return f"CGPU_NODE_{node.name.upper()}"


def _slot_enum(node: Node) -> str:
    return f"CGPU_{_LEVEL_C[node.level]}_{node.name.upper()}"


def _value_nodes(level: Level) -> list[Node]:
    return [n for n in NODES if n.level is level and n.kind is Kind.VALUE]


def _enum(name: str, members: Iterable[str]) -> list[str]:
    return [f"enum {name} {{", *(f"\t{m}," for m in members), "};", ""]


def _node_initializer(node: Node) -> list[str]:
    slot = _slot_enum(node) if node.kind is Kind.VALUE else "-1"
    bound_by_max_inst = node.maximum == MAX_INST
    maximum = 0 if bound_by_max_inst else node.maximum
    return [
        f"\t[{_node_enum(node)}] = {{",
        f"\t\t.name = {_c_string(node.name)},",
        f"\t\t.level = CGPU_LEVEL_{_LEVEL_C[node.level]},",
        f"\t\t.kind = CGPU_KIND_{node.kind.name},",
        f"\t\t.mode = 0{node.mode:o},",
        f"\t\t.slot = {slot},",
        f"\t\t.min = {_u64(node.minimum)},",
        f"\t\t.max = {_u64(maximum)},",
        f"\t\t.max_is_max_inst = {'true' if bound_by_max_inst else 'false'},",
        f"\t\t.initial = {_u64(node.initial)},",
        "\t},",
    ]


def parameter_descriptions() -> dict[str, str]:
    """MODULE_PARM_DESC of each module parameter, from the table's ranges and initials."""
    descriptions = {"gpus": f"number of GPU directories, 1..{MAX_GPUS} (default 1)"}
    for node in _value_nodes(Level.GPU):
        descriptions[node.name] = (
            f"initial {node.name} of every GPU, {node.minimum}..{node.maximum}"
            f" (default {node.initial})"
        )
    return descriptions


def render() -> str:
    """The whole header, deterministic for a given node table."""
    lines = [
        "/* SPDX-License-Identifier: GPL-2.0-only */",
        "/*",
        " * The control tree's node table, generated from cgpu_km/tree/nodes.py by",
        " * `python -m cgpu_km.tree.kmod_header kmod/cgpu_km_nodes.h`. Do not edit:",
        " * tests/kmod/test_header.py fails when this file is stale.",
        " */",
        "#ifndef CGPU_KM_NODES_H",
        "#define CGPU_KM_NODES_H",
        "",
        "#include <linux/types.h>",
        "",
        f"#define CGPU_KM_VERSION {_c_string(__version__)}",
        f"#define CGPU_ID_MAX_LEN {ID_MAX_LEN}",
        f"#define CGPU_LEGACY_ID_LEN {LEGACY_ID_LEN}",
        f"#define CGPU_VALUE_WRITE_MAX {VALUE_WRITE_MAX}",
        f"#define CGPU_COMMAND_WRITE_MAX {COMMAND_WRITE_MAX}",
        f"#define CGPU_MAX_GPUS {MAX_GPUS}",
        f"#define CGPU_INST_CTL_USAGE {_c_string(INST_CTL_USAGE)}",
        "",
        "/* MODULE_PARM_DESC of the module parameters. */",
        *(f"#define CGPU_PARM_DESC_{name.upper()} {_c_string(text)}"
          for name, text in parameter_descriptions().items()),
        "",
    ]
    lines += _enum("cgpu_level", (f"CGPU_LEVEL_{_LEVEL_C[lv]}" for lv in Level))
    lines += _enum("cgpu_kind", (f"CGPU_KIND_{k.name}" for k in Kind))
    lines += _enum("cgpu_node_id", [*(_node_enum(n) for n in NODES), "CGPU_NODE_COUNT"])
    for level in Level:
        lines += [f"/* Nodes in each {level.value} directory, and its stored values. */"]
        count = sum(1 for n in NODES if n.level is level)
        lines += [f"#define CGPU_{_LEVEL_C[level]}_NODES {count}"]
        slot_enum = f"cgpu_{level.value}_slot"
        slots = [_slot_enum(n) for n in _value_nodes(level)]
        lines += _enum(slot_enum, [*slots, f"CGPU_{_LEVEL_C[level]}_SLOTS"])
    lines += [
        "struct cgpu_node_def {",
        "\tconst char *name;",
        "\tenum cgpu_level level;",
        "\tenum cgpu_kind kind;",
        "\tumode_t mode;",
        "\tint slot;\t\t/* index into the level's values; -1 unless a VALUE */",
        "\tu64 min;",
        "\tu64 max;",
        "\tbool max_is_max_inst;\t/* max is the GPU's current max_inst */",
        "\tu64 initial;",
        "};",
        "",
        "static const struct cgpu_node_def cgpu_nodes[CGPU_NODE_COUNT] = {",
    ]
    for node in NODES:
        lines += _node_initializer(node)
    lines += ["};", "", "#endif /* CGPU_KM_NODES_H */", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m cgpu_km.tree.kmod_header [OUTPUT]", file=sys.stderr)
        return 2
    text = render()
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
