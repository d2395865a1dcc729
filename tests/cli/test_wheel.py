"""A non-editable install works anywhere (issue #31 item 1: a wheel without `profiles/` could not
plan, and `autosbp profiles` printed an empty table and exited 0).

The oracle is the wheel itself: built from a copy of the source, installed into a fresh venv
(`--system-site-packages` lends it torch and the other dependencies, `--no-deps` keeps pip
offline), and run from a folder that is not the checkout, where only the wheel's files exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autosbp.cli import main
from costmodel.profile_io import SHIPPED_PROFILES_DIR, shipped_profiles

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("cpu-gloo", "dgx-a100", "dgx-h100", "dgx1-v100")
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "*_cache", "autosbp-out"
)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOSBP_PROFILE_PATH")}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE)  # a stale build/ would leak into the wheel
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(root / "dist"), str(source)],
        root,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (path,) = (root / "dist").glob("autosbp-*.whl")
    return path


def test_the_profiles_are_package_data() -> None:
    assert SHIPPED_PROFILES_DIR.parent == Path(sys.modules["costmodel"].__file__ or "").parent
    assert set(SHIPPED) <= set(shipped_profiles())


def test_the_wheel_holds_the_profiles_and_schemas(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in SHIPPED:
        assert f"costmodel/profiles/{name}.json" in names
    assert {"costmodel/schemas/profile.schema.json", "autosbp/schemas/plan.schema.json"} <= names


@pytest.mark.slow
def test_an_installed_wheel_lists_profiles_and_plans_from_another_folder(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(python), "-c", "import costmodel; print(costmodel.__file__)"], elsewhere)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # not the checkout
    listed = _run([str(python), "-m", "autosbp.cli", "profiles"], elsewhere)
    assert listed.returncode == 0, listed.stderr
    for name in SHIPPED:
        assert name in listed.stdout
    planned = _run(
        [str(python), "-m", "autosbp.cli", "plan", "gpt", "--devices", "2", "--out", "p.json"],
        elsewhere,
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert (elsewhere / "p.json").is_file()


def test_profiles_skips_other_json_in_a_profile_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notes.json").write_text('{"a": 1}')
    monkeypatch.setenv("AUTOSBP_PROFILE_PATH", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "240")
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SHIPPED)
    assert "skipped" in out and "notes.json" in out and "not an autosbp profile" in out


def test_profiles_with_none_found_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("costmodel.profile_io.SHIPPED_PROFILES_DIR", Path("/nonexistent"))
    monkeypatch.delenv("AUTOSBP_PROFILE_PATH", raising=False)
    assert main(["profiles"]) == 2
    err = capsys.readouterr().err
    assert "no profiles found" in err and "reinstall" in err and "Traceback" not in err
