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

Digest: every receipt written here carries ``digest``, the sha256 of its canonical JSON without that field
(``content_digest``). A copy whose content no longer matches its digest (edited after it was written) is
rejected with both values; 2.0 receipts, written before digests, have none and are read as they are.

A receipt that cannot be written where it belongs (disk full, read-only or unwritable directory) is never
dropped: ``write_receipt`` and ``append_spool`` put it in a fallback campaign directory,
``<fallback root>/<campaign>/receipts/`` or ``.../spool.jsonl``, and log one error line naming it. The fallback
root is ``$ABLATE_FALLBACK_DIR``, else ``$XDG_STATE_HOME/ablate/fallback`` (``~/.local/state/...``), else
``<tmp>/ablate-fallback-<uid>``: the first one that takes the write. ``ablate receipts sync <that campaign dir>``
replays it into MLflow. A failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Iterator, NamedTuple, Optional, TypeVar, Union

from ablate.receipts.rejection import from_identity
from ablate.receipts.schema import InvalidReceipt, Receipt, validate_receipt

log = logging.getLogger(__name__)
T = TypeVar("T")

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
DIGEST_FIELD = "digest"
FALLBACK_ENV = "ABLATE_FALLBACK_DIR"
"""Overrides the first place a receipt goes when it cannot be written where it belongs."""


# --- digest ---


def content_digest(data: dict[str, Any]) -> str:
    """sha256 (hex) of a receipt's canonical JSON (sorted keys, no whitespace) without its ``digest`` field.
    Computed on the parsed JSON, so the writer and every reader hash exactly the same values."""
    body = {key: value for key, value in data.items() if key != DIGEST_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def receipt_digest(receipt: Receipt) -> str:
    """The content digest of a receipt object (whatever its ``digest`` field says)."""
    return content_digest(json.loads(receipt.model_dump_json()))


def seal(receipt: Receipt) -> Receipt:
    """The receipt with ``digest`` set to its content digest (the same object when it already is)."""
    digest = receipt_digest(receipt)
    return receipt if receipt.digest == digest else receipt.model_copy(update={DIGEST_FIELD: digest})


def short(digest: Optional[str]) -> str:
    return digest[:16] if digest else "none"


def _version(raw: dict[str, Any]) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in str(raw.get("schema_version", "")).split(".")[:2])
    except ValueError:
        return ()


def _fields_after_2_0(raw: dict[str, Any]) -> list[str]:
    """Fields only a 2.1+ writer puts in a receipt (the writer dumps every field, null or not): a receipt that
    says 2.0 but has one was re-labelled, e.g. to skip the digest check (found in review)."""
    identity, observed = raw.get("identity"), raw.get("observed")
    found = [name for name in (DIGEST_FIELD, "energy") if name in raw]  # a null digest key too: 2.0 wrote none
    found += [f"identity.{name}" for name in ("schedule", "process") if isinstance(identity, dict) and name in identity]
    found += ["observed.node_check"] if isinstance(observed, dict) and "node_check" in observed else []
    return found


def digest_problem(raw: Any) -> Optional[str]:
    """Why a parsed receipt's content does not match its stored digest, or None. Only a 2.0 receipt may have no
    digest: every writer from 2.1 on seals it, so a later one without is a receipt whose digest line was removed
    (with an edit, say, to its host or loss: the check was skipped; found in review)."""
    if not isinstance(raw, dict):
        return None
    if raw.get(DIGEST_FIELD) is None:
        later = _fields_after_2_0(raw)
        if _version(raw) < (2, 1) and not later:
            return None
        sealed = (f"schema {raw.get('schema_version')} receipts are always written with one"
                  if _version(raw) >= (2, 1) else f"it carries {', '.join(later)}, written from schema 2.1 on")
        return (f"no digest, though {sealed}: it was removed after the receipt was written; restore the original "
                f"copy (MLflow keeps one) or re-run its block")
    stored, actual = raw[DIGEST_FIELD], content_digest(raw)
    if stored == actual:
        return None
    return (f"content does not match its digest (stored {short(str(stored))}, content {short(actual)}): the "
            f"receipt was edited after it was written; restore the original copy (MLflow keeps one) or re-run its "
            f"block")


# --- writing, with a fallback that never drops a receipt ---


