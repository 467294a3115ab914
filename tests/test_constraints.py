"""constraints.txt (the tested versions, used by .ci/run and the Dockerfile) pins every dependency the
package declares, at a version its own requirement accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def test_every_declared_dependency_is_pinned_at_a_version_it_accepts():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    pins = _pins()
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is declared in pyproject.toml but not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])


def test_the_ci_and_the_image_install_with_the_constraints():
    assert "-c constraints.txt" in (ROOT / ".ci" / "run").read_text()
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "-c /src/constraints.txt" in dockerfile and "constraints.txt" in dockerfile.split("COPY", 2)[1]
    assert "!constraints.txt" in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
