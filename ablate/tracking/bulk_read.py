"""Every arm run's receipt back from MLflow in bulk: from the payload tags the run search already returned, and
``receipt.json`` only for runs without one, downloaded concurrently.

Why: reading 10,000 receipts one artifact at a time cost one ``get_run`` plus one download per run (for a
tracking server, two HTTP round trips each); the payload comes with the paginated ``search_runs`` the reader
makes anyway. Numbers: benchmarks/results/promote_store.json.

Both copies go through the same checks (``validate_receipt`` and the receipt's own digest); a payload is also
checked against its run's ``ablate.receipt_id`` and ``ablate.digest`` tags. A run whose copy fails is rejected
with the reason, exactly as a damaged ``receipt.json`` always was: a damaged payload is not silently replaced by
the artifact, so a store whose two copies disagree is seen.
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import orjson

from ablate.parallel import fork_map, in_forked_child
from ablate.receipts.accepted import AcceptedPayloads, checking_fingerprint, payload_key
from ablate.receipts.schema import InvalidReceipt, Receipt, in_the_future, validate_decoded
from ablate.receipts.store import digest_problem
from ablate.redact import redact_text
from ablate.tracking.mapping import TAG
from ablate.tracking.payload import WHERE, PayloadError, check_against_run, has_payload, payload_json

RECEIPT_ARTIFACT = "receipt.json"
DOWNLOAD_THREADS = 8
"""For runs without a payload only. Overlapping HTTP round trips to a server helps a little (500 reads: 6.5 s one
thread, 5.4 s eight); from a local store the parse and validation hold the GIL, so threads gain nothing there."""
try:
    CHECKING_FINGERPRINT: Optional[str] = checking_fingerprint()
    """Of the checking code as imported (``ablate.receipts.accepted``); None without its source: no cache."""
except OSError:
    CHECKING_FINGERPRINT = None
CACHE_MIN_RUNS = 100
"""Reads of fewer runs than this neither consult nor feed ``ablate.receipts.accepted``."""
PARALLEL_MIN_SHARE = 500
"""Fewer receipts per process than this are checked in this process: a fork and the pickled results back cost
more than they save."""


@dataclass
class Outcome:
    run: Any
    receipt: Optional[Receipt] = None
    reason: Optional[str] = None

    def __post_init__(self) -> None:
        # An MLflow error quotes the tracking URI it called, password included, and a reason is shown on stderr
        # and in the report (PR body and JSON).
        if self.reason is not None:
            self.reason = redact_text(self.reason)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """A run search builds ~150 ORM/entity objects per run and none of them is garbage until it returns; the
    cyclic collector re-scanning that growing heap was 60% of a 3,500-run search (33 s -> 13 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_receipt(data: Union[bytes, str]) -> Receipt:
    """One receipt from JSON bytes, as strictly as a receipt file: schema, re-derived figures and digest."""
    return _parsed(data)[0]


def _parsed(data: Union[bytes, str]) -> tuple[Receipt, bool]:
    """``parse_receipt(data)``, and whether ``data`` is exactly the accepted model's own JSON: only such a payload may
    be remembered (``_already_accepted`` rebuilds the model from the bytes)."""
    source = data.encode("utf-8") if isinstance(data, str) else data
    receipt = _own_json_receipt(source)
    if receipt is not None:
        return receipt, True
    raw = json.loads(data)
    receipt, own = validate_decoded(raw, source)
    problem = digest_problem(raw)
    if problem:
        raise InvalidReceipt(problem)
    return receipt, own


def _own_json_receipt(source: bytes) -> Optional[Receipt]:
    """The receipt in ``source`` when ``source`` is exactly its model's own JSON (what every writer logs) and it
    passes the checks, decoded by orjson, 2.5x faster than ``json.loads`` on a receipt (0.034 against 0.084 ms);
    None for anything else, which ``_parsed`` decodes with ``json.loads`` and checks as before. The two decoders
    read a model's own JSON alike: pydantic writes no duplicate key, no NaN or Infinity, no lone surrogate, numbers
    that both read back to the same value; on other text (any of those, a huge integer, a byte-order mark) they may
    differ, and only ``json.loads``'s reading counts."""
    try:
        raw = orjson.loads(source)
        receipt, own = validate_decoded(raw, source)
    except Exception:  # noqa: BLE001 - whatever orjson or the checks refuse is decoded and checked again, as before
        return None
    # A refusal is json.loads's to give: orjson reads an integer past 64 bits as a float, which a schema accepting
    # such a float for an int field (pydantic does not today) would make own JSON whose digest fails here only.
    return receipt if own and digest_problem(raw) is None else None


def _payload(run: Any) -> Union[bytes, Outcome, None]:
    """The run's payload bytes; None when it has none; the run's outcome when its payload tags are damaged."""
    try:
        return payload_json(run.data.tags)
    except PayloadError as exc:
        return Outcome(run, reason=f"{exc} ({WHERE}; receipt.json is the authoritative copy)")


def _full_check(data: bytes, tags: Mapping[str, str]) -> tuple[Optional[Receipt], Optional[str], bool]:
    """(receipt, None, whether ``data`` is the model's own JSON: ``_parsed``) when ``data`` passes the full checks
    and matches the run tags ``tags``; else (None, why, False)."""
    try:
        receipt, own = _parsed(data)
        check_against_run(receipt, tags)
    except (InvalidReceipt, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"{exc} ({WHERE}; receipt.json is the authoritative copy)", False
    except Exception as exc:  # noqa: BLE001 - JSON of the wrong shape for the validator: refused, never a crash
        return None, f"not a receipt: {type(exc).__name__}: {exc} ({WHERE})", False
    return receipt, None, own


def _already_accepted(run: Any, data: bytes) -> Optional[Outcome]:
    """The receipt in ``data``, which the full checks accepted before (``ablate.receipts.accepted``), checked
    against this run's tags; None if anything fails (the full checks then run and say why). Only payloads that are
    exactly pydantic's own serialization of the model they were checked as are remembered (``_check_result``), so
    pydantic's JSON parser rebuilds that very model (its dump-validate round trip), in a third of the time of
    ``json.loads`` plus ``model_validate``."""
    try:
        receipt = Receipt.model_validate_json(data)
        check_against_run(receipt, run.data.tags)
        if in_the_future(receipt.identity.created_at):  # accepted under another clock (a shared cache, a step back)
            return None
    except Exception:  # noqa: BLE001 - never the reason given: the full checks give it
        return None
    return Outcome(run, receipt=receipt)


Checked = tuple[Optional[Receipt], Optional[str], bool, Optional[bytes]]
"""What ``_check_result`` gives: (receipt, reason, whether the payload may be remembered, the payload when it may)."""


def _check_result(item: tuple[Any, Optional[bytes]]) -> Checked:
    """(receipt, reason, whether the payload may be remembered as accepted, the payload when it may be) for a run and
    its payload bytes, or for a run alone (``None``), whose payload is then decoded here, in the process that checks
    it: with nothing remembered to look payloads up in, decoding them (~0.035 ms each) is split over the CPUs too.
    Only a payload that is exactly the model's own JSON (what every writer puts there) may be remembered; one with
    other spacing, key order or duplicate keys is checked in full every time. In a forked child such a receipt is
    not sent back, only its payload: the parent rebuilds it from the bytes as a remembered one is (``_rebuilt``), in
    about half the time of pickling it there and unpickling it here."""
    run, data = item
    if data is None:
        decoded = _payload(run)  # never None: the reader sends only runs that have payload tags
        if isinstance(decoded, Outcome):  # damaged payload tags
            return None, decoded.reason, False, None
        data = decoded
    receipt, reason, canonical = _full_check(data, run.data.tags)
    return None if canonical and in_forked_child() else receipt, reason, canonical, data if canonical else None


def logged_payload_key(data: bytes, tags: Mapping[str, str]) -> Optional[bytes]:
    """The ``payload_key`` of a payload a writer has just logged with the run tags ``tags``, when it passes exactly
    what ``read_arm_runs`` checks before remembering a payload (the full checks, the run's tags, the model's own
    JSON); else None. The writer remembers it as accepted, so the first promotion after a sweep skips the checks as
    later ones do (10,000 receipts: ~3 s of CPU, 0.29-0.35 ms each: ``writer_check_ms`` in
    benchmarks/results/promote_store.json)."""
    _, _, canonical = _full_check(data, tags)
    return payload_key(data) if canonical else None


def _rebuilt(item: tuple[Any, Optional[bytes]], result: Checked) -> Checked:
    """``_check_result``'s result as a forked child sent it back, with the receipt it left out rebuilt from its
    payload (``fork_map``'s ``received``: here, between the parent's own chunks)."""
    receipt, reason, canonical, data = result
    if receipt is None and canonical and data is not None:
        try:
            receipt = Receipt.model_validate_json(data)  # checked in full by the child: the very model it accepted
        except Exception:  # noqa: BLE001 - cannot happen to the model's own JSON; if it does, check it here
            receipt, reason, canonical = _full_check(data, item[0].data.tags)
            return receipt, reason, canonical, data if canonical else None
    return receipt, reason, canonical, data


def _from_artifact(run: Any, tracking_uri: str, tmp: Path) -> Outcome:
    from mlflow.artifacts import download_artifacts

    run_id = run.info.run_id
    try:
        # The run's own artifact URI: no get_run round trip per receipt.
        path = download_artifacts(artifact_uri=f"{run.info.artifact_uri.rstrip('/')}/{RECEIPT_ARTIFACT}",
                                  dst_path=str(tmp / run_id), tracking_uri=tracking_uri)
        return Outcome(run, receipt=parse_receipt(Path(path).read_text()))
    except (InvalidReceipt, OSError, json.JSONDecodeError) as exc:
        return Outcome(run, reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - MlflowException for a missing artifact
        return Outcome(run, reason=f"{RECEIPT_ARTIFACT} unavailable: {exc}")


def read_arm_runs(runs: list[Any], tracking_uri: str, use_payload: bool = True,
                  threads: int = DOWNLOAD_THREADS) -> list[Outcome]:
    """One outcome per run, in the order given: its receipt, or why it cannot be used. ``use_payload=False``
    reads every receipt from its ``receipt.json`` (the authoritative copy)."""
    outcomes: list[Optional[Outcome]] = []
    pending: list[tuple[int, Any]] = []
    to_check: list[tuple[int, Any, Optional[bytes]]] = []
    # Opening the cache reads all of it (100,000 remembered receipts: 3 MB, ~30 ms): a read of a few runs (the
    # sweep driver answering a block, after each arm) checks them instead, as before the cache.
    remember = use_payload and len(runs) >= CACHE_MIN_RUNS
    accepted = AcceptedPayloads.open(CHECKING_FINGERPRINT) if remember else None
    # With nothing remembered, every payload is checked: it is decoded where it is checked (_check_result).
    look_up = accepted is not None and not accepted.empty
    for run in runs:
        if run.data.tags.get(TAG + "logged") != "1":
            outcomes.append(Outcome(run, reason="incomplete run (logging was interrupted); run a sync"))
            continue
        if not use_payload or not has_payload(run.data.tags):
            pending.append((len(outcomes), run))
            outcomes.append(None)
            continue
        data = _payload(run) if look_up else None
        if isinstance(data, Outcome):
            outcomes.append(data)
            continue
        if data is not None and accepted is not None and payload_key(data) in accepted:
            outcome = _already_accepted(run, data)
            if outcome is None:
                to_check.append((len(outcomes), run, data))
            outcomes.append(outcome)
            continue
        to_check.append((len(outcomes), run, data))
        outcomes.append(None)
    # Checking a receipt (schema, re-derived figures, digest) is ~0.3 ms of pure Python: the ones not accepted
    # before are split over the CPUs. Only the receipt or the reason comes back, never the run with its payload tags.
    checked = fork_map(_check_result, [(run, data) for _, run, data in to_check], min_share=PARALLEL_MIN_SHARE,
                       received=_rebuilt)
    for (index, run, _), (receipt, reason, _, _) in zip(to_check, checked):
        outcomes[index] = Outcome(run, receipt=receipt, reason=reason)
    if accepted is not None:
        accepted.add(payload_key(data) for _, _, canonical, data in checked if canonical and data is not None)
        accepted.save()
    if pending:
        with tempfile.TemporaryDirectory(prefix="ablate-receipts-") as tmp, \
                ThreadPoolExecutor(max_workers=max(1, min(threads, len(pending)))) as pool:
            fetched = pool.map(lambda item: _from_artifact(item[1], tracking_uri, Path(tmp)), pending)
            for (index, _), outcome in zip(pending, fetched):
                outcomes[index] = outcome
    return [outcome for outcome in outcomes if outcome is not None]
