"""The image's ld.so.preload as the hook reads it (issue 36, item 4): a pure
parser, held to glibc's own reading of the file.

glibc's loader (elf/rtld.c) blanks every '#' up to the end of its line,
stops at the first NUL (it reads the file as a C string) and splits the rest
on spaces, tabs, newlines and ':'. `parse_preload` accepts only what is clean
(printable text naming absolute paths), and then names exactly what the
loader would load, in its order; anything else is refused at the offset of
the first byte at fault.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cgpu_km.container.inject import (
    PATH_MAX,
    PRELOAD_AT,
    PreloadError,
    parse_preload,
    preload_text,
)
from cgpu_km.dataplane.region import CONTAINER_LIBRARY_PATH as LIBRARY

CLEAN = frozenset(range(0x20, 0x7F)) | {0x09, 0x0A}


def glibc_names(data: bytes) -> list[bytes]:
    """The names glibc's loader preloads from a file holding `data`."""
    text = bytearray(data)
    at = text.find(b"#")
    while at >= 0:
        end = text.find(b"\n", at)
        end = len(text) if end < 0 else end
        text[at:end] = b" " * (end - at)
        at = text.find(b"#", end)
    before_nul = bytes(text).split(b"\0", 1)[0]
    return [name for name in re.split(rb"[: \t\n]", before_nul) if name]


# Bytes that make every rule of the file matter: separators, comments, '$',
# a NUL, a byte that is not text, a non-ASCII one.
PIECES = st.sampled_from([b"/", b"lib", b"/a.so", b" ", b"\t", b"\n", b":", b"#", b"$LIB",
                          b"\0", b"\x7f", b"\xc3\xa9", b"\r", b"x", b"/usr/lib/b.so"])
FILES = st.lists(PIECES, max_size=16).map(b"".join)


@given(FILES)
@example(b"\0")
@example(b"/lib/a.so # comment\0 /lib/b.so")
@example(b"/a.so#x\n/b.so:/c.so")
def test_a_clean_file_names_what_the_loader_loads_else_the_offset_at_fault(data: bytes) -> None:
    try:
        entries = parse_preload(data)
    except PreloadError as error:
        assert 0 <= error.offset < len(data)
        assert str(error).startswith(f"{PRELOAD_AT} in the image ")
        assert f" at offset {error.offset}" in str(error)
        assert "\n" not in str(error)
        dirty = [at for at, byte in enumerate(data) if byte not in CLEAN]
        if dirty:
            assert error.offset == dirty[0]
            kind = "a NUL byte" if data[dirty[0]] == 0 else f"the byte 0x{data[dirty[0]]:02x}"
            assert f"has {kind} at offset" in str(error)
        else:
            # a name glibc would look up that is no absolute path, or that it expands
            names = glibc_names(data)
            bad = [name for name in names if not name.startswith(b"/") or b"$" in name]
            assert bad
            assert data[error.offset:].startswith(bad[0])
        return
    assert all(byte in CLEAN for byte in data)
    assert [entry.path.encode() for entry in entries] == glibc_names(data)
    for entry in entries:
        assert data[entry.offset:].startswith(entry.path.encode())
        assert entry.path.startswith("/")
        assert "$" not in entry.path


def test_a_nul_anywhere_is_refused_at_its_offset() -> None:
    with pytest.raises(PreloadError) as caught:
        parse_preload(b"/lib/a.so\n\0/lib/b.so\n")
    assert caught.value.offset == 10
    assert str(caught.value) == f"{PRELOAD_AT} in the image has a NUL byte at offset 10"


@pytest.mark.parametrize(("data", "offset", "why"), [
    (b"\0", 0, "has a NUL byte at offset 0"),
    (b"/lib/a.so\n\x7fELF", 10, "has the byte 0x7f at offset 10, which is not printable text"),
    (b"# caf\xc3\xa9\n", 5, "has the byte 0xc3 at offset 5, which is not printable text"),
    (b"/lib/a.so\r\n", 9, "has the byte 0x0d at offset 9, which is not printable text"),
    (b"# mine\nlibown.so\n", 7, "names libown.so at offset 7, which is not an absolute path"),
    (b"/lib/a.so:own.so", 10, "names own.so at offset 10, which is not an absolute path"),
    (b"/$LIB/own.so", 0, "names /$LIB/own.so at offset 0, which has a $ that the loader "
                         "would expand"),
    (b" /" + b"a" * PATH_MAX, 1, f"names /{'a' * 76}... at offset 1, which is longer than "
                                 f"{PATH_MAX - 1} bytes"),
])
def test_what_is_not_clean_is_named_by_its_offset(data: bytes, offset: int, why: str) -> None:
    with pytest.raises(PreloadError) as caught:
        parse_preload(data)
    assert (caught.value.offset, str(caught.value)) == (offset, f"{PRELOAD_AT} in the image {why}")


def test_names_comments_and_separators_as_glibc_reads_them() -> None:
    data = b"# the image's own\n/lib/a.so:/lib/b.so\t/lib/c.so#x\n\n  /lib/d.so"
    assert [(e.offset, e.path) for e in parse_preload(data)] == [
        (18, "/lib/a.so"), (28, "/lib/b.so"), (38, "/lib/c.so"), (53, "/lib/d.so")]
    assert parse_preload(b"") == []
    assert parse_preload(b"# nothing\n\n") == []


PATHS = st.lists(st.sampled_from(["/lib/a.so", "/lib/b.so", LIBRARY, "/usr/lib/x/c.so.1"]),
                 max_size=6)


@given(PATHS)
def test_libcgpu_comes_first_once_and_the_image_s_follow_in_their_order(own: list[str]) -> None:
    text = preload_text(own)
    names = [entry.path for entry in parse_preload(text)]
    assert names[0] == LIBRARY
    assert names[1:] == list(dict.fromkeys(path for path in own if path != LIBRARY))
    assert text.endswith(b"\n")
    assert [name.encode() for name in names] == glibc_names(text)
