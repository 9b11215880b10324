"""A resumed sweep keeps the host allocator policy its arms started under (``resources.host_allocator``): the policy
changes what a step costs, so a campaign edited between the runs is refused before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from ruamel.yaml import YAML
from sweeps_common import fresh_mlflow_uri, tiny_smoke

from ablate.config.load import load_sweep
from ablate.config.schema import ConfigError
from ablate.sweep.layout import LATEST, LOCK_FILE, Layout
from ablate.sweep.plan import ORDERS_IN_PAIRS, plan_sweep
from ablate.sweep.run import _sweep_identity, run_sweep


def ray_started() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _campaign(tmp_path: Path, policy: Optional[str]) -> Path:
    campaign = tiny_smoke(tmp_path / "c", name="resumed", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    if policy is not None:
        yaml = YAML()
        data = yaml.load(campaign.read_text())
        data["resources"]["host_allocator"] = policy
        with campaign.open("w") as handle:
            yaml.dump(data, handle)
    return campaign


def _started(campaign: Path, storage: Path, params: Optional[dict[str, Any]]) -> None:
    """The metadata a sweep of ``campaign`` left when it started, with ``params`` (None: none recorded)."""
    sweep, defaults = load_sweep(campaign)
    plan = plan_sweep(sweep, "resumed-r1", defaults, orders_scheme=ORDERS_IN_PAIRS)
    layout = Layout.for_campaign(sweep.name, str(storage))
    meta: dict[str, Any] = {"sweep_id": plan.sweep_id, "orders": ORDERS_IN_PAIRS, "plan_fingerprint": plan.fingerprint(),
                            "device": "cpu"}
    if params is not None:
        meta["params"] = params
    layout.write("sweeps/resumed-r1.json", json.dumps(meta))
    layout.write(LATEST, "resumed-r1\n")


def test_a_sweep_started_under_one_allocator_is_not_resumed_under_another(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    _started(_campaign(tmp_path, "system"), storage, {"resources.host_allocator": "system"})
    edited = _campaign(tmp_path, None)  # the default, retain
    with pytest.raises(ConfigError, match=r"resources.host_allocator: got 'retain'; allowed: 'system', the policy "
                                          r"sweep resumed-r1 started its arms under"):
        run_sweep(edited, resume=True, tracking_uri=fresh_mlflow_uri(tmp_path / "store"), storage=str(storage),
                  progress=False, simulate_arms=True)
    # Refused before anything started: no lock taken, no Ray.
    assert not (Layout.for_campaign("resumed", str(storage)).local_dir / LOCK_FILE).exists()
    assert not ray_started()
    # Set back, the same sweep resumes (its identity is read as it started).
    _, _, _, plan, meta, _ = _sweep_identity(_campaign(tmp_path, "system"), True, str(storage))
    assert plan.sweep_id == "resumed-r1" and meta["params"]["resources.host_allocator"] == "system"


def test_a_sweep_from_before_the_setting_ran_the_c_library_defaults(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    campaign = _campaign(tmp_path, None)
    _started(campaign, storage, {"blocks": 1})  # params, but no resources.host_allocator: glibc's defaults ran
    with pytest.raises(ConfigError, match="allowed: 'system', the policy sweep resumed-r1 started its arms under"):
        _sweep_identity(campaign, True, str(storage))
    assert _sweep_identity(_campaign(tmp_path, "system"), True, str(storage))[3].sweep_id == "resumed-r1"


def test_metadata_without_params_is_not_refused_for_a_policy_it_does_not_record(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    campaign = _campaign(tmp_path, None)
    _started(campaign, storage, None)
    assert _sweep_identity(campaign, True, str(storage))[3].sweep_id == "resumed-r1"
