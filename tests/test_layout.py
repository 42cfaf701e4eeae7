"""The package layout README.md describes, and the direction of imports between its layers."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hqekv"

LAYERS = [
    ("tiers", "config", "packing", "quantization", "rotation", "importance", "texts", "user_cache"),
    ("kernels.*",),
    ("policy", "allocation", "memory"),
    ("cache.rows",),
    ("cache.pools", "cache.table", "cache.tail", "cache.query_window", "cache.counters", "cache.room"),
    ("cache.view", "cache.budget"),
    ("cache.rerank",),
    ("cache.layer", "cache.sliding"),
    ("cache.model_cache", "cache"),
    ("patches.*",),
    ("artifacts", "packaged_models"),
    ("profiles",),
    ("resolve", "transformers_internals"),
    ("patching",),
    ("calibration.search_space",),
    ("calibration.objective",),
    ("calibration.layer_budgets",),
    ("calibration.study",),
    ("calibration.profile",),
    ("calibration", "eval.*", "lm_eval_plugin"),
    ("cli",),
    ("__main__", ""),
]
"""hqekv's modules from the bottom up (``pkg.*``: a package and all its modules). A module
imports only modules of lower layers, or of its own layer inside its own package: the
leaves know nothing of the cache, the cache's parts nothing of the layer that composes
them, the cache nothing of patching, and nothing below the patches imports them. Every
module must be listed, so a new one states its place. Beyond the order, only the kernels
themselves import a ``kernels.<file>``: everything else uses the ops ``hqekv.kernels``
exports."""


def layer_of(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith(".*") and (module == name[:-2] or module.startswith(name[:-1]))):
                return i
    return None


def module_paths() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def all_modules() -> list[str]:
    return sorted(module_paths())


def resolve(imported: str) -> str:
    """The module an import names: ``from .cache import rerank`` names hqekv.cache.rerank,
    ``from .tiers import KEY`` hqekv.tiers."""
    modules = set(all_modules())
    while imported and imported not in modules:
        imported = imported.rpartition(".")[0]
    return imported


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def hqekv_imports(path: Path) -> set[str]:
    """hqekv modules ``path`` imports anywhere (top level or inside functions), relative to the package."""
    here = module_name(path).split(".") if path.name != "__init__.py" else module_name(path).split(".") + ["x"]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level]
                target = ".".join(x for x in (*base, node.module or "") if x)
            elif (node.module or "").startswith("hqekv"):
                target = node.module.removeprefix("hqekv").lstrip(".")
            else:
                continue
            if node.module is None or not target:  # from . import a, b
                out.update(".".join(x for x in (target, a.name) if x) for a in node.names)
            else:
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("hqekv.") for a in node.names if a.name.startswith("hqekv."))
    return out


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"## Layout\n\n.*?```\n(.*?)```", readme, re.S)
    assert match, "README.md has no Layout block"
    return match.group(1)


def test_readme_layout_names_every_module():
    block = layout_block()
    named = set(re.findall(r"([\w]+\.py|[\w]+/)", block))
    missing = []
    for path in sorted(PACKAGE.iterdir()):
        if path.name.startswith("_") or path.name == "py.typed":
            continue
        entry = f"{path.name}/" if path.is_dir() else path.name
        if (path.is_dir() or path.suffix == ".py") and entry not in named:
            missing.append(entry)
    assert not missing, f"README.md's Layout does not list {missing}"
    package_part = block.split("\nbenchmarks/")[0]  # the lines of the hqekv package
    for name in set(re.findall(r"([\w]+\.py)", package_part)):
        if not list(PACKAGE.rglob(name)):
            pytest.fail(f"README.md's Layout lists hqekv's {name}, which does not exist")


def test_every_module_has_a_layer():
    unplaced = [m for m in all_modules() if layer_of(m) is None]
    assert not unplaced, f"modules without a place in LAYERS: {unplaced}"


@pytest.mark.parametrize("module", all_modules())
def test_modules_import_only_lower_layers(module):
    path = module_paths()[module]
    own = layer_of(module)
    bad = []
    for name in hqekv_imports(path):
        if name == "__version__":
            continue  # a constant of the package
        target = resolve(name)
        layer = layer_of(target)
        same_package = target.split(".")[0] == module.split(".")[0]
        if layer > own or (layer == own and not same_package):
            bad.append(f"{module} (layer {own}) imports hqekv.{target} (layer {layer})")
        if target.startswith("kernels.") and not module.startswith("kernels"):
            bad.append(f"{module} imports hqekv.{target}: use the ops hqekv.kernels exports")
    assert not bad, bad


def test_the_import_scan_sees_relative_and_function_level_imports(tmp_path):
    assert "kernels" in hqekv_imports(PACKAGE / "cache" / "view.py")
    assert "memory" in hqekv_imports(PACKAGE / "cache" / "model_cache.py")
    assert "cache.rerank" in hqekv_imports(PACKAGE / "cache" / "layer.py")  # from . import rerank
    assert "artifacts" in hqekv_imports(PACKAGE / "resolve.py")  # imported inside a function
    assert "tiers" in hqekv_imports(PACKAGE / "kernels" / "mixed_attention.py")
    assert "mixed_attention" not in hqekv_imports(PACKAGE / "cache" / "view.py")
    assert resolve("cache.rerank") == "cache.rerank" and resolve("tiers.KEY") == "tiers"
    assert layer_of("cache.tail") > layer_of("cache.rows") and layer_of("kernels.ops") == layer_of("kernels")


def test_no_benchmark_script_hides_an_installed_package():
    """``python benchmarks/X.py`` puts benchmarks/ first on the import path: a script named
    like an installed package (``kernels``, which transformers imports when it is installed)
    would be imported in its place and break every benchmark."""
    import importlib.util

    clashes = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if importlib.util.find_spec(p.stem) is not None]
    assert not clashes, f"benchmark scripts named like installed packages: {clashes}"


def test_the_architecture_page_names_every_part_of_the_cache():
    """docs/architecture.md draws the cache package: each of its modules is named there,
    and every hqekv file it names exists."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [f"cache/{p.name}" for p in sorted((PACKAGE / "cache").glob("*.py"))
               if p.name != "__init__.py" and f"cache/{p.name}" not in page]  # fmt: skip
    assert not missing, f"docs/architecture.md does not name {missing}"
    named = set(re.findall(r"`((?:cache|kernels|patches)/\w+\.py|\w+\.py)`", page))
    absent = [name for name in named if not (PACKAGE / name).exists()]
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"


def test_the_tests_mirror_the_package():
    """A test folder for each of hqekv's packages, and none for anything else."""
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")}
    assert folders == packages, f"test folders {sorted(folders)} against packages {sorted(packages)}"
    loose = [p.name for p in (ROOT / "tests").rglob("*.py") if p.parent.name not in folders | {"tests"}]
    assert not loose, f"test files outside the mirrored folders: {loose}"


def test_no_test_file_imports_another():
    """Tests share code through tests/helpers.py (and fixtures through conftest.py), never by
    importing another test file."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                leaf = name.rpartition(".")[2]
                if leaf.startswith("test_") or leaf == "conftest":
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad
