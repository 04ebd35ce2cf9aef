"""cgpu_km/dataplane/region.py mirrors libcgpu/region.h: every offset and size matches."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from cgpu_km.dataplane import region

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "libcgpu" / "region.h"

STRUCTS = {
    "cgpu_gpu": region.GpuEntry,
    "cgpu_seen": region.SeenEntry,
    "cgpu_control": region.ControlLayout,
    "cgpu_proc_gpu": region.ProcGpu,
    "cgpu_proc": region.ProcSlot,
    "cgpu_account": region.AccountLayout,
}
CONSTANTS: dict[str, int | str] = {
    "CGPU_CONTROL_MAGIC": region.CONTROL_MAGIC,
    "CGPU_ACCOUNT_MAGIC": region.ACCOUNT_MAGIC,
    "CGPU_REGION_VERSION": region.VERSION,
    "CGPU_MAX_GPUS": region.MAX_GPUS,
    "CGPU_MAX_PROCS": region.MAX_PROCS,
    "CGPU_MAX_SEEN": region.MAX_SEEN,
    "CGPU_SEEN_MAX_AGE_NS": region.SEEN_MAX_AGE_NS,
    "CGPU_ID_LEN": region.ID_LEN,
    "CGPU_PATH_LEN": region.PATH_LEN,
    "CGPU_UUID_LEN": region.UUID_LEN,
    "CGPU_DEFAULT_GATE_TIMEOUT_NS": region.DEFAULT_GATE_TIMEOUT_NS,
    "CGPU_DEFAULT_MAX_INFLIGHT": region.DEFAULT_MAX_INFLIGHT,
    "CGPU_DEFAULT_QUEUE_NS": region.DEFAULT_QUEUE_NS,
    "CGPU_CONTENDED_QUEUE_NS": region.CONTENDED_QUEUE_NS,
    "CGPU_MODE_CGPU": region.MODE_CGPU,
    "CGPU_MODE_EGPU": region.MODE_EGPU,
    "CGPU_GATE_OPEN": region.GATE_OPEN,
    "CGPU_GATE_CLOSED": region.GATE_CLOSED,
    "CGPU_GATE_ARMED": region.GATE_ARMED,
    "CGPU_SLOT_FREE": region.SLOT_FREE,
    "CGPU_SLOT_CLAIMING": region.SLOT_CLAIMING,
    "CGPU_SLOT_LIVE": region.SLOT_LIVE,
    "CGPU_SLOT_RECLAIMING": region.SLOT_RECLAIMING,
    "CGPU_CTX_MEASURE": region.CTX_MEASURE,
    "CGPU_CONTAINER_REGION_DIR": region.CONTAINER_REGION_DIR,
    "CGPU_CONTROL_NAME": region.CONTROL_NAME,
    "CGPU_ACCOUNT_NAME": region.ACCOUNT_NAME,
}


def python_layout() -> dict[str, int | str]:
    """`struct.field` -> offset, and `struct` -> size, as ctypes lays them out."""
    out: dict[str, int | str] = {}
    for cname, struct in STRUCTS.items():
        out[cname] = ctypes.sizeof(struct)
        for name, *_ in struct._fields_:
            field = getattr(struct, name)
            out[f"{cname}.{name}"] = field.offset
            out[f"{cname}.{name}#size"] = field.size
    for name, value in CONSTANTS.items():
        out[name] = value
    return out


def probe_source(keys: list[str]) -> str:
    lines = ['#include <stddef.h>', '#include <stdio.h>', f'#include "{HEADER}"',
             "int main(void) {"]
    for key in keys:
        if key.startswith("CGPU_") and isinstance(CONSTANTS.get(key), str):
            lines.append(f'    printf("%s %s\\n", "{key}", {key});')
            continue
        if key.startswith("CGPU_"):
            expr = f"(unsigned long long)({key})"
        elif key.endswith("#size"):
            struct, field = key[:-5].split(".")
            expr = f"sizeof(((struct {struct} *)0)->{field})"
        elif "." in key:
            struct, field = key.split(".")
            expr = f"offsetof(struct {struct}, {field})"
        else:
            expr = f"sizeof(struct {key})"
        lines.append(f'    printf("%s %llu\\n", "{key}", (unsigned long long)({expr}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def test_python_layout_matches_header(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to compile the layout probe")
    expected = python_layout()
    source = tmp_path / "probe.c"
    source.write_text(probe_source(sorted(expected)))
    binary = tmp_path / "probe"
    subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", "-o", str(binary), str(source)],
                   check=True)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    from_c = {key: int(value) if value.isdigit() else value
              for key, value in (line.split() for line in output.splitlines())}
    mismatches = {k: (expected[k], from_c[k]) for k in expected if expected[k] != from_c[k]}
    assert mismatches == {}, f"python vs C (offset/size): {mismatches}"
    assert from_c["cgpu_control"] == region.CONTROL_SIZE
    assert from_c["cgpu_account"] == region.ACCOUNT_SIZE


def test_every_header_field_is_mirrored() -> None:
    """A field added to region.h must be added to region.py too."""
    text = HEADER.read_text()
    for cname, struct in STRUCTS.items():
        body = text[text.index(f"struct {cname} {{"):]
        body = body[:body.index("};")]
        declared = set()
        for line in body.splitlines()[1:]:
            code = line.split("/*")[0].strip().rstrip(";")
            if code:
                declared.add(code.split()[-1].split("[")[0])
        mirrored = {name for name, *_ in struct._fields_}
        assert declared == mirrored, cname
