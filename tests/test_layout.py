"""Project promises that are easy to break silently: where packages resolve, soft imports, layering, toggles."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

from ablate.config.features import FEATURES
from ablate.config.load import load_defaults
from ablate.config.schema import LaneConfig

REPO = Path(__file__).resolve().parents[1]


def test_top_level_packages_resolve_inside_the_repository() -> None:
    # Hugging Face ships a `kernels` distribution; ours must be the one imported.
    import ablate
    import kernels
    import trainers

    for module in (ablate, kernels, trainers):
        assert Path(module.__file__).resolve().is_relative_to(REPO), module.__file__


def test_import_ablate_and_kernels_without_heavy_modules() -> None:
    code = ("import sys, ablate, ablate.config.load, ablate.receipts.schema, ablate.cli, kernels;"
            "heavy = [m for m in ('triton', 'deepspeed', 'ray', 'mlflow') if m in sys.modules];"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "", f"imported eagerly: {out.stdout.strip()}"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_model_and_kernels_never_read_raw_config() -> None:
    offenders = [str(p.relative_to(REPO)) for folder in ("kernels", "trainers") for p in (REPO / folder).rglob("*.py")
                 if "omegaconf" in _imports(p)]
    assert offenders == [], f"only ablate/config may touch OmegaConf: {offenders}"


def test_every_toggle_is_one_typed_field_and_one_registry_entry() -> None:
    lane = LaneConfig()
    paths = [spec.path for spec in FEATURES.values()]
    assert len(paths) == len(set(paths)), "two registry entries point at one field"
    for spec in FEATURES.values():
        node = lane
        for part in spec.path.split("."):
            assert part in {f.name for f in dataclasses.fields(node)}, f"{spec.name}: no field {spec.path}"
            node = getattr(node, part)
    feature_fields = {f.name for f in dataclasses.fields(lane.features)} - {"stp_weight"}
    registered = {spec.path.split(".")[1] for spec in FEATURES.values() if spec.path.startswith("features.")}
    assert feature_fields == registered


def test_defaults_cover_every_model_toggle_at_its_reference() -> None:
    defaults = load_defaults(REPO / "search_spaces" / "defaults.yaml")
    lane = LaneConfig()
    for name, spec in FEATURES.items():
        if spec.path.startswith("features."):
            assert name in defaults.values, f"defaults.yaml lacks {name}"
            assert str(defaults.values[name]) == str(spec.get(lane)), f"{name} default is not its reference"
    assert all(FEATURES[n].kind != "tax" or v == "off" for n, v in defaults.values.items())


def test_readme_never_exposes_the_dashboard_or_mlflow_publicly() -> None:
    readme = (REPO / "README.md").read_text()
    assert "0.0.0.0" not in readme and "--dashboard-host" not in readme
    assert "ray dashboard cluster.yaml" in readme and "Token authentication stays on" in readme
