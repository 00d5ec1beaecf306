"""Read `ember.toml` and turn pydantic's errors into messages that name the file, the dotted
key and, for a misspelled key, the closest valid one."""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ember.errors import ManifestError
from ember.manifest.schema import Manifest
from ember.manifest.unsupported import refuse_unsupported

MANIFEST_NAME = "ember.toml"


def load_manifest(path: str | Path, *, check_files: bool = True) -> Manifest:
    """Load and validate a manifest file (or a package directory holding `ember.toml`).

    With `check_files`, paths the manifest names (weights, adapters, speculator) must exist
    relative to the manifest's directory.
    """
    path = Path(path)
    if not path.exists():
        raise ManifestError(f"{path}: no such file or directory")
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path}: no such file (a package needs an {MANIFEST_NAME}; "
                            "`ember init DIR --from HF_DIR` writes one)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8 text") from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise ManifestError(f"{path}: invalid TOML: arrays or inline tables nested too deeply") from None
    return parse_manifest(data, source=str(path), package_dir=path.parent if check_files else None)


def parse_manifest(data: dict[str, Any], *, source: str = MANIFEST_NAME,
                   package_dir: Path | None = None) -> Manifest:
    """Validate manifest data already parsed from TOML; settings nothing consumes yet are refused
    (manifest/unsupported.py)."""
    try:
        manifest = Manifest.model_validate(data, context={"package_dir": package_dir})
    except ValidationError as e:
        problems = [describe_error(err) for err in e.errors()]
        if len(problems) == 1:
            raise ManifestError(f"{source}: {problems[0]}") from None
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ManifestError(f"{source}: {len(problems)} problems:\n{listing}") from None
    refuse_unsupported(manifest, source)
    return manifest


def dotted(loc: tuple[int | str, ...]) -> str:
    """('lora', 0, 'path') -> 'lora[0].path'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe_error(err: Any) -> str:
    loc: tuple[int | str, ...] = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        where = f"[{dotted(parent)}]" if parent else "top level"
        valid = _field_names_at(parent)
        hint = _did_you_mean(key, valid)
        return f"unknown key '{dotted(loc)}' in {where}{hint}"
    if kind == "missing":
        if len(loc) == 1:
            return f"[{loc[0]}] section is missing"
        return f"{dotted(loc)}: required key is missing"
    message = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    where = dotted(loc) if loc else "manifest"
    if kind.endswith(("_type", "_parsing")) or kind in ("literal_error", "enum"):
        message += f" (got {err.get('input')!r})"
    return f"{where}: {message}"


def _did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f" — did you mean '{close[0]}'?"
    return f" (valid keys: {', '.join(valid)})" if valid else ""


def _field_names_at(loc: tuple[int | str, ...]) -> list[str]:
    """The valid keys of the section at `loc`, walking the schema's nested models."""
    model: Any = Manifest
    for part in loc:
        if isinstance(part, int):
            continue  # a list item: the element type was taken when the list field was seen
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return []
        model = _inner_model(model.model_fields[part].annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    """list[LoraEntry] -> LoraEntry; Optional[X] -> X; a model -> itself."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            inner = _inner_model(arg)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return annotation
