"""A lane's *shape*: the lane without its feature toggles and replication keys, as a short stable id.

How to use: ``lane_shape(flat_lane)`` where ``flat_lane`` is ``flatten(lane_to_dict(lane))`` (the form a receipt
records as ``requested.lane``); ``ablate.config.load.lane_shape_of(lane)`` does the flattening for a typed lane.

Why a shape and not the lane key: the lane key hashes the whole baseline lane, so promoting a value changes the
key of every later campaign on that lane (its baseline now runs the promoted value). A lane override in
``defaults.yaml`` must keep applying to the lane it was measured on after it takes effect, and evidence must stay
linked to later measurements of "the same lane" for revalidation; both are keyed by the shape, which no feature
value and no seed can change. ``budget.horizon_steps`` is part of the shape: the horizon changes which value
wins (one-time costs against recurring ones), so two horizons are two lanes.

``hardware.device: auto`` is resolved in the shape (``device``): an ``auto`` lane runs on CUDA on one cluster and on
CPU on another, and a value that won on CPU says nothing of the GPU runs. Its receipts give the device they ran on;
a sweep gives the one its cluster resolves ``auto`` to. An ``auto`` lane that ran on CPU is then the same shape as
the lane with ``device: cpu`` written out, which it is.

This module is torch-free and imports nothing from the loader, so the promotion code can use it freely.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

from ablate.config.features import FEATURES

REPLICATION_KEYS: tuple[str, ...] = ("seed", "data.seed")
"""Flattened lane keys that vary between repetitions of one lane (never between the arms of a block)."""

FEATURE_PATHS: frozenset[str] = frozenset(spec.path for spec in FEATURES.values())
DEVICE_KEY = "hardware.device"
AUTO = "auto"
DEVICE_CLASSES = ("cpu", "cuda")
"""What ``auto`` resolves to: the device types a receipt records as ``observed.hardware.kind``."""


def on_device(flat_lane: Mapping[str, Any], device: Optional[str]) -> Mapping[str, Any]:
    """The flattened lane with ``hardware.device: auto`` replaced by ``device`` (a device class); any other lane, or
    no device known (a receipt that observed no hardware), as it is."""
    if device in DEVICE_CLASSES and flat_lane.get(DEVICE_KEY) == AUTO:
        return {**flat_lane, DEVICE_KEY: device}
    return flat_lane


def lane_shape(flat_lane: Mapping[str, Any], device: Optional[str] = None) -> str:
    """``shape-`` + 12 hex of sha256 over the sorted-key JSON of the flattened lane minus features and seeds, with
    ``auto`` resolved to ``device`` (see the module docstring)."""
    skip = FEATURE_PATHS | set(REPLICATION_KEYS)
    # Same serialisation as evidence.shape_key (default separators, str fallback) so ids recorded before the
    # switch to this function keep matching.
    text = json.dumps({k: v for k, v in on_device(flat_lane, device).items() if k not in skip}, sort_keys=True,
                      default=str)
    return "shape-" + hashlib.sha256(text.encode()).hexdigest()[:12]
