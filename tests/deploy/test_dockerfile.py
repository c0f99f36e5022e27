"""The image holds every package the project installs (docker itself does not run here)."""

from __future__ import annotations

import re
import tomllib

from tests.support.processes import ROOT


def test_the_image_copies_every_package():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.M))
    assert packages - copied == set(), "packages the image would lack"
