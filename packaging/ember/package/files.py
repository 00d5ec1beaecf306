"""Which files make up a package, and which are refused (pickles, links that leave it)."""

from __future__ import annotations

import os
from pathlib import Path

from ember.errors import PackageError
from ember.package.lock import LOCK_NAME, check_safe_path

# Never part of a package: caches and editor/VCS litter.
IGNORED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".ipynb_checkpoints", ".pytest_cache",
                          ".mypy_cache", ".ruff_cache"})
IGNORED_FILES = frozenset({LOCK_NAME, ".DS_Store", "Thumbs.db"})
IGNORED_SUFFIXES = (".pyc", ".pyo", ".swp")

# Pickle-based checkpoints can run arbitrary code when loaded; Ember loads safetensors only.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

CONVERT_HINT = (
    "Ember loads safetensors only (pickle checkpoints can run code when loaded). Convert it with "
    "transformers: `python -c \"import transformers as t; d='DIR'; "
    "t.AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, safe_serialization=True)\"` "
    "(or safetensors.torch.save_file for a bare state dict), then delete the pickle file"
)


def is_ignored(rel: Path) -> bool:
    return (any(part in IGNORED_DIRS for part in rel.parts[:-1]) or rel.name in IGNORED_FILES
            or rel.name.endswith(IGNORED_SUFFIXES) or rel.name.startswith(".ember-tmp"))


def refuse_pickle(rel: str, root: Path | None = None) -> None:
    if rel.lower().endswith(PICKLE_SUFFIXES):
        where = f"{root}/{rel}" if root else rel
        hint = CONVERT_HINT.replace("DIR", str((root or Path()) / Path(rel).parent))
        raise PackageError(f"{where}: is a pickle checkpoint. {hint}")


def package_files(root: Path) -> list[str]:
    """Relative POSIX paths of the files a package is made of, sorted.

    Symlinks are followed only when they stay inside the package; one that leaves it is an
    error, because a pulled package must be self-contained.
    """
    root = root.resolve()
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_DIRS)
        for d in list(dirnames):
            if (here / d).is_symlink():
                _check_link_inside(root, here / d)
                raise PackageError(f"{here / d}: a symlinked directory; copy it into the package instead")
        for name in sorted(filenames):
            full = here / name
            rel = full.relative_to(root)
            if is_ignored(rel):
                continue
            if full.is_symlink():
                _check_link_inside(root, full)
            if not full.is_file():
                raise PackageError(f"{full}: not a regular file (sockets, devices and broken links are "
                                   "not allowed in a package)")
            posix = rel.as_posix()
            check_safe_path(posix, str(root))  # a name the lock could not be read back with is refused now
            refuse_pickle(posix, root)
            found.append(posix)
    return sorted(found)


def _check_link_inside(root: Path, link: Path) -> None:
    target = link.resolve()
    if not target.is_relative_to(root):
        raise PackageError(f"{link}: symlink points outside the package (to {target}); "
                           "a package must be self-contained")
