"""Find, read, validate and write hardware profile files.

Lives here: `load_profile` (a shipped name or a path), `save_profile` (atomic), `shipped_profiles`,
where this machine's profile is cached (`cache_dir`, `machine_profile_path`), and the
translation of JSON and JSON Schema failures into one-paragraph `ProfileError`s (file, JSON path,
problem, expected, fix). Lives elsewhere: dict <-> dataclass conversion and the semantic checks
(`profile_codec`), the schema itself (costmodel/schemas/profile.schema.json, package data).

Shipped profiles are the JSON files in `costmodel/profiles/`, package data: a wheel, an editable
install and a source checkout all see them. Directories listed in the environment variable
AUTOSBP_PROFILE_PATH (os.pathsep-separated) are searched first (a file there named like a shipped
one replaces it). The name "machine" is this machine's measured profile, cached per user
(`cache_dir`; measured and kept fresh by `costmodel.machine_profile`). A path always works.

Invariants: nothing is loaded without passing the schema and the codec's checks; the format name
and version are checked before the schema, so an old or future file says so instead of listing
field errors.
"""

from __future__ import annotations

import contextlib
import json
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from costmodel.errors import ProfileError
from costmodel.profile import PROFILE_FORMAT, PROFILE_VERSION, Profile
from costmodel.profile_codec import profile_error, profile_from_dict, profile_to_dict

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError

PROFILE_PATH_ENV = "AUTOSBP_PROFILE_PATH"
CACHE_DIR_ENV = "AUTOSBP_CACHE_DIR"
MACHINE_PROFILE = "machine"  # the name of this machine's measured, cached profile
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # package data
_LINE_WIDTH = 100  # columns; longer objects and lists are spread over lines
_QUANTITY_HINT = 'every number is written {"value": ..., "unit": ..., "source": ...}'


@cache
def profile_schema() -> dict[str, Any]:
    """The published JSON Schema of profile files (version PROFILE_VERSION)."""
    text = resources.files("costmodel").joinpath("schemas/profile.schema.json").read_text()
    return json.loads(text)


def profile_dirs() -> tuple[Path, ...]:
    """Directories searched for shipped profiles, in order (those that exist)."""
    extra = [Path(p) for p in os.environ.get(PROFILE_PATH_ENV, "").split(os.pathsep) if p]
    return tuple(d for d in (*extra, SHIPPED_PROFILES_DIR) if d.is_dir())


def shipped_profiles() -> dict[str, Path]:
    """Profile name -> file, for every *.json in `profile_dirs()` (earlier directories win)."""
    found: dict[str, Path] = {}
    for directory in profile_dirs():
        for path in sorted(directory.glob("*.json")):
            found.setdefault(path.stem, path)
    return found


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile:
    """Load and validate a profile: a shipped name ("dgx-a100") or a path to a JSON file."""
    path = _resolve(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ProfileError(
            f"profile {path}: cannot be read ({reason}). Pass the path of a profile JSON "
            "file (write one with `autosbp profile --out PATH`) or a shipped name: "
            f"{', '.join(sorted(shipped_profiles())) or 'none'}."
        ) from exc
    data = _parse_json(text, str(path))
    _check_format(data, str(path))
    _check_schema(data, str(path))
    return profile_from_dict(data, str(path))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write `profile` as JSON (validated against the schema first), atomically: a temporary
    file beside it, then a rename, so a kill or a full disk never leaves half a profile."""
    out = Path(path)
    data = profile_to_dict(profile)
    _check_schema(data, f"{out} (being saved)")
    profile_from_dict(data, f"{out} (being saved)")  # NaN or an overflowed fit: not written
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # a name per writer: no two share one
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(_format_json(data) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a read-only folder refuses the cleanup too
            tmp.unlink(missing_ok=True)
        raise ProfileError(
            f"profile {out}: cannot be written ({exc.strerror or exc}). Fix: choose a path in a "
            "writable directory with free space."
        ) from None
    return out


def cache_dir() -> Path:
    """The per-user folder this machine's measured profile is cached in: $AUTOSBP_CACHE_DIR,
    else $XDG_CACHE_HOME/autosbp/profiles, else ~/.cache/autosbp/profiles (made when written)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg if xdg else Path.home() / ".cache") / "autosbp/profiles"


def machine_profile_path() -> Path:
    """Where this machine's profile is cached (see `costmodel.machine_profile`)."""
    return cache_dir() / f"{MACHINE_PROFILE}.json"


