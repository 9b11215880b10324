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


TRACED_AS: dict[tuple[str, str], str] = {("add_rmsnorm", "compiled"): "eager"}
"""(op, backend) -> the backend it is recorded as inside a compiled region (``kernels``' ``Impl.traced_as``), here
without torch for the receipt writer and ``promote``; tests/kernels hold it equal to the registry."""

COMPILING_POSTURES = ("regional", "whole")


def fell_back(op: str, requested: str, observed: str, posture: str) -> bool:
    """Whether a backend record is a fallback. Under a compiling posture a backend with a traced form is recorded as
    that form (the compiled region fuses the same reference itself): the call site runs what it asked for in the
    only form a compiled region has, so a compile candidate in a lane that keeps fused_residual on is not an arm
    whose kernel fell back."""
    if requested == observed:
        return False
    return not (posture in COMPILING_POSTURES and TRACED_AS.get((op, requested)) == observed)
