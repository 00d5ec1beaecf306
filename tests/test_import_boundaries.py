"""The dependency rule between the four source roots, checked statically (every import statement) and dynamically
(what a fresh interpreter has in sys.modules after importing a package or running a CLI command):

* `ember` (packaging/) imports neither torch nor `ember_platform`, `ember_plugins` or `ember_kernels`: a model
  author's laptop install has none of them. (`if TYPE_CHECKING:` blocks never run: torch types named there are fine.)
* `ember_platform` imports neither `ember_kernels` nor `ember_plugins`: kernels and techniques reach the platform
  only as plugins.
* `ember_plugins` imports from the platform only `ember_platform.api`, its documented contracts.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"ember": REPO / "packaging" / "ember", "ember_platform": REPO / "platform" / "ember_platform",
         "ember_plugins": REPO / "plugins" / "ember_plugins"}
HEAVY = ("torch", "triton", "transformers", "safetensors", "numpy")


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, package: str) -> Iterator[tuple[int, str, bool]]:
    """(line, imported module, only under TYPE_CHECKING) for every import in a file, relative ones resolved, plus
    `importlib.import_module("literal")` calls (an import by another name is still an import)."""
    tree = ast.parse(path.read_text(), str(path))
    module_parts = [package, *path.relative_to(ROOTS[package]).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts.pop()
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        only_types = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, only_types
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module_parts[:len(module_parts) - node.level + (path.name == "__init__.py")]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name, only_types
            for alias in node.names:  # `from ember_platform import engine` imports ember_platform.engine
                yield node.lineno, f"{name}.{alias.name}", only_types
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value, only_types


def violations(package: str) -> list[str]:
    """One line per offending import statement: "path:line: imports NAME"."""
    found: dict[tuple[Path, int], str] = {}
    for path in sorted(ROOTS[package].rglob("*.py")):
        for line, name, only_types in imports(path, package):
            if (path, line) in found:
                continue
            where = f"{os.path.relpath(path, REPO)}:{line}: imports {name}"
            if package == "ember":
                bad = (_under(name, "ember_platform", "ember_plugins", "ember_kernels")
                       or (_under(name, *HEAVY) and not only_types))
            elif package == "ember_platform":
                bad = _under(name, "ember_kernels", "ember_plugins")
            else:
                bad = (_under(name, "ember_platform") and name != "ember_platform"
                       and not _under(name, "ember_platform.api"))
                where += " (plugins import from the platform only ember_platform.api)"
            if bad:
                found[path, line] = where
    return list(found.values())


@pytest.mark.parametrize("package", list(ROOTS))
def test_no_import_crosses_a_boundary(package: str) -> None:
    found = violations(package)
    assert not found, "\n".join(found)


def test_the_checker_sees_each_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The static check must not pass because it looks at nothing: plant one violation of each form.
    pkg = tmp_path / "ember_plugins"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import ember_platform.engine.engine\n"
        "from ember_platform.engine import attention\n"
        "from ember_platform import api\n"
        "import importlib\n"
        "importlib.import_module('ember_platform.engine.kernel_ops')\n"
        "if TYPE_CHECKING:\n"
        "    from ember_platform.engine.request import Request\n")
    monkeypatch.setitem(ROOTS, "ember_plugins", pkg)
    lines = sorted(int(v.split(":")[1]) for v in violations("ember_plugins"))
    assert lines == [2, 3, 6, 8]


def _modules_after(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (which may exit through SystemExit)."""
    out = tmp_path / "modules.json"
    script = ("import json, sys\n"
              "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) +
              "except SystemExit:\n    pass\n"
              f"finally:\n    open({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "EMBER_HOME": str(tmp_path / "home"), **(env or {})}, timeout=120)
    assert out.exists(), result.stderr
    return set(json.loads(out.read_text()))


def _entry_point_modules() -> set[str]:
    return {ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group="ember")}


def _forbidden(modules: set[str], *packages: str) -> list[str]:
    return sorted(m for m in modules if _under(m, *packages))


def test_importing_every_ember_module_loads_no_torch_and_no_platform(tmp_path: Path) -> None:
    code = ("import pkgutil, importlib, ember\n"
            "for info in pkgutil.walk_packages(ember.__path__, 'ember.'):\n"
            "    if not info.name.endswith('__main__'):\n"
            "        importlib.import_module(info.name)")
    modules = _modules_after(code, tmp_path)
    assert "ember.cli.serve_cmds" in modules and "ember.plugins" in modules  # it did import them
    assert not _forbidden(modules, "ember_platform", "ember_plugins", "ember_kernels", *HEAVY)