def _resolve(name_or_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(name_or_path)
    if os.sep in text or text.endswith(".json") or Path(text).is_file():
        return Path(text)
    shipped = shipped_profiles()
    if text in shipped:
        return shipped[text]
    if text == MACHINE_PROFILE:
        cached = machine_profile_path()
        if cached.is_file():
            return cached
        raise ProfileError(
            f"profile {MACHINE_PROFILE!r}: this machine's profile is not measured yet (no "
            f"{cached}). Fix: run `autosbp profile --refresh` (a few seconds), or pass a shipped "
            f"profile: {', '.join(sorted(shipped)) or 'none'}."
        )
    where = ", ".join(str(d) for d in profile_dirs()) or f"{SHIPPED_PROFILES_DIR} (missing)"
    raise ProfileError(
        f"no shipped profile named {text!r} (searched {where}; available: "
        f"{', '.join(sorted(shipped)) or 'none'}). Pass a path to a profile JSON file, make one "
        f"with `autosbp profile --out PATH`, or add its directory to {PROFILE_PATH_ENV}."
    )


def _parse_json(text: str, origin: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        # an unterminated string can only end at the end of the file: JSON strings hold no newline
        truncated = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        problem = (
            f"the file ends early at line {exc.lineno} column {exc.colno} (truncated?)"
            if truncated
            else f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        )
        raise ProfileError(
            f"profile {origin}: {problem}. Expected a complete JSON object. Fix: "
            "restore the file (re-run `autosbp profile`, or repair the JSON)."
        ) from None
    except RecursionError:
        raise ProfileError(
            f"profile {origin}: the JSON nests deeper than a reader goes. Expected a profile "
            "(it nests 7 levels). Fix: pass a file written by `autosbp profile`."
        ) from None
    except _NonFiniteError as exc:
        raise ProfileError(
            f"profile {origin}: it holds {exc}, which is not a number a profile can price "
            "with. Expected finite numbers only. Fix: write the measured or spec-sheet value."
        ) from None


class _NonFiniteError(ValueError):
    """`NaN`, `Infinity` or `-Infinity` in a JSON text (Python's reader takes them by default)."""


def _refuse_constant(name: str) -> Any:
    raise _NonFiniteError(name)


def _check_format(data: Any, origin: str) -> None:
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise profile_error(
            origin,
            "$.format",
            f"this is not an autosbp profile (format {found!r})",
            f'"format": "{PROFILE_FORMAT}"',
            "pass a file written by `autosbp profile`",
        )
    if data.get("version") != PROFILE_VERSION:
        raise profile_error(
            origin,
            "$.version",
            f"schema version {data.get('version')!r} is not supported",
            f"version {PROFILE_VERSION} (this autosbp reads only that version)",
            "re-run `autosbp profile` with this autosbp, or use the autosbp that wrote the file",
        )


def _check_schema(data: Any, origin: str) -> None:
    import jsonschema  # 0.3 s to import: only when a profile is read or written
    from jsonschema.exceptions import best_match

    validator = jsonschema.Draft202012Validator(profile_schema())
    error = best_match(validator.iter_errors(data))
    if error is not None:
        raise profile_error(origin, error.json_path, *_explain(error))


def _explain(error: ValidationError) -> tuple[str, str, str]:
    """(problem, expected, fix) for a schema error, in the words of a profile author."""
    explain = _EXPLAIN.get(str(error.validator))
    if explain is not None:
        return explain(error)
    return (
        error.message,
        "a value the schema accepts",
        "see costmodel/schemas/profile.schema.json",
    )


def _explain_required(error: ValidationError) -> tuple[str, str, str]:
    required, props = error.validator_value, error.schema.get("properties", {})
    missing = [key for key in required if key not in error.instance]
    unit_enum = props.get("unit", {}).get("enum")
    if "unit" in missing and unit_enum:
        return (
            "missing unit",
            f"a unit, one of {', '.join(unit_enum)}",
            f'add "unit" ({_QUANTITY_HINT})',
        )
    hint = f" ({_QUANTITY_HINT})" if "value" in required else ""
    return (
        f"missing field {missing[0]!r}",
        f"fields {', '.join(required)}",
        f"add {missing[0]!r}{hint}",
    )


def _explain_unknown_key(error: ValidationError) -> tuple[str, str, str]:
    props = error.schema.get("properties", {})
    extra = [key for key in error.instance if key not in props]
    what = "link class" if error.json_path == "$.links" else "field"
    return (
        f"unknown {what} {extra[0]!r}",
        f"only {', '.join(props)}",
        "remove it or fix its spelling",
    )


def _explain_type(error: ValidationError) -> tuple[str, str, str]:
    want, inst = error.validator_value, error.instance
    fix = "write it without quotes" if want in ("number", "integer") else "fix its type"
    return f"{inst!r} is a {type(inst).__name__}", f"a JSON {want}", fix


def _explain_enum(error: ValidationError) -> tuple[str, str, str]:
    is_unit = error.json_path.endswith("unit")
    fix = "use one of these units (convert the value)" if is_unit else "use one of these values"
    allowed = ", ".join(map(str, error.validator_value))
    return f"{error.instance!r} is not allowed", f"one of {allowed}", fix


def _explain_const(error: ValidationError) -> tuple[str, str, str]:
    want = json.dumps(error.validator_value)
    return f"{error.instance!r} is not allowed", want, f"write {want}"


def _explain_range(error: ValidationError) -> tuple[str, str, str]:
    op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<="}[str(error.validator)]
    bound = f"a value {op} {error.validator_value}"
    meaning = error.schema.get("description")
    expected = f"{bound} ({meaning})" if meaning else bound
    return f"{error.instance!r} is out of range", expected, _range_fix(error.schema)


def _range_fix(schema: dict[str, Any]) -> str:
    """`write a number in [0, 1]` where the schema bounds both ends, else a plain fix."""
    high = schema.get("maximum")
    if high is not None and "minimum" in schema:
        return f"write a number in [{schema['minimum']}, {high}]"
    if high is not None and "exclusiveMinimum" in schema:
        return f"write a number in ({schema['exclusiveMinimum']}, {high}]"
    return "correct the number"


_EXPLAIN = {
    "required": _explain_required,
    "additionalProperties": _explain_unknown_key,
    "type": _explain_type,
    "enum": _explain_enum,
    "const": _explain_const,
    "minimum": _explain_range,
    "exclusiveMinimum": _explain_range,
    "maximum": _explain_range,
}


def _format_json(data: Any, indent: int = 0) -> str:
    """JSON with every object or list that fits in _LINE_WIDTH columns kept on one line."""
    flat = json.dumps(data, ensure_ascii=False)
    if not isinstance(data, dict | list) or indent + len(flat) <= _LINE_WIDTH or not data:
        return flat
    pad = " " * (indent + 2)
    if isinstance(data, dict):
        items = [f"{pad}{json.dumps(k)}: {_format_json(v, indent + 2)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + _format_json(v, indent + 2) for v in data]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
