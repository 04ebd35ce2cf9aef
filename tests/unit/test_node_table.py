"""Everything that restates the node table is generated from it or checked against it."""

from __future__ import annotations

from cgpu_km.tree import doctable


def test_doc_tables_are_fresh() -> None:
    for page in doctable.PAGES:
        text = page.read_text()
        assert doctable.replace(text) == text, (
            f"{page.name}: node table stale: run `python -m cgpu_km.tree.doctable`")


def test_doc_table_row_shows_range_initial_and_doc() -> None:
    rows = doctable.render().splitlines()
    assert "| `<gpu>/max_inst` | rw | `1`..`25` | `16` | most containers" in "\n".join(rows)
    assert "| `<gpu>/<ctr>/weight` | rw | `0`..`max_inst` | `1` |" in "\n".join(rows)
    assert "| `inst_ctl` | w |  |  | the command channel" in "\n".join(rows)
