"""Receipts on disk: one JSON file per arm under ``<sweep dir>/receipts/``, plus the JSONL spool.

How to use: ``write_receipt`` / ``append_spool`` on the way in; ``load_receipts(source)`` on the way out, where
``source`` is a receipt JSON file, a JSONL spool, a receipts directory, a campaign directory or a whole storage
root. It returns the valid receipts and, for *every* file (or spool line) it could not use, ``(origin, reason)``.

The files are the source of truth. MLflow is a view of them (``ablate receipts sync`` makes it match), so a
tracking store that goes away loses nothing.

What is read when ``source`` is a directory (the layout of ``ablate.sweep.layout``):
- every ``*.json`` and ``*.jsonl`` file, hidden or not: each must be a receipt (a spool: one per line), or it is
  rejected with the reason. Nothing that looks like a receipt file is skipped silently;
- every other file directly inside a ``receipts/`` directory is rejected too (``receipts/`` holds only
  ``<receipt_id>.json``; a ``.receipt-*.tmp`` there is a write that died before its rename);
- ``rejected/`` of a campaign: the receipts the sweep driver refused, kept verbatim; each is listed again;
- ``receipts/.work/<receipt_id>/`` is an arm's scratch, not read: it is listed (once, as a directory) only when
  no receipt with that id exists, i.e. the arm is still running or was killed before writing its receipt;
- known non-receipts are not read: Ray's own trees (``_tune/``: Tune's ``result.json`` files; ``_train/``) and
  a campaign's ``sweeps/`` (sweep metadata) and ``LATEST``; other non-JSON files outside ``receipts/`` (plots,
  databases, logs) are not receipt candidates.

Duplicates: the same receipt id may legitimately be on disk twice (``receipts/<id>.json`` and a line of
``spool.jsonl``; a resumed driver spooling it again). Identical copies count once. Copies whose contents differ
are a conflict: every copy is rejected, naming the others and the fields that differ, and the receipt is not
used, since nothing says which copy is the true record.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Union

from ablate.receipts.schema import InvalidReceipt, Receipt, validate_receipt

RECEIPTS_DIR = "receipts"
SPOOL_FILE = "spool.jsonl"
REJECTED_DIR = "rejected"
"""``<campaign>/rejected/``: receipts the sweep driver refused, kept verbatim as ``*.json.txt``."""
ARM_SCRATCH_DIR = ".work"
"""``receipts/.work/<receipt_id>/``: an arm's scratch (spec, worker logs, state), removed once its receipt is
written (``trainers.run.WORK_DIR``). One left behind names an arm that never wrote its receipt."""
NOT_RECEIPT_DIRS = frozenset({"_tune", "_train"})
"""Ray Tune's experiment and Ray Train's state (``ablate.sweep.layout``): their JSON files are not receipts."""
CAMPAIGN_META = frozenset({"sweeps", "LATEST"})
"""A campaign's own bookkeeping next to ``receipts/``: sweep metadata and the resume pointer."""
_MAX_DIFF_PATHS = 5


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


# --- reading ---


class Unreadable(NamedTuple):
    """A candidate receipt that could not even be parsed; ``reason`` says why."""

    reason: str


class Scratch(NamedTuple):
    """An arm's scratch directory under ``receipts/.work/``: a problem only if its receipt is missing."""

    receipt_id: str


Raw = Union[Any, Unreadable, Scratch]
"""What ``iter_raw`` yields per candidate: the parsed JSON value (any type), why there is none, or a scratch dir."""


def _decode(data: bytes) -> Raw:
    """Parsed JSON of one file or spool line; never raises (bad bytes are a reason, not a traceback)."""
    if not data.strip():
        return Unreadable("empty file: no receipt in it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Unreadable(f"not UTF-8 text (byte {data[exc.start:exc.start + 1]!r} at offset {exc.start}): "
                          f"not a receipt JSON file")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        return Unreadable(f"not valid JSON: {exc}")


