"""The package layout README.md describes, and the direction of imports between its layers."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hqekv"

FORBIDDEN = {
    # module (or package prefix): hqekv modules it must not import
    "tiers": {"*"},
    "config": {"*"},
    "kernels": {"policy", "cache", "sliding", "patches", "patching", "calibration", "importance", "eval"},
    "policy": {"cache", "kernels", "patches", "patching", "calibration"},
    "layer_base": {"cache", "sliding", "memory", "kernels", "patches", "patching", "calibration", "eval"},
    "pools": {"cache", "policy", "rerank", "attention", "memory", "patches", "patching", "calibration", "eval",
              "kernels.*"},
    "rerank": {"cache", "attention", "kernels", "patches", "patching", "calibration", "eval"},
    "attention": {"cache", "policy", "memory", "patches", "patching", "calibration", "eval", "kernels.*"},
    "tail": {"cache", "rerank", "attention", "pools", "kernels", "patches", "patching", "calibration", "eval"},
    "window": {"cache", "rerank", "attention", "pools", "kernels", "patches", "patching", "calibration", "eval"},
    "memory": {"cache", "sliding", "kernels", "patches", "patching", "calibration", "eval"},
    "allocation": {"cache", "rerank", "attention", "pools", "kernels", "patches", "patching", "calibration", "eval"},
    "cache": {"patches", "patching", "calibration", "eval", "kernels"},
    "sliding": {"patches", "patching", "calibration", "eval"},
    "patches": {"patching", "calibration", "eval", "cli"},
}
"""Lower layers never reach up: the cache works through its parts (pools, rerank,
attention, memory) and reaches the kernels only through them, the parts use the kernels'
public ops only (``kernels``, not ``kernels.<file>``), the kernels know nothing of policy,
and nothing below the patches imports them."""


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
    match = re.search(r"## Layout\n\n```\n(.*?)```", readme, re.S)
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


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(layer):
    target = PACKAGE / layer
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    bad = []
    for path in files:
        for imported in hqekv_imports(path):
            for rule in FORBIDDEN[layer]:
                own = imported == layer or imported.startswith(layer + ".")
                hit = (rule == "*" and not own and imported != "tiers") or imported == rule \
                    or imported.startswith(rule.removesuffix("*") if rule.endswith("*") else rule + ".")
                if hit and not (target.is_dir() and own):
                    bad.append(f"{path.relative_to(ROOT)} imports hqekv.{imported}")
    assert not bad, bad


def test_the_import_scan_sees_relative_and_function_level_imports(tmp_path):
    assert "kernels" in hqekv_imports(PACKAGE / "attention.py")
    assert "memory" in hqekv_imports(PACKAGE / "cache.py")
    assert "artifacts" in hqekv_imports(PACKAGE / "patching.py")  # imported inside a function
    assert "tiers" in hqekv_imports(PACKAGE / "kernels" / "mixed_attention.py")
    assert "mixed_attention" not in hqekv_imports(PACKAGE / "attention.py")


def test_no_benchmark_script_hides_an_installed_package():
    """``python benchmarks/X.py`` puts benchmarks/ first on the import path: a script named
    like an installed package (``kernels``, which transformers imports when it is installed)
    would be imported in its place and break every benchmark."""
    import importlib.util

    clashes = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if importlib.util.find_spec(p.stem) is not None]
    assert not clashes, f"benchmark scripts named like installed packages: {clashes}"