class ReceiptNotSaved(OSError):
    """Neither the receipt's own place nor any fallback location took the write; the message names them all."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def fallback_roots() -> list[Path]:
    """Where receipts go when their own directory refuses them, in order of preference."""
    roots = []
    if os.environ.get(FALLBACK_ENV):
        roots.append(Path(os.environ[FALLBACK_ENV]).expanduser())
    state = os.environ.get("XDG_STATE_HOME")
    if not state:
        with contextlib.suppress(RuntimeError, KeyError):
            state = str(Path.home() / ".local" / "state")
    if state:
        roots.append(Path(state) / "ablate" / "fallback")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    roots.append(Path(tempfile.gettempdir()) / f"ablate-fallback-{uid}")
    return roots


def _campaign_dirname(campaign: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", campaign).strip("-.") or "campaign"


def fallback_dirs(campaign: str) -> list[Path]:
    """The fallback campaign directories of ``campaign`` that exist (where its refused receipts went)."""
    return [root / _campaign_dirname(campaign) for root in fallback_roots()
            if (root / _campaign_dirname(campaign)).is_dir()]


def with_fallbacks(campaign_dir: str | Path, campaign: str) -> list[Receipt]:
    """The receipts of a campaign directory and of the campaign's fallback directories, each id once (differing
    copies of an id: none). What a resumed sweep has already measured: a block whose receipts a full
    disk sent to a fallback is complete, and rerunning it would write a second measurement under the same ids."""
    sources = [source for source in [Path(campaign_dir), *fallback_dirs(campaign)] if source.exists()]
    # Read together: differing copies of one id are a conflict and neither counts (as promote reads them).
    return load_receipts_from(sources)[0] if sources else []


def atomic_write(target: Path, text: str, prefix: str = ".receipt-") -> None:
    """Write ``target`` through a temporary file (``<prefix>*.tmp``, which ``settle_unfinished_writes`` knows for
    receipts), synced to disk, and a rename; on any failure the temporary file is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())  # a full disk can also surface only here
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _append_line(path: Path, line: str) -> None:
    """Append one line with O_APPEND; a write that fails part-way is cut back off (no half line is left)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(line.encode("utf-8"))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _to_fallback(receipt: Receipt, relative: str, write: Any, where: Path, reason: str) -> Path:
    tried = []
    for root in fallback_roots():
        target = root / _campaign_dirname(receipt.identity.campaign) / relative
        try:
            write(target)
        except OSError as exc:
            tried.append(f"{target.parent} ({_reason(exc)})")
            continue
        log.error("receipt %s could not be written to %s (%s); it is in %s instead: replay it with `ablate receipts "
                  "sync %s`", receipt.identity.receipt_id, where, reason, target, target.parent.parent
                  if relative.startswith(RECEIPTS_DIR + "/") else target.parent)
        return target
    raise ReceiptNotSaved(f"receipt {receipt.identity.receipt_id} could not be written to {where} ({reason}) nor "
                          f"to any fallback: {'; '.join(tried)}; set {FALLBACK_ENV} to a writable directory")


def write_receipt_or_fallback(receipt: Receipt, directory: str | Path) -> tuple[Path, Optional[str]]:
    """(where the receipt is, None) or, when ``directory`` refused it, (its fallback path, why); see the module
    docstring. Raises ``ReceiptNotSaved`` only when no fallback location took it either."""
    receipt = seal(receipt)
    text = receipt.model_dump_json(indent=2)
    name = f"{receipt.identity.receipt_id}.json"
    directory = Path(directory)
    try:
        atomic_write(directory / name, text)
        return directory / name, None
    except OSError as exc:
        reason = _reason(exc)
    return _to_fallback(receipt, f"{RECEIPTS_DIR}/{name}", lambda t: atomic_write(t, text), directory,
                        reason), reason


def write_receipt(receipt: Receipt, directory: str | Path) -> Path:
    """Atomically write ``<directory>/<receipt_id>.json`` with its digest (a crash never leaves half a receipt);
    returns where it landed, which is a fallback location when ``directory`` refused it."""
    return write_receipt_or_fallback(receipt, directory)[0]


def append_spool_or_fallback(receipt: Receipt, sweep_dir: str | Path) -> tuple[Path, Optional[str]]:
    """Append the receipt (with its digest) to ``<sweep_dir>/spool.jsonl``, or to a fallback spool; as
    ``write_receipt_or_fallback``."""
    receipt = seal(receipt)
    line = receipt.model_dump_json() + "\n"
    path = Path(sweep_dir) / SPOOL_FILE
    try:
        _append_line(path, line)
        return path, None
    except OSError as exc:
        reason = _reason(exc)
    return _to_fallback(receipt, SPOOL_FILE, lambda t: _append_line(t, line), path, reason), reason


def append_spool(receipt: Receipt, sweep_dir: str | Path) -> Path:
    return append_spool_or_fallback(receipt, sweep_dir)[0]


def settle_unfinished_writes(directory: str | Path) -> list[tuple[Path, str]]:
    """Deal with ``.receipt-*.tmp`` files a killed process left in a receipts directory (only call this while no
    other process writes there, e.g. under the sweep lock on resume): a complete, valid receipt whose
    ``<receipt_id>.json`` is missing is renamed into place (it was killed just before its rename); anything else
    is a partial write and removed. Returns (file, what was done)."""
    done = []
    for tmp in sorted(Path(directory).glob(".receipt-*.tmp")):
        raw = _read_bytes(tmp)
        parsed = raw if isinstance(raw, Unreadable) else _decode(raw)
        try:
            receipt = _validate(parsed) if not isinstance(parsed, Unreadable) else None
        except InvalidReceipt:
            receipt = None
        target = Path(directory) / f"{receipt.identity.receipt_id}.json" if receipt is not None else None
        try:
            if target is not None and not target.exists():
                os.replace(tmp, target)
                done.append((tmp, f"completed: renamed to {target.name}"))
            else:
                tmp.unlink()
                done.append((tmp, "removed: a partial write" if target is None else
                             f"removed: {target.name} is already whole"))
        except OSError as exc:
            done.append((tmp, f"left: {_reason(exc)}"))
    return done


def arm_scratch(receipt_dir: str | Path, receipt_id: str) -> Path:
    """``<receipt_dir>/.work/<receipt_id>``, created; a per-user temporary directory instead when ``receipt_dir``
    refuses it (read-only, unwritable), so the arm still runs and leaves its receipt (then in a fallback)."""
    work = Path(receipt_dir) / ARM_SCRATCH_DIR / receipt_id
    try:
        work.mkdir(parents=True, exist_ok=True)
        return work
    except OSError as exc:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        elsewhere = Path(tempfile.gettempdir()) / f"ablate-scratch-{uid}" / receipt_id
        elsewhere.mkdir(parents=True, exist_ok=True)
        log.warning("arm %s: no scratch in %s (%s); using %s", receipt_id, work.parent, _reason(exc), elsewhere)
        return elsewhere


# --- reading ---


class Unreadable(NamedTuple):
    """A candidate receipt that could not be used as one; ``reason`` says why, ``raw`` is its parsed JSON when it
    had any (a receipt the sweep driver refused), from which its arm's test can still be told."""

    reason: str
    raw: Any = None


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


