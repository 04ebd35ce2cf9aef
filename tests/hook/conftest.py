"""The hook's claim records (cgpu_km.container.claims) go to a temporary folder here."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgpu_km.container.claims import CLAIM_DIR_ENV


@pytest.fixture(autouse=True)
def claim_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "claims"
    monkeypatch.setenv(CLAIM_DIR_ENV, str(folder))
    return folder
