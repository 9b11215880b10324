"""What a sweep's close needs of each receipt: a few identity fields and the compared rate, not the receipt.

How to use: ``outline(receipt)``; functions that only count or pair arms (``ablate.sweep.trial.block_progress``,
``ablate.tracking.plots.block_ratios``, ``TrackingClient.log_summary``) take receipts or outlines alike.

Why: the close of a sweep reads every receipt the sweep wrote back from disk (the files are the truth: arms that
reported after the driver stopped listening are found there). Held whole, 2,000 receipts of a 1,000-block sweep
took ~130 MB of the driver at its very end (~66 KB each); an outline is a few hundred bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ablate.receipts.schema import Receipt, Status


@dataclass(frozen=True, slots=True)
class ArmOutline:
    receipt_id: str
    sweep_id: str
    block_id: str
    attempt: int
    arm_index: int
    status: Status
    feature: Optional[str]
    feature_value: Any
    tokens_per_s: Optional[float]
    """The projected tokens/s at the lane's horizon (``projection.tokens_per_s``): what the summary plots."""


ReceiptLike = Union[Receipt, ArmOutline]


def outline(receipt: ReceiptLike) -> ArmOutline:
    if isinstance(receipt, ArmOutline):
        return receipt
    ident = receipt.identity
    return ArmOutline(receipt_id=ident.receipt_id, sweep_id=ident.sweep_id, block_id=ident.block_id,
                      attempt=ident.attempt, arm_index=ident.arm_index, status=ident.status, feature=ident.feature,
                      feature_value=ident.feature_value,
                      tokens_per_s=receipt.projection.tokens_per_s if receipt.projection else None)