def _driver_refused(path: Path) -> Unreadable:
    raw = _read_bytes(path)
    parsed = raw if isinstance(raw, Unreadable) else _decode(raw)
    why = parsed.reason if isinstance(parsed, Unreadable) else _invalid_reason(parsed)
    if why is None:
        why = "it validates now; move it into receipts/ as <receipt_id>.json to count it"
    return Unreadable(f"refused by the sweep driver when the arm reported it (kept for forensics): {why}",
                      None if isinstance(parsed, Unreadable) else parsed)


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
                yield str(path), _driver_refused(path)
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
        receipt = validate_receipt(raw)
    except InvalidReceipt:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # A value of the wrong JSON type where the validator expects another (e.g. a list as schema_version).
        raise InvalidReceipt(f"not a receipt: {type(exc).__name__}: {exc}") from exc
    problem = digest_problem(raw)
    if problem:
        raise InvalidReceipt(problem)
    return receipt


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


def _pass_one(sources: list[str | Path],
              take: Callable[[str, Receipt], None]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Read every candidate under ``sources`` once, handing each valid receipt to ``take(origin, receipt)``;
    returns (rejected, scratch) for what is not a valid receipt."""
    rejected: list[tuple[str, str]] = []
    scratch: list[tuple[str, str]] = []
    for source in sources:
        for origin, raw in iter_raw(source):
            if isinstance(raw, Scratch):
                scratch.append((origin, raw.receipt_id))
                continue
            if isinstance(raw, Unreadable):
                rejected.append(from_identity(origin, raw.reason, raw.raw))
                continue
            try:
                receipt = _validate(raw)
            except InvalidReceipt as exc:
                rejected.append(from_identity(origin, str(exc), raw))
                continue
            take(origin, receipt)
    return rejected, scratch


def _without_digest(receipt: Receipt) -> dict[str, Any]:
    # Compared without the digest (each copy's own was checked): a sealed copy and an unsealed one from before
    # digests existed, of the same content, are the same receipt.
    return {k: v for k, v in receipt.model_dump(mode="json").items() if k != DIGEST_FIELD}


def _conflict(receipt_id: str, copies: list[tuple[str, Receipt]]) -> list[tuple[str, str]]:
    """(origin, reason) for every copy of a receipt id whose copies differ; [] when they are all the same."""
    found = [(origin, _without_digest(receipt)) for origin, receipt in copies]
    if all(content == found[0][1] for _, content in found[1:]):
        return []
    rejected = []
    for origin, content in found:
        others = [(o, c) for o, c in found if o != origin]
        described = "; ".join(
            f"{o}" + (" (identical to this copy)" if c == content else
                      f" (differs in {', '.join(_differing_paths(content, c))})")
            for o, c in others)
        rejected.append(from_identity(origin, f"conflicting copies of receipt {receipt_id}: also in {described}; "
                                              f"no copy is used until the wrong one is removed", content))
    return rejected


def _orphan_scratch(scratch: list[tuple[str, str]], receipt_ids: Container[str]) -> list[tuple[str, str]]:
    # Scratch whose receipt exists is only a leftover of the clean-up; without one, an arm has no receipt.
    return [(origin, f"scratch of arm {receipt_id}, which has no receipt: it is still running, or it was "
                     f"killed before writing one (an interrupted sweep; --resume reruns its block)")
            for origin, receipt_id in scratch if receipt_id not in receipt_ids]


def load_receipts_from(sources: Iterable[str | Path]) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Validated receipts under all ``sources`` (deduplicated by receipt id) and (origin, reason) for every
    candidate that is not used: unreadable, invalid, or one of several differing copies of a receipt id."""
    copies: dict[str, list[tuple[str, Receipt]]] = {}
    rejected, scratch = _pass_one(list(sources),
                                  lambda origin, r: copies.setdefault(r.identity.receipt_id, []).append((origin, r)))
    receipts: list[Receipt] = []
    for receipt_id, alone in copies.items():
        # The usual case, one copy: nothing to compare, so no dump (one per receipt, all held till here, was a
        # quarter of a load's memory: 200 receipts took 28 MB, now 20).
        conflict = _conflict(receipt_id, alone) if len(alone) > 1 else []
        if conflict:
            rejected += conflict
        else:
            receipts.append(alone[0][1])
    return receipts, rejected + _orphan_scratch(scratch, copies)


def _raw_receipt_id(raw: Raw) -> Optional[str]:
    identity = raw.get("identity") if isinstance(raw, dict) else None
    value = identity.get("receipt_id") if isinstance(identity, dict) else None
    return value if isinstance(value, str) else None


def scan_receipts(sources: Iterable[str | Path],
                  keep: Callable[[Receipt], T]) -> tuple[dict[str, T], list[tuple[str, str]]]:
    """``load_receipts_from`` that holds only ``keep(receipt)`` per receipt id, in the order first read: each
    receipt goes once it is read, so memory follows what ``keep`` returns, not the receipts (~66 KB each).

    The same ids are kept and rejected as by ``load_receipts_from``. Ids read more than once are settled by a
    second read of just those, which holds a digest per copy, not the copy; ids whose copies differ by a third,
    which holds the differing copies (to name what differs) and drops the id."""
    sources = list(sources)
    kept: dict[str, T] = {}
    seen: dict[str, int] = {}

    def first(_: str, receipt: Receipt) -> None:
        rid = receipt.identity.receipt_id
        seen[rid] = seen.get(rid, 0) + 1
        if rid not in kept:
            kept[rid] = keep(receipt)

    rejected, scratch = _pass_one(sources, first)
    several = {rid for rid, count in seen.items() if count > 1}
    if several:
        digests: dict[str, set[str]] = {}
        differ: dict[str, list[tuple[str, Receipt]]] = {}
        for collect in (False, True):  # digests first; then, only if some differ, those copies whole
            wanted = several if not collect else {rid for rid, found in digests.items() if len(found) > 1}
            if collect and not wanted:
                break
            for source in sources:
                for origin, raw in iter_raw(source):
                    if _raw_receipt_id(raw) not in wanted:
                        continue
                    try:
                        receipt = _validate(raw)
                    except InvalidReceipt:
                        continue  # rejected in the first read already
                    rid = receipt.identity.receipt_id
                    if collect:
                        differ.setdefault(rid, []).append((origin, receipt))
                    else:
                        digests.setdefault(rid, set()).add(content_digest(_without_digest(receipt)))
        for rid, copies in differ.items():
            conflict = _conflict(rid, copies)
            if conflict:
                rejected += conflict
                kept.pop(rid, None)
    return kept, rejected + _orphan_scratch(scratch, seen)


def load_receipts(source: str | Path) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Validated receipts under ``source`` (deduplicated by receipt id) and (origin, reason) for every file or
    spool line that could not be used; see the module docstring."""
    return load_receipts_from([source])
