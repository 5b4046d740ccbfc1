"""The wheel users install: built from this tree, it holds the whole package (its annotations'
marker and the mock API the README's examples use, not the tests), declares its dependencies
and extras, and, installed by itself beside the dependencies, runs a crawl through its console
script."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # (build isolation fetches the build backend pyproject.toml names, as pip does for users)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                           str(ROOT)], capture_output=True, text=True, cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("asyncrawl-*.whl")
    return built


def test_the_wheel_holds_the_package_and_declares_what_it_needs(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(info).decode()
        scripts = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    modules = {f"asyncrawl/{p.name}" for p in (ROOT / "asyncrawl").glob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert "asyncrawl/py.typed" in names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    assert "asyncrawl = asyncrawl.cli:main" in scripts
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    for dep in ("aiohttp", "aiolimiter", "aiofiles", "orjson"):
        assert any(r.startswith(dep) and "extra ==" not in r for r in requires), (dep, requires)
    for extra in ("postgres", "metrics", "parquet", "fast"):
        assert f"Provides-Extra: {extra}" in meta
    assert not any(r.startswith(("psycopg", "prometheus", "pyarrow", "uvloop")) and "extra ==" not in r
                   for r in requires), requires


def test_the_installed_wheel_crawls_through_its_console_script(wheel: Path, tmp_path: Path) -> None:
    """Installed apart from this checkout (``--target``, its dependencies those of this venv),
    the wheel's own ``asyncrawl`` runs the demo crawl against the bundled mock API."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--target", str(site), str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import asyncrawl; print(asyncrawl.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    demo = subprocess.run([str(site / "bin" / "asyncrawl"), "demo", "--ids", "300", "--state",
                           str(tmp_path / "state"), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    status = subprocess.run([str(site / "bin" / "asyncrawl"), "status", "--state",
                             str(tmp_path / "state")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    counts = {line.split()[0]: int(line.split()[1]) for line in status.stdout.splitlines()
              if line.split()[:1] in (["ok"], ["failed"], ["unavailable"])}
    assert sum(counts.values()) == 300, status.stdout
