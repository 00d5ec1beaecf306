"""`ember init`: scaffold a package from a Hugging Face checkpoint directory.

The checkpoint is copied (or hardlinked) into `weights/` and an `ember.toml` is written from its
`config.json`, with every other manifest key present but commented out, generated from the schema so
that the scaffold never falls behind it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import typing
import unicodedata
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ember.errors import PackageError
from ember.manifest import MANIFEST_NAME, Manifest, load_manifest, parse_manifest
from ember.package.files import IGNORED_DIRS, is_ignored, refuse_pickle

WEIGHTS_DIR = "weights"
DEFAULT_MAX_MODEL_LEN = 4096  # a scaffold's cap: long contexts cost KV memory the author may not have
DTYPES = ("float32", "float16", "bfloat16")

# Values shown for keys that have no default (None or required), so that uncommenting one gives a
# line that parses. Keyed by "section.key".
_EXAMPLES: dict[str, Any] = {
    "model.license": "apache-2.0",
    "runtime.max_model_len": DEFAULT_MAX_MODEL_LEN,
    "runtime.kv_cache_memory_gb": 8.0,
    "speculator.model": "speculator",
    "lora.name": "my-adapter",
    "lora.path": "adapters/my-adapter",
}
_COMMENT_COLUMN = 40


def init_package(target: Path, hf_dir: Path, *, name: str | None = None, version: str = "0.1.0",
                 link: bool = False) -> Path:
    """Scaffold an Ember package at `target` from the Hugging Face checkpoint in `hf_dir`.

    `target` must not exist or be an empty directory. The package name is `name`, or `target`'s own name (the
    checkpoint's where that makes no name), made to fit the manifest's name rules. With `link`, weights are hardlinked
    instead of copied where the filesystem allows. Everything is built in a temporary directory
    beside `target` and renamed into place at the end, so a failure leaves nothing at `target`.
    Returns `target`.
    """
    # absolute(): `ember init .` needs a real name and parent for the temporary directory.
    target, hf_dir = Path(target).absolute(), Path(hf_dir).resolve()
    _check_target(target)
    config = _read_config(hf_dir)
    sources = checkpoint_files(hf_dir)
    if not any("/" not in rel and rel.endswith(".safetensors") for rel in sources):
        raise PackageError(f"{hf_dir}: no *.safetensors file; Ember loads safetensors weights only "
                           "(save the model with transformers' save_pretrained to get them)")

    # The package is named after the directory the user asked for (`ember init my-model --from ...` makes
    # my-model), the checkpoint's name only when that directory's name makes no name (`ember init . --from`).
    slug = slugify(name) if name is not None else (slugify(target.name) or slugify(checkpoint_name(hf_dir)))
    if not slug:
        raise PackageError(f"cannot make a package name from {name or target.name!r}: pass a name made of "
                           "lowercase letters, digits, '.', '_' or '-'")
    values = manifest_values(config, name=slug, version=version, source=hf_dir)
    # Validate before anything is written, naming the file the user will look for.
    parse_manifest(values, source=str(target / MANIFEST_NAME))

    target.parent.mkdir(parents=True, exist_ok=True)
    # ".ember-tmp" names are ignored by package_files, so a leftover from a crash never gets locked.
    tmp = target.parent / f".ember-tmp-{target.name}-{secrets.token_hex(4)}"
    tmp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would become the package's after the rename
    try:
        for rel in sources:
            _place(hf_dir / rel, tmp / WEIGHTS_DIR / rel, link=link)
        (tmp / MANIFEST_NAME).write_text(render_manifest(values, source=hf_dir), encoding="utf-8")
        load_manifest(tmp)  # the rendered file must round-trip; a failure here is a bug in this module
        if target.exists():
            # An empty directory the user made (perhaps their working directory): keep it, fill it.
            for child in sorted(tmp.iterdir()):
                child.rename(target / child.name)
            tmp.rmdir()
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def is_plain_checkpoint(path: Path) -> bool:
    """A Hugging Face checkpoint directory that is not (yet) an Ember package."""
    return not (path / MANIFEST_NAME).exists() and (path / "config.json").is_file()


def package_for_checkpoint(hf_dir: Path, workspace: Path) -> Path:
    """An Ember package generated from a plain checkpoint, as `ember init` would make it (weights hardlinked where
    the filesystem allows), in `workspace`: what `ember serve HF_DIR` serves. Made anew each time, so it follows the
    checkpoint; one directory per checkpoint path, so two checkpoints of one name do not collide."""
    hf_dir = Path(hf_dir).resolve()
    name = slugify(checkpoint_name(hf_dir)) or "model"
    target = Path(workspace) / f"{name}-{hashlib.sha256(str(hf_dir).encode()).hexdigest()[:8]}"
    shutil.rmtree(target, ignore_errors=True)
    return init_package(target, hf_dir, name=name, link=True)


def checkpoint_files(hf_dir: Path) -> list[str]:
    """Relative POSIX paths of the checkpoint files to copy, sorted; refuses pickle checkpoints.

    Hidden files and directories are skipped: in a checkpoint they are tool state, such as the
    `.cache/` that `huggingface-cli download --local-dir` leaves, or `.gitattributes`.
    """
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(hf_dir):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_DIRS and not d.startswith("."))
        for filename in sorted(filenames):
            rel = (here / filename).relative_to(hf_dir)
            if filename.startswith(".") or is_ignored(rel):
                continue
            if not (here / filename).is_file():
                raise PackageError(f"{here / filename}: not a regular file (a broken link?)")
            found.append(rel.as_posix())
    has_safetensors = any(rel.endswith(".safetensors") for rel in found)
    for rel in found:
        try:
            refuse_pickle(str(hf_dir / rel))  # absolute, so its conversion hint names the real directory
        except PackageError as e:
            if has_safetensors:
                # Hub repositories often ship both formats; then the pickle is a redundant copy.
                raise PackageError(f"{e}. This checkpoint also has *.safetensors weights, so the pickle "
                                   "file is likely a redundant copy: delete it (or download with "
                                   "--exclude '*.bin' '*.pt' '*.pth')") from None
            raise
    return sorted(found)


def checkpoint_name(hf_dir: Path) -> str:
    """The name a checkpoint directory stands for.

    In the Hugging Face cache a checkpoint lives at `models--ORG--NAME/snapshots/<commit>`, where the
    directory's own name is a commit hash; the repository name is the useful one.
    """
    if hf_dir.parent.name == "snapshots" and hf_dir.parent.parent.name.startswith("models--"):
        return hf_dir.parent.parent.name.split("--")[-1]
    return hf_dir.name


def slugify(text: str) -> str:
    """Make `text` a valid package name: lowercase, runs of other characters become '-'.

    "Meta-Llama-3.1-8B Instruct" -> "meta-llama-3.1-8b-instruct". May return "" (nothing usable).
    """
    # Accented letters keep their base letter ("Ünïcode" -> "unicode") rather than becoming '-'.
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9._-]+", "-", ascii_text.strip().lower())
    slug = slug.lstrip("._-")[:64]
    return slug.rstrip("._-")


def manifest_values(config: dict[str, Any], *, name: str, version: str, source: Path) -> dict[str, Any]:
    """The manifest keys that a checkpoint's config.json determines, as TOML-ready data."""
    # Multimodal checkpoints keep the language model's settings under text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def lookup(key: str) -> Any:
        return config[key] if key in config else text.get(key)

    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else config.get("model_type", "unknown")
    runtime: dict[str, Any] = {"dtype": _dtype(lookup("dtype") or lookup("torch_dtype"))}
    max_positions = lookup("max_position_embeddings")
    if isinstance(max_positions, int) and not isinstance(max_positions, bool) and max_positions >= 16:
        runtime["max_model_len"] = min(max_positions, DEFAULT_MAX_MODEL_LEN)
    return {
        "model": {"name": name, "version": version, "weights": WEIGHTS_DIR,
                  "description": f"{architecture} checkpoint, scaffolded from {source.name}"},
        "runtime": runtime,
    }


