"""A reject line that still knows which test its arm belonged to.

Why: a receipt that cannot be used (damaged, refused by the sweep driver, a conflicting copy, an MLflow run deleted
or left half-written) used to be a line in the report and nothing more; its test was decided on the arms that
remained. Removing a candidate's failed or gated arm that way turns a REJECT into a PROMOTE. What survives of the
arm (the receipt's ``identity`` block, or its MLflow run's tags) names its lane and feature, so the promotion rule
can HOLD that test until the arm is readable again (``ablate.promote.rule``, clause ``every_arm_read``).

A ``Rejection`` is the ``(origin, reason)`` pair every reader returns, with the ``UnreadArm`` it could attribute
(or None): code that unpacks the pair keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

AA_FEATURE = "A/A"
"""How an A/A arm's run tags name its feature (``ablate.tracking.mapping.receipt_tags``)."""


@dataclass(frozen=True)
class UnreadArm:
    """The test an unusable arm belonged to, as far as what survives of it says."""

    origin: str
    lane_key: str
    feature: Optional[str]
    """None: an A/A arm (it calibrates every test of its lane)."""
    software_fingerprint: Optional[str]
    """None when unknown: the arm then counts for the lane's current fingerprint."""
    receipt_id: str = ""
    created_at: Optional[str] = None
    """When its receipt was written, where what survives says (a receipt's identity; an arm run's
    ``ablate.created_at`` tag, written since 2026-11-24): places an arm of unseen software before or after the
    lane's newest read block (``ablate.promote.engine``)."""
    left_out: bool = False
    """Readable, but outside the sweeps a ``promote --sweep`` selection kept (``from_left_out``)."""
    refused: bool = False
    """Readable, but in a block that was refused, and of software no matched block of its lane ran
    (``ablate.promote.engine``): nothing measured that software there."""
    block: Optional[tuple[str, str, int]] = None
    """(sweep id, block id, attempt) of an arm that died unobserved: its partner's (same attempt) fingerprint, when
    read, is its own (``ablate.promote.engine``), so a crash of superseded software does not hold the current
    test."""

    def concerns(self, feature: str, lane_key: str, fingerprint: str) -> bool:
        """Whether this arm was evidence for (or calibration of) that test under that fingerprint."""
        return (self.lane_key == lane_key and (self.feature is None or self.feature == feature)
                and self.software_fingerprint in (None, fingerprint))

    def describe(self) -> str:
        what = "A/A arm" if self.feature is None else "arm"
        return f"{what} {self.receipt_id[:8] or '?'} ({self.origin})"


def from_left_out(receipt: Any, newer: bool = False) -> Optional[UnreadArm]:
    """A readable arm that a ``--sweep`` selection left out, as the test it belongs to (None for an A/A arm: a
    test is calibrated by the A/A blocks of its own rounds only, so another sweep's do not concern it).
    ``newer``: it ran after the selection's last block of its lane. Then it concerns the lane's tests whatever its
    fingerprint: leaving out the newer sweeps must not make older software's evidence the current one."""
    ident = receipt.identity
    if not ident.feature:
        return None
    fingerprint = None if newer else _fingerprint(ident.status.value, ident.hardware_fingerprint,
                                                  ident.software_fingerprint)
    return UnreadArm(origin=f"sweep {ident.sweep_id}, campaign {ident.campaign}", lane_key=ident.lane_key,
                     feature=ident.feature, software_fingerprint=fingerprint, receipt_id=ident.receipt_id,
                     left_out=True)


class Rejection(tuple):
    """``(origin, reason)``, with ``unread``: the arm's test when it could be told, else None."""

    unread: Optional[UnreadArm]

    def __new__(cls, origin: str, reason: str, unread: Optional[UnreadArm] = None) -> "Rejection":
        self = super().__new__(cls, (origin, reason))
        self.unread = unread
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self[0], self[1], self.unread)


def _text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value else None


def _fingerprint(status: Any, hardware: Any, software: Any) -> Optional[str]:
    """The software fingerprint an unread arm is routed by. A failed arm whose worker died before reporting
    (a kill, a segfault, a timeout) observed no hardware, so its fingerprint hashes None in place of the
    hardware and never equals its lane's: routed by it, the crash would hold no test and vanish from the
    failure counts (a deleted FAILED run turned HOLD into PROMOTE; found in review). It counts for the lane's
    current fingerprint instead, as its block would have (``ablate.promote.match._OBSERVED_IDENTITY``)."""
    if status == "failed" and not _text(hardware):
        return None
    return _text(software)


def _block(fingerprint: Optional[str], sweep: Any, block: Any, attempt: Any) -> Optional[tuple[str, str, int]]:
    sweep, block = _text(sweep), _text(block)
    try:
        number = int(attempt)
    except (TypeError, ValueError):
        return None
    return (sweep, block, number) if fingerprint is None and sweep is not None and block is not None else None


def from_identity(origin: str, reason: str, raw: Any) -> Rejection:
    """The reject line for a receipt's JSON that did not validate, attributed from its ``identity`` when that
    still names a lane (anything else about it may be what is wrong)."""
    identity = raw.get("identity") if isinstance(raw, Mapping) else None
    lane_key = _text(identity.get("lane_key")) if isinstance(identity, Mapping) else None
    if lane_key is None:
        return Rejection(origin, reason)
    assert isinstance(identity, Mapping)
    feature = identity.get("feature")
    fingerprint = _fingerprint(identity.get("status"), identity.get("hardware_fingerprint"),
                               identity.get("software_fingerprint"))
    return Rejection(origin, reason, UnreadArm(
        origin=origin, lane_key=lane_key, feature=feature if isinstance(feature, str) and feature else None,
        software_fingerprint=fingerprint, receipt_id=_text(identity.get("receipt_id")) or "",
        created_at=_text(identity.get("created_at")),
        block=_block(fingerprint, identity.get("sweep_id"), identity.get("block_id"), identity.get("attempt"))))


def from_run_tags(origin: str, reason: str, tags: Mapping[str, str], prefix: str) -> Rejection:
    """The reject line for an arm run whose receipt cannot be read, attributed from the run's tags (``prefix``:
    ablate's tag namespace) when they name a lane."""
    lane_key = _text(tags.get(prefix + "lane_key"))
    if lane_key is None:
        return Rejection(origin, reason)
    feature = _text(tags.get(prefix + "feature"))
    fingerprint = _fingerprint(tags.get(prefix + "status"), tags.get(prefix + "hardware_fingerprint"),
                               tags.get(prefix + "software_fingerprint"))
    return Rejection(origin, reason, UnreadArm(
        origin=origin, lane_key=lane_key, feature=None if feature in (None, AA_FEATURE) else feature,
        software_fingerprint=fingerprint, receipt_id=_text(tags.get(prefix + "receipt_id")) or "",
        created_at=_text(tags.get(prefix + "created_at")),
        block=_block(fingerprint, tags.get(prefix + "sweep_id"), tags.get(prefix + "block_id"),
                     tags.get(prefix + "attempt"))))


def unread_arms(rejected: Any) -> list[UnreadArm]:
    """The attributed arms among reject lines (plain pairs carry none)."""
    return [r.unread for r in rejected if isinstance(r, Rejection) and r.unread is not None]