def _read_bytes(path: Path) -> bytes | Unreadable:
    try:
        return path.read_bytes()
    except OSError as exc:
        return Unreadable(f"cannot read the file: {exc.strerror or exc}")


def _iter_spool(path: Path) -> Iterator[tuple[str, Raw]]:
    data = _read_bytes(path)
    if isinstance(data, Unreadable):
        yield str(path), data
        return
    if not data.strip():
        yield str(path), Unreadable("empty spool file: no receipt lines in it")
        return
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():  # blank lines only separate records
            yield f"{path}:{number}", _decode(line)


def _is_campaign_dir(directory: Path) -> bool:
    return (directory / RECEIPTS_DIR).is_dir() or (directory / SPOOL_FILE).is_file()


def _walk(directory: Path) -> Iterator[tuple[Path, str]]:
    """(path, kind) under ``directory``: kind "json", "jsonl", "rejected" (driver-refused), "stray" (an
    unexpected file inside receipts/) or "scratch" (an arm's scratch dir). Sorted: origins come out in a stable
    order. A directory that cannot be listed comes out as kind "unlistable" (os.walk would skip it silently)."""
    unlistable: list[OSError] = []
    for root, dirs, files in os.walk(directory, onerror=unlistable.append):
        here = Path(root)
        campaign = _is_campaign_dir(here)
        in_receipts = here.name == RECEIPTS_DIR
        if in_receipts and ARM_SCRATCH_DIR in dirs:
            for arm in sorted(p for p in (here / ARM_SCRATCH_DIR).iterdir() if p.is_dir()):
                yield arm, "scratch"
        if here.name == ARM_SCRATCH_DIR and here == directory:
            for arm in sorted(p for p in here.iterdir() if p.is_dir()):
                yield arm, "scratch"
            dirs[:] = []
        dirs[:] = sorted(d for d in dirs if d not in NOT_RECEIPT_DIRS and not (campaign and d in CAMPAIGN_META)
                         and not (in_receipts and d == ARM_SCRATCH_DIR))
        in_rejected = here.name == REJECTED_DIR and _is_campaign_dir(here.parent)
        for name in sorted(files):
            if campaign and name in CAMPAIGN_META:
                continue
            path = here / name
            if in_rejected:  # whatever its name: a refused receipt never becomes evidence by being renamed
                yield path, "rejected"
            elif name.endswith(".jsonl"):
                yield path, "jsonl"
            elif name.endswith(".json"):
                yield path, "json"
            elif in_receipts:
                yield path, "stray"
    for error in unlistable:
        yield Path(error.filename or directory), f"unlistable:{error.strerror or error}"


def _stray_reason(path: Path) -> str:
    if path.name.startswith(".receipt-") and path.name.endswith(".tmp"):
        return ("unfinished receipt write: the process died before renaming it to <receipt_id>.json "
                "(look for the arm's receipt in spool.jsonl or MLflow)")
    return "not a receipt file: receipts/ holds only <receipt_id>.json files"


def _rejected_reason(path: Path) -> str:
    raw = _read_bytes(path)
    parsed = raw if isinstance(raw, Unreadable) else _decode(raw)
    why = parsed.reason if isinstance(parsed, Unreadable) else _invalid_reason(parsed)
    if why is None:
        why = "it validates now; move it into receipts/ as <receipt_id>.json to count it"
    return f"refused by the sweep driver when the arm reported it (kept for forensics): {why}"


def iter_raw(source: str | Path) -> Iterator[tuple[str, Raw]]:
    """Yield (origin, parsed JSON or ``Unreadable``) for every receipt candidate under ``source``: a JSON file,
    a JSONL spool (origin ``<file>:<line>``) or a directory (see the module docstring for what is read)."""
    source = Path(source)
    if source.is_dir():
        for path, kind in _walk(source):
            if kind == "jsonl":
                yield from _iter_spool(path)
            elif kind == "json":
                yield from iter_raw(path)
            elif kind == "rejected":
                yield str(path), Unreadable(_rejected_reason(path))
            elif kind == "scratch":
                yield str(path), Scratch(path.name)
            elif kind.startswith("unlistable:"):
                yield str(path), Unreadable(f"cannot list the directory: {kind.split(':', 1)[1]}")
            else:
                yield str(path), Unreadable(_stray_reason(path))
        return
    if not source.exists():
        yield str(source), Unreadable("no such file or directory")
        return
    if source.suffix == ".jsonl":
        yield from _iter_spool(source)
        return
    data = _read_bytes(source)
    yield str(source), data if isinstance(data, Unreadable) else _decode(data)


