"""`autosbp profiles` beside a profile folder (AUTOSBP_PROFILE_PATH) that holds other JSON files:
each is skipped with one line naming it and why, every real profile is still listed, exit 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from autosbp.cli import main
from costmodel.profile_io import SHIPPED_PROFILES_DIR

OTHERS: dict[str, tuple[Callable[[Path], object], str]] = {
    "not-utf8": (lambda p: p.write_bytes(b"\xff\xfe{}"), "not UTF-8 text"),
    "a-folder": (lambda p: p.mkdir(), "Is a directory"),
    "dangling-link": (lambda p: p.symlink_to(p.parent / "nowhere"), "No such file"),
    "not-json": (lambda p: p.write_text("hello"), "invalid JSON"),
    "a-list": (lambda p: p.write_text("[1, 2]"), "not an autosbp profile"),
    "other-json": (lambda p: p.write_text('{"name": "x"}'), "not an autosbp profile"),
    "nan": (lambda p: p.write_text('{"a": NaN}'), "holds NaN"),
    "deep": (lambda p: p.write_text("[" * 100_000), "nests deeper"),
}


@pytest.mark.parametrize("case", list(OTHERS), ids=list(OTHERS))
def test_profiles_skips_what_is_no_profile(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    make, why = OTHERS[case]
    make(tmp_path / "other.json")
    monkeypatch.setenv("AUTOSBP_PROFILE_PATH", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "240")
    assert main(["profiles"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "Traceback" not in out + captured.err
    for shipped in sorted(SHIPPED_PROFILES_DIR.glob("*.json")):
        assert f"│ {shipped.stem} " in out, out
    skipped = [line for line in out.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 1, out
    assert skipped[0].startswith(f"skipped {tmp_path / 'other.json'}: ") and why in skipped[0]