def render_manifest(values: dict[str, Any], *, source: Path) -> str:
    """An `ember.toml`: `values` as set keys, every other schema key commented out with its default.

    Each key carries its schema description as a trailing comment, so removing the leading "# " of a
    line always leaves valid TOML.
    """
    lines = [
        f"# Ember package manifest, scaffolded by `ember init` from {source}.",
        "# Keys that are commented out show their defaults: uncomment a line to change it.",
        "# `ember schema` prints the full JSON Schema; `ember build` validates this file.",
        "# Hook implementations for this model go in hooks.py beside this file.",
    ]
    for section, field in Manifest.model_fields.items():
        model, is_list = _section_model(field.annotation)
        set_values = values.get(section, {})
        doc = (model.__doc__ or "").strip().splitlines()[0]
        lines.append("")
        if is_list:
            # An array of tables has no default entry to show: give a commented-out example.
            lines += [f"# {doc}", f"# [[{section}]]"]
        elif set_values:
            lines += [f"# {doc}", f"[{section}]"]
        else:
            lines += [f"# {doc}", f"# [{section}]"]
        for key, info in model.model_fields.items():
            description = info.description or ""
            if key in set_values:
                lines.append(_with_comment(f"{key} = {toml_value(set_values[key])}", description))
                continue
            default = info.get_default(call_default_factory=True)
            if default is None or default is PydanticUndefined:
                example = _EXAMPLES.get(f"{section}.{key}")
                if example is None:
                    lines.append(f"# {key}: unset by default. {description}".rstrip())
                    continue
                description = f"(example) {description}".rstrip()
                default = example
            lines.append(_with_comment(f"# {key} = {toml_value(default)}", description))
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    """A TOML literal for a default or a filled-in value (str, bool, int, float, dict, list)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # TOML forbids raw control characters in strings
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _with_comment(line: str, comment: str) -> str:
    if not comment:
        return line
    return f"{line.ljust(_COMMENT_COLUMN - 1)} # {comment}"


def _section_model(annotation: Any) -> tuple[type[BaseModel], bool]:
    """RuntimeSection -> (RuntimeSection, False); list[LoraEntry] -> (LoraEntry, True)."""
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def _dtype(value: Any) -> str:
    """The checkpoint's dtype when the runtime can compute in it, else "auto"."""
    if isinstance(value, str):
        value = value.removeprefix("torch.")  # some old configs store "torch.float16"
        if value in DTYPES:
            return value
    return "auto"


def _check_target(target: Path) -> None:
    if target.is_symlink() or target.is_file():
        raise PackageError(f"{target}: exists and is not a directory; choose a new directory for the package")
    if target.is_dir() and any(target.iterdir()):
        raise PackageError(f"{target}: directory is not empty; `ember init` only writes into a new or "
                           "empty directory, so choose another one")


def _read_config(hf_dir: Path) -> dict[str, Any]:
    if not hf_dir.is_dir():
        raise PackageError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint directory)")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise PackageError(f"{config_path}: no such file; a Hugging Face checkpoint directory holds "
                           "config.json beside its *.safetensors weights")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise PackageError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise PackageError(f"{config_path}: expected a JSON object")
    return config


def _place(src: Path, dst: Path, *, link: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)  # follows a symlink in src, as the Hugging Face cache uses
            return
        except OSError:
            pass  # another filesystem, or one without hardlinks: copy instead
    shutil.copy2(src, dst)
