"""kmod/dkms.conf names the module and the project's version."""

from __future__ import annotations

import shlex
from pathlib import Path

from cgpu_km import __version__

KMOD = Path(__file__).resolve().parents[2] / "kmod"


def _settings() -> dict[str, str]:
    settings = {}
    for line in (KMOD / "dkms.conf").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key] = " ".join(shlex.split(value))
    return settings


def test_dkms_conf_matches_the_project() -> None:
    settings = _settings()
    assert settings["PACKAGE_NAME"] == "cgpu_km"
    assert settings["PACKAGE_VERSION"] == __version__
    assert settings["BUILT_MODULE_NAME[0]"] == "cgpu_km"
    assert "KDIR=${kernel_source_dir}" in settings["MAKE[0]"]
    assert (KMOD / "Kbuild").read_text().count("obj-m := cgpu_km.o") == 1
