"""How one receipt reads in MLflow: run name, params, tags, metrics and per-step series.

Pure functions of a ``Receipt`` (no MLflow import), so the mapping is easy to read in one place and to test.
Unknown values (``None``) are skipped, never logged as 0; every string passes ``redact_uri``.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Optional

from ablate.receipts.schema import Receipt
from ablate.receipts.store import receipt_digest
from ablate.redact import redact_uri

TAG = "ablate."
ROLE_SWEEP, ROLE_BLOCK, ROLE_ARM = "sweep", "block", "arm"
EXPERIMENT_KIND_TAG, MACHINE_LEARNING = "mlflow.experimentKind", "custom_model_development"
"""MLflow 3.4+ experiment type: the UI opens a ``custom_model_development`` ("Machine learning") experiment on its
training runs instead of the GenAI overview. Not in MLflow's Python API: the tag and value are read by the UI
bundle (``mlflow/server/js/build/static/js/main.*.js``: ``CUSTOM_MODEL_DEVELOPMENT="custom_model_development"``,
``e.find(e=>"mlflow.experimentKind"===e.key)``) and written the same way by ``mlflow/demo/generators/traces.py``."""
UI_TRAINING_VIEW = "workflowType=machine_learning"
"""Query that opens a link in the UI's "Model training" view. MLflow 3.17's UI no longer routes by the experiment's
type tag: with its workflow-type switch on it derives the type from ``workflowType`` in the link, else from what
the browser last chose, defaulting to ``genai`` (bundle module 7975: ``e.get("workflowType")``, storage key
``mlflow.workflowType``, ``initialValue:c`` = GENAI), which opens an experiment on the GenAI overview. The tag
still routes older 3.x UIs; this query routes the current one."""
NOTE_TAG = "mlflow.note.content"
_SWEEP_ID = re.compile(r"^(?P<campaign>.+)-(?P<stamp>\d{8}-\d{6})-(?P<token>[0-9a-f]{4})$")


def round_short_id(sweep_id: str) -> str:
    """``r3f2a`` for ``smoke-20261123-001547-3f2a``: the sweep id's random 4-hex token, which is what tells two
    rounds of one campaign apart, so names stay unique across rounds and readable when the UI cuts them. An id
    of another shape (a test's, a hand-made one) gets 4 hex characters of its hash instead."""
    found = _SWEEP_ID.match(sweep_id)
    token = found["token"] if found else hashlib.sha256(sweep_id.encode()).hexdigest()[:4]
    return f"r{token}"


def sweep_run_name(sweep_id: str) -> str:
    """``r3f2a·smoke·20261123-001547``: round first, then campaign and start time."""
    found = _SWEEP_ID.match(sweep_id)
    rest = f"{found['campaign']}·{found['stamp']}" if found else sweep_id
    return f"{round_short_id(sweep_id)}·{rest}"


def run_name(receipt: Receipt) -> str:
    """``r3f2a·b001·candidate·moe_dispatch=jagged``: round and block first, so a cut name still says which."""
    ident = receipt.identity
    if ident.feature is None:
        name = f"{ident.block_id}·aa·twin{ident.arm_index}"
    else:
        name = f"{ident.block_id}·{ident.arm.value}·{ident.feature}={ident.feature_value}"
    return f"{round_short_id(ident.sweep_id)}·{name}" + (f"·retry{ident.attempt}" if ident.attempt else "")


def block_run_name(receipt: Receipt) -> str:
    """``r3f2a·b001·moe_dispatch=padded→jagged`` (``·A/A`` for a noise-floor block), from either arm; from a
    baseline arm alone the candidate's value is not known yet (``padded→…``: renamed once both arms are in)."""
    ident = receipt.identity
    return (f"{round_short_id(ident.sweep_id)}·{ident.block_id}·{block_change(receipt)}"
            + (f"·retry{ident.attempt}" if ident.attempt else ""))


def block_change(receipt: Receipt) -> str:
    """What the block compares, as far as this arm knows: ``moe_dispatch=padded→jagged``, or ``A/A``."""
    ident = receipt.identity
    if ident.feature is None:
        return "A/A"
    candidate = ident.feature_value if ident.arm.value == "candidate" else "…"
    return f"{ident.feature}={ident.baseline_value}→{candidate}"


def sweep_note(sweep_id: str, campaign: str) -> str:
    return (f"Round **{round_short_id(sweep_id)}** (sweep `{sweep_id}`) of campaign `{campaign}`: one child run per "
            f"block, each holding its baseline and candidate arm runs; summary.svg compares them per block.")


def receipt_params(receipt: Receipt) -> dict[str, str]:
    return {key: redact_uri(str(value)) for key, value in sorted(receipt.requested.lane.items())}


def receipt_tags(receipt: Receipt) -> dict[str, str]:
    ident = receipt.identity
    tags = {
        "role": ROLE_ARM, "receipt_id": ident.receipt_id, "sweep_id": ident.sweep_id, "campaign": ident.campaign,
        "lane_key": ident.lane_key, "config_hash": ident.config_hash, "block_id": ident.block_id,
        "arm": ident.arm.value, "arm_index": str(ident.arm_index), "order": str(ident.order),
        "feature": ident.feature or "A/A", "feature_value": str(ident.feature_value),
        "baseline_value": str(ident.baseline_value), "kind": ident.kind, "attempt": str(ident.attempt),
        "status": ident.status.value, "created_at": ident.created_at, "host": ident.host,
        "node_id": ident.node_id or "", "executor": ident.executor,
        "software_fingerprint": ident.software_fingerprint, "git_sha": ident.git_sha or "",
        "disqualifiers": ",".join(sorted(receipt.codes())) or "none", "device": receipt.requested.device,
        "compile.requested": receipt.observed.compile.posture_requested,
        "compile.observed": receipt.observed.compile.posture_observed,
        "warmup.resolved": receipt.observed.compile.warmup_resolved, "pairing": ident.pairing,
        "code_fingerprint": ident.code_fingerprint or "", "hardware_fingerprint": ident.hardware_fingerprint or "",
        "clock": receipt.time.clock, "contended": str(receipt.host_load.contended).lower(),
        # The content digest of the copy logged here: `receipts sync` compares it with the file on disk.
        "digest": receipt_digest(receipt),
    }
    mismatched = []
    for backend in receipt.observed.backends:
        tags[f"backend.{backend.op}.requested"] = backend.requested
        tags[f"backend.{backend.op}.observed"] = backend.observed
        if backend.requested != backend.observed:
            mismatched.append(backend.op)
    tags["backends_match"] = "false" if mismatched else "true"
    energy = receipt.energy
    if energy is not None:
        tags["energy.source"] = energy.source or "none"
        tags["energy.scope" if energy.source else "energy.why"] = energy.scope if energy.source else energy.why
    node_check = receipt.observed.node_check
    if node_check:
        tags["node_check"] = (f"{node_check.get('path')} sha256:{node_check.get('sha256')} ok={node_check.get('ok')}"
                              if node_check.get("sha256") else f"none: {node_check.get('why')}")
    out = {TAG + key: redact_uri(value)[:5000] for key, value in tags.items()}
    out[NOTE_TAG] = _note(receipt)
    return out


def _note(receipt: Receipt) -> str:
    """The run description the UI shows: what this arm is, in one sentence."""
    ident = receipt.identity
    what = "A/A (baseline twice)" if ident.feature is None else (
        f"`{ident.feature}` = `{ident.feature_value}` (baseline `{ident.baseline_value}`)")
    codes = ", ".join(sorted(receipt.codes()))
    proj = receipt.projection
    tps = proj.tokens_per_s if proj is not None else None
    horizon = f"{proj.horizon_steps:,}-step horizon" if proj is not None else "the lane's horizon"
    return (f"Round {round_short_id(ident.sweep_id)}, block **{ident.block_id}**, {ident.arm.value} arm, {ident.pairing}, "
            f"{'first' if ident.order == 0 else 'second'}: {what}. Status **{ident.status.value}**"
            f"{f' ({codes})' if codes else ''}; tokens/s at the {horizon} {f'{tps:.1f}' if tps else 'n/a'} "
            f"(start-up excluded); goodput {receipt.time.goodput_fraction:.1%} of {receipt.time.wall_s:.2f}s. "
            f"Lane `{ident.lane_key}`, host {ident.host}.")


ARM_PROMOTION_METRIC = "0_tokens_per_s_at_horizon"
"""An arm's throughput over the lane's production horizon (one-time cost + horizon x step time): what the block's
``0_speedup_at_horizon`` is the ratio of."""


def receipt_metrics(receipt: Receipt) -> dict[str, float]:
    """Scalar metrics; None (unknown) is skipped, never logged as 0."""
    t, s, tp, mem, q = receipt.time, receipt.steps, receipt.throughput, receipt.memory, receipt.quality
    values: dict[str, Optional[float]] = {
        "goodput_fraction": t.goodput_fraction, "wall_s": t.wall_s, "goodput_s": t.goodput_s,
        "wall_tokens_per_s": tp.wall_tokens_per_s, "steady_tokens_per_s": tp.steady_tokens_per_s,
        "tokens": tp.tokens, "mfu": tp.mfu, "step_p50_s": s.p50_s, "step_p90_s": s.p90_s, "step_mean_s": s.mean_s,
        "ideal_step_s": s.ideal_s, "time_to_first_step_s": s.time_to_first_step_s, "first_step_s": s.first_step_s,
        "steps_steady": s.steady, "steps_anomalous": s.anomalous,
        "peak_memory_bytes": mem.peak_allocated_bytes if mem.peak_allocated_bytes is not None else mem.peak_rss_bytes,
        "peak_reserved_bytes": mem.peak_reserved_bytes, "peak_rss_bytes": mem.peak_rss_bytes,
        "loss_final": q.loss_final, "loss_mean_last_k": q.loss_mean_last_k, "lm_loss_final": q.lm_loss_final,
        "stp_loss_final": q.stp_loss_final, "aux_loss_final": q.aux_loss_final,
        "disqualifiers": float(len(receipt.disqualifiers)),
        "foreign_cpus": receipt.host_load.foreign_cpus,
    }
    proj = receipt.projection
    if proj is not None:
        # The arm's side of the promotion metric, named to sort first (a digit before every letter): MLflow lists
        # it first and its compare view plots the first metric by default, so comparing two arms opens on it.
        values.update({ARM_PROMOTION_METRIC: proj.tokens_per_s, "projected_s": proj.projected_s,
                       "one_time_s": proj.one_time_s, "recurring_step_s": proj.recurring_step_s})
    if receipt.energy is not None:  # beside tokens/s; absent (not 0) where the arm could not measure
        values.update({"energy_joules": receipt.energy.joules, "energy_joules_per_token": receipt.energy.joules_per_token,
                       "energy_mean_watts": receipt.energy.mean_watts})
    values.update({f"badput_{name}_s": value for name, value in t.badput_s.items()})
    values.update({f"family_share_{name}": value for name, value in receipt.family_share.items()})
    return {key: float(value) for key, value in values.items() if value is not None}


def receipt_series(receipt: Receipt) -> list[tuple[str, float, int]]:
    """Per-step (key, value, step): loss, step time and tokens/s, so the UI draws charts."""
    rows: list[tuple[str, float, int]] = [("loss", float(v), i) for i, v in enumerate(receipt.steps.loss_series)
                                          if v is not None]
    tokens = receipt.observed.tokens_per_step or receipt.requested.tokens_per_step
    for i, seconds in enumerate(receipt.steps.series):
        rows.append(("step_time_s", float(seconds), i))
        if seconds > 0:
            rows.append(("tokens_per_s", tokens / seconds, i))
    return rows


def epoch_ms(iso: str) -> Optional[int]:
    try:
        return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        return None