def _invalid_reason(raw: Any) -> str | None:
    """Why ``raw`` is not a valid receipt, or None when it is one."""
    try:
        _validate(raw)
    except InvalidReceipt as exc:
        return str(exc)
    return None


def _validate(raw: Any) -> Receipt:
    if isinstance(raw, dict) and "identity" not in raw and "schema_version" not in raw:
        keys = ", ".join(sorted(map(str, raw))[:6]) or "none"
        raise InvalidReceipt(f"not a receipt: a JSON object without 'schema_version' or 'identity' (keys: {keys})")
    try:
        return validate_receipt(raw)
    except InvalidReceipt:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # A value of the wrong JSON type where the validator expects another (e.g. a list as schema_version).
        raise InvalidReceipt(f"not a receipt: {type(exc).__name__}: {exc}") from exc


def _differing_paths(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON values differ (at most a handful: enough to see what kind of conflict)."""
    if isinstance(a, dict) and isinstance(b, dict):
        paths: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                paths += _differing_paths(a.get(key), b.get(key), f"{prefix}{key}.")
            if len(paths) >= _MAX_DIFF_PATHS:
                break
        return paths[:_MAX_DIFF_PATHS]
    return [prefix.rstrip(".") or "<root>"]


def load_receipts_from(sources: Iterable[str | Path]) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Validated receipts under all ``sources`` (deduplicated by receipt id) and (origin, reason) for every
    candidate that is not used: unreadable, invalid, or one of several differing copies of a receipt id."""
    copies: dict[str, list[tuple[str, Receipt, dict[str, Any]]]] = {}
    rejected: list[tuple[str, str]] = []
    scratch: list[tuple[str, str]] = []
    for source in sources:
        for origin, raw in iter_raw(source):
            if isinstance(raw, Scratch):
                scratch.append((origin, raw.receipt_id))
                continue
            if isinstance(raw, Unreadable):
                rejected.append((origin, raw.reason))
                continue
            try:
                receipt = _validate(raw)
            except InvalidReceipt as exc:
                rejected.append((origin, str(exc)))
                continue
            copies.setdefault(receipt.identity.receipt_id, []).append(
                (origin, receipt, receipt.model_dump(mode="json")))
    receipts: list[Receipt] = []
    for receipt_id, found in copies.items():
        first = found[0][2]
        if all(content == first for _, _, content in found[1:]):
            receipts.append(found[0][1])
            continue
        for origin, _, content in found:
            others = [(o, c) for o, _, c in found if o != origin]
            described = "; ".join(
                f"{o}" + (" (identical to this copy)" if c == content else
                          f" (differs in {', '.join(_differing_paths(content, c))})")
                for o, c in others)
            rejected.append((origin, f"conflicting copies of receipt {receipt_id}: also in {described}; "
                                     f"no copy is used until the wrong one is removed"))
    # Scratch whose receipt exists is only a leftover of the clean-up; without one, an arm has no receipt.
    rejected += [(origin, f"scratch of arm {receipt_id}, which has no receipt: it is still running, or it was "
                          f"killed before writing one (an interrupted sweep; --resume reruns its block)")
                 for origin, receipt_id in scratch if receipt_id not in copies]
    return receipts, rejected


def load_receipts(source: str | Path) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Validated receipts under ``source`` (deduplicated by receipt id) and (origin, reason) for every file or
    spool line that could not be used; see the module docstring."""
    return load_receipts_from([source])