@pytest.mark.parametrize("argv", [["--help"], ["keys", "list"], ["keys", "create", "--name", "a"], ["--version"]])
def test_cli_commands_that_need_no_plugin_load_neither_platform_nor_plugins(argv: list[str], tmp_path: Path) -> None:
    modules = _modules_after(f"sys.argv = ['ember', *{argv!r}]\nimport runpy\nrunpy.run_module('ember', "
                             "run_name='__main__', alter_sys=True)", tmp_path)
    assert "ember.cli.main" in modules
    assert not _forbidden(modules, "ember_platform", "ember_plugins", "ember_kernels", *HEAVY)


@pytest.mark.parametrize("argv", [["plugins"], ["plugins", "--json"],
                                  ["explain", str(REPO / "examples" / "tiny-llama")]])
def test_plugin_commands_load_only_the_plugins_entry_modules(argv: list[str], tmp_path: Path) -> None:
    # Listing plugins imports each entry-point module (that is what a plugin is), and nothing heavier: no platform,
    # no kernels, no torch, no technique implementation (those are "module:attr" strings until an engine runs).
    modules = _modules_after(f"sys.argv = ['ember', *{argv!r}]\nimport runpy\nrunpy.run_module('ember', "
                             "run_name='__main__', alter_sys=True)", tmp_path)
    assert "ember.plugins" in modules
    entry = _entry_point_modules()
    plugin_modules = {m for m in modules if _under(m, "ember_plugins")}
    assert plugin_modules and plugin_modules <= entry | {"ember_plugins"}, plugin_modules - entry
    assert not _forbidden(modules, "ember_platform", "ember_kernels", *HEAVY)


def test_explain_checks_option_values_without_torch(make_package, tmp_path: Path) -> None:
    # Option values are checked by the functions a technique registers as its `check` (quantization's:
    # ember_plugins/quantization/options.py): loaded by `ember explain` for a manifest that gives options, so they
    # must be as light as an entry module.
    pkg = make_package(extra_toml='[quantization]\nmethod = ["rotation", "int4"]\n'
                                  'options = { rotation = { seed = 1 }, int4 = { group_size = 64 } }\n')
    modules = _modules_after(f"sys.argv = ['ember', 'explain', {str(pkg)!r}]\nimport runpy\n"
                             "runpy.run_module('ember', run_name='__main__', alter_sys=True)", tmp_path)
    assert "ember_plugins.quantization.options" in modules  # the values were checked
    plugin_modules = {m for m in modules if _under(m, "ember_plugins")}
    assert plugin_modules <= _entry_point_modules() | {"ember_plugins", "ember_plugins.quantization.options"}
    assert not _forbidden(modules, "ember_platform", "ember_kernels", *HEAVY)


def test_the_platform_api_module_is_lazy(tmp_path: Path) -> None:
    # The gateway imports routing-scorer plugins, which import ember_platform.api: that must not pull in torch.
    modules = _modules_after("from ember_platform.api import KV_TIERS, ReplicaView, RouteRequest, Score", tmp_path)
    assert "ember_platform.routing.scoring" in modules
    assert not _forbidden(modules, "ember_kernels", "ember_plugins", *HEAVY)


def test_the_platform_alone_loads_no_plugin_and_no_kernel(tmp_path: Path) -> None:
    # Everything the platform has, imported without any plugin installed (entry points off): no kernels, no plugins.
    code = ("import pkgutil, importlib, ember_platform\n"
            "for info in pkgutil.walk_packages(ember_platform.__path__, 'ember_platform.'):\n"
            "    if not info.name.endswith('__main__'):\n"
            "        importlib.import_module(info.name)")
    modules = _modules_after(code, tmp_path)
    assert "ember_platform.engine.engine" in modules and "ember_platform.api" in modules
    assert not _forbidden(modules, "ember_kernels", "ember_plugins")


def test_api_exports_resolve() -> None:
    import ember_platform.api as api

    for name in api.__all__:
        assert getattr(api, name) is not None, name
    with pytest.raises(AttributeError, match="the platform's plugin API"):
        api.NotAContract  # noqa: B018


def test_ember_serve_reaches_the_platform_through_an_entry_point() -> None:
    from ember.cli.serve_cmds import platform_command
    from ember.errors import EmberError
    from ember_platform.serve import serve

    assert platform_command("serve") is serve
    with pytest.raises(EmberError, match=r"`ember nope` needs the serving platform.*pip install 'ember\[serve\]'"):
        platform_command("nope")
