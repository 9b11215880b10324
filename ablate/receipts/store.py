"""Receipts on disk: one JSON file per arm under ``<sweep dir>/receipts/``, plus the JSONL spool.

The files are the source of truth. MLflow is a view of them (``ablate receipts sync`` makes it match), so a
tracking store that goes away loses nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ablate.receipts.schema import InvalidReceipt, Receipt, validate_receipt

RECEIPTS_DIR = "receipts"
SPOOL_FILE = "spool.jsonl"


def write_receipt(receipt: Receipt, directory: str | Path) -> Path:
    """Atomically write ``<directory>/<receipt_id>.json`` (a crash never leaves half a receipt)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{receipt.identity.receipt_id}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".receipt-", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(receipt.model_dump_json(indent=2))
    os.replace(tmp, target)
    return target


def append_spool(receipt: Receipt, sweep_dir: str | Path) -> Path:
    path = Path(sweep_dir) / SPOOL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(receipt.model_dump_json() + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def iter_raw(source: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (origin, raw dict) for every receipt under ``source``: a JSON file, a JSONL spool, or a directory."""
    source = Path(source)
    if source.is_dir():
        for path in sorted(source.rglob("*.json")):
            if path.name.startswith("."):
                continue
            yield from iter_raw(path)
        for path in sorted(source.rglob("*.jsonl")):
            yield from iter_raw(path)
        return
    if source.suffix == ".jsonl":
        for number, line in enumerate(source.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    yield f"{source}:{number}", json.loads(line)
                except json.JSONDecodeError as exc:
                    yield f"{source}:{number}", {"_parse_error": str(exc)}
        return
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as exc:
        data = {"_parse_error": str(exc)}
    if isinstance(data, dict) and "identity" not in data and "_parse_error" not in data:
        return  # some other JSON (e.g. Ray's result files): not a receipt
    yield str(source), data


def load_receipts(source: str | Path) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Validated receipts under ``source`` (deduplicated by receipt id) and (origin, reason) for rejects."""
    receipts: dict[str, Receipt] = {}
    rejected: list[tuple[str, str]] = []
    for origin, raw in iter_raw(source):
        if "_parse_error" in raw:
            rejected.append((origin, f"not valid JSON: {raw['_parse_error']}"))
            continue
        try:
            receipt = validate_receipt(raw)
        except InvalidReceipt as exc:
            rejected.append((origin, str(exc)))
            continue
        receipts.setdefault(receipt.identity.receipt_id, receipt)
    return list(receipts.values()), rejected
