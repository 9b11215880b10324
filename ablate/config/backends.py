"""Which kernel backend each op of a lane requests: a fact of the lane's config alone, so the sweep driver can hold
the plan against each node's check without importing torch (2-3 s of its start on a 2-core host).

How to use: ``requested_backends(lane.model, lane.features, cuda=True)`` -> ``{"moe": ("moe_dispatch", "jagged"),
...}``; ``trainers.model.hybrid`` resolves exactly these at model construction.
"""

from __future__ import annotations

from ablate.config.pattern import parse_pattern
from ablate.config.schema import FeatureConfig, ModelConfig, OnOff


def requested_backends(cfg: ModelConfig, features: FeatureConfig, cuda: bool) -> dict[str, tuple[str, str]]:
    """op -> (feature, backend) this pattern requests on a CUDA or CPU node: what arms resolve, and what the sweep
    holds against the node check before any block runs."""
    letters = parse_pattern(cfg.pattern)
    fused = features.fused_residual is OnOff.on
    out = {"add_rmsnorm": ("fused_residual", ("triton" if cuda else "compiled") if fused else "eager")}
    for letter, op, feature in (("A", "mla_ingress", "mla_ingress"), ("E", "moe", "moe_dispatch"),
                                ("M", "ssd", "mamba_scan"), ("R", "recurrent_scan", "recurrent_scan")):
        if letter in letters:
            out[op] = (feature, getattr(features, feature).value)
    return out
