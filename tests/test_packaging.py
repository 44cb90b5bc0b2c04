"""The wheel ships the migrations inside autotune's namespace and nothing at the top level but
`autotune`: a top-level `migrations` package would collide with any other distribution's."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    [built] = out.glob("autotune-*.whl")
    return built


def test_the_wheel_holds_autotune_alone_with_its_migrations_inside(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"autotune"}
    for revision in (ROOT / "autotune" / "store" / "migrations" / "versions").glob("*.py"):
        assert f"autotune/store/migrations/versions/{revision.name}" in names
    assert "autotune/store/migrations/env.py" in names and "autotune/store/migrations/script.py.mako" in names
    assert "autotune/estimate/cuda_constants.json" in names  # the estimator reads it at import
    assert "autotune/estimate/stated_error.json" in names  # estimate, plan and the search state it
    for folder in ("static", "templates"):  # the service's pages, offline: their files and templates
        for page_file in (ROOT / "autotune" / "service" / folder).iterdir():
            assert f"autotune/service/{folder}/{page_file.name}" in names
    # Every package of the source tree is listed in pyproject.toml's `packages`.
    for init in (ROOT / "autotune").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names


def test_installed_alone_migrations_are_not_importable_but_ours_upgrade_a_database(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    script = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('migrations') is None, 'a top-level migrations package is installed'\n"
        "import autotune.store.migrations as m\n"
        f"assert m.__file__.startswith({str(target)!r}), m.__file__\n"
        "from autotune.store import upgrade_database\n"
        "print(upgrade_database(sys.argv[1]).after)\n"
    )
    # Run from an empty directory, so that the repository's own autotune/ is not on the path.
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "fresh.db")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    from autotune.store import SCHEMA_REVISION

    assert proc.stdout.strip() == SCHEMA_REVISION
