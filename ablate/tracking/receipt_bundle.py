"""One artifact per sweep that carries every arm run's receipt payload, so a reader makes one small run search
and one download per sweep instead of paging through every arm run.

Why: the payload tags (``ablate.tracking.payload``) come with ``search_runs``, but a search builds every run's
params, metrics and tags; for 10,368 arm runs that was 30 s from a local SQLite store and 89 s from a loopback
``mlflow server`` (benchmarks/results/promote_store.json), before a single receipt was decoded.

How to use: ``write_bundle(client, parent_run_id, sweep_id)`` when a sweep's receipts are all logged (with its
summary); ``read_receipts(client, sweep_id, uri, receipts, rejected, links, ...)`` has the signature and the
results of ``mlflow_store._read_receipts``.

What a bundle holds: for each arm run of the sweep, the run's id, name, artifact URI and its ``ablate.*`` and
``mlflow.parentRunId`` tags as they were when the bundle was written (payload chunks included), plus the names
of the sweep's block runs. Reading hands those stand-in runs to ``bulk_read.read_arm_runs``: every receipt goes
through the same decoding, validation, digest and run-tag checks as one read from its own run, and a run without
a payload still has its ``receipt.json`` downloaded.

When a bundle is not used (the sweep's runs are searched as before): the parent run carries no bundle tag, the
artifact's SHA-256 differs from the tag written after it, the sweep is RUNNING (a live or resumed sweep adds runs
the bundle does not list), an arm run it left out as deleted is deleted no longer (restored, or purged), or the
artifact cannot be read or parsed. A deleted arm run, listed by the bundle or left out of it, is reported among
the rejects. Before arms are added to a finished sweep (a resumed sweep, a
sync), its bundle is withdrawn (the SHA tag goes) and written again at the end, so a rewrite that fails leaves no
stale bundle behind.

Not checked (the price of not listing every run): a run whose tags were edited in place after its sweep's bundle
was written, and a run deleted *and then purged* (``mlflow gc``) after it: once purged it is in no list a reader
can check, so its bundle entry counts again. Rewrite the sweep's bundle after removing runs (``ablate receipts
sync`` on the sweep), or read with ``use_payload=False``, which reads every run.

Cost of writing: no run of the sweep is read back when the writer closing the sweep logged every one of them (a
sweep's own driver from its first arm: ``Ledger``); otherwise (a resumed sweep, ``ablate receipts sync``) one search
of the sweep's arm runs and one of its block runs (30-38 s for a 5,184-arm sweep on the benchmark's SQLite store
under a load average of ~6, against ~31 min of logging). Both give the same bytes
(tests/tracking/test_bundle_ledger.py).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional

from ablate.receipts.rejection import from_run_tags
from ablate.tracking.bulk_read import read_arm_runs
from ablate.tracking.mapping import ROLE_ARM, ROLE_BLOCK, ROLE_SWEEP, TAG

if TYPE_CHECKING:
    from ablate.tracking.mlflow_store import TrackingClient

log = logging.getLogger(__name__)

BUNDLE_ARTIFACT = "receipt-bundle.json.gz"
BUNDLE_FORMAT = "ablate.receipt-bundle/1"
SHA_TAG = TAG + "bundle.sha256"
"""Parent-run tag, written after the artifact: a bundle replaced or half-written is seen, never read."""
MAX_EXCLUDED = 40
"""Bundled sweeps one search may leave out (one tag filter each; SQLite joins at most 64 tables, MySQL 61)."""
RUNS_TAG = TAG + "bundle.runs"
_KEPT_TAGS = ("mlflow.parentRunId",)
_ENDED = ("FINISHED", "FAILED", "KILLED")


@dataclass
class _Info:
    run_id: str
    run_name: Optional[str]
    artifact_uri: str


@dataclass
class _Data:
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class BundledRun:
    """The parts of an MLflow ``Run`` the bulk reader and the report's links read."""

    info: _Info
    data: _Data


def _kept(tags: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in tags.items() if k.startswith(TAG) or k in _KEPT_TAGS}


def _entry(run: Any, tags: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """A bundle's entry for ``run``; ``tags``: what it was created with, when ``run.data`` does not hold them yet."""
    return {"run_id": run.info.run_id, "run_name": run.info.run_name, "artifact_uri": run.info.artifact_uri,
            "tags": _kept(run.data.tags if tags is None else tags)}


class Ledger:
    """The arm and block runs one writer makes for one sweep, as it writes them, so that closing the sweep needs no
    search of its runs (2,000 arm runs: ~4 s of the driver's time on the benchmark host).

    Only started for a sweep that had no arm or block run when the writer opened it: then, with one driver per
    campaign, every run of the sweep is one this writer made, and what it recorded is what a search would return.
    A write it cannot vouch for (one that failed half-way, so MLflow may hold part of it) sets ``complete`` to
    False, and the bundle is written from a search as before; so does a ledger file that cannot be written.

    Memory: an arm's entry (its kept tags, payload included: ~8 KB) goes to an anonymous temporary file as one JSON
    line, rewritten at the end of the file when its tags change; the driver keeps only each arm's offset and the
    block runs' names, so a 1,000-block sweep does not hold 16 MB of entries until it closes (the bundle is
    streamed from the file)."""

    def __init__(self, sweep_id: str) -> None:
        self.sweep_id = sweep_id
        self.arms: dict[str, tuple[int, int]] = {}
        """Arm run id -> (offset, length) of its latest entry in the ledger file."""
        self.blocks: dict[str, Optional[str]] = {}
        """Block run id -> its name (MLflow renames a block run when its answer is logged)."""
        self.complete = True
        self._file: Optional[IO[bytes]] = None

    def arm_created(self, run: Any, tags: Mapping[str, str]) -> None:
        """``run``: what ``create_run`` returned; ``tags``: the tags it was created with."""
        self._put(_entry(run, tags))

    def block_created(self, run_id: str, name: Optional[str]) -> None:
        self.blocks[run_id] = name

    def deleted(self, run_id: str) -> None:
        self.arms.pop(run_id, None)
        self.blocks.pop(run_id, None)

    def tags_logged(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Tags a ``log_batch`` call set on a run, once it returned (``mlflow.runName`` renames the run)."""
        name = tags.get("mlflow.runName")
        if run_id in self.arms and self.complete:
            entry = self._get(run_id)
            if entry is not None:
                entry["tags"].update(_kept(tags))
                if name is not None:
                    entry["run_name"] = name
                self._put(entry)
        if run_id in self.blocks and name is not None:
            self.blocks[run_id] = name

    def runs(self) -> Optional[tuple["LedgerEntries", dict[str, Optional[str]]]]:
        """(arm entries, block run id -> name) of the sweep, as ``write_bundle`` takes them; None when they must be
        searched."""
        if not self.complete:
            return None
        return LedgerEntries(self), dict(self.blocks)

    def close(self) -> None:
        """Drop the file; a later bundle of this sweep is written from a search. Never raises: a full disk may
        refuse the buffer's last flush, and nothing in it is needed any more."""
        self.complete = False
        self.arms.clear()
        handle, self._file = self._file, None
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass

    def _put(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, sort_keys=True).encode("utf-8") + b"\n"
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="ablate-ledger-")  # gone when closed, or with the process
            self._file.seek(0, 2)
            offset = self._file.tell()
            self._file.write(line)
            self._file.flush()  # a full disk refuses here, not at some later seek of another entry
        except OSError as exc:  # a full temporary disk: the bundle is written from a search instead
            log.warning("receipt bundle ledger of sweep %s: %s; its bundle will be written from a search",
                        self.sweep_id, exc)
            self.close()
            return
        self.arms[entry["run_id"]] = (offset, len(line))

    def _get(self, run_id: str) -> Optional[dict[str, Any]]:
        offset, length = self.arms[run_id]
        try:
            assert self._file is not None
            self._file.seek(offset)
            return json.loads(self._file.read(length))
        except (OSError, ValueError, AssertionError) as exc:
            log.warning("receipt bundle ledger of sweep %s: entry of run %s unreadable (%s); its bundle will be "
                        "written from a search", self.sweep_id, run_id, exc)
            self.close()
            return None


class LedgerEntries:
    """A ledger's arm entries in run id order, read from its file one at a time."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def __len__(self) -> int:
        return len(self.ledger.arms)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for run_id in sorted(self.ledger.arms):
            entry = self.ledger._get(run_id)
            if entry is None:
                raise OSError(f"the ledger's entry of arm run {run_id} could not be read back")
            yield entry


def _write_bundle_file(handle: IO[bytes], sweep_id: str, entries: Iterable[dict[str, Any]],
                       blocks: Mapping[str, Optional[str]], deleted: Iterable[str]) -> None:
    """The bundle, gzipped into ``handle``, one entry at a time: the same JSON text as
    ``json.dumps(body, sort_keys=True)`` of the whole body, without holding it. mtime=0 and no file name: the same
    runs give the same bytes, so the same SHA-256."""
    with gzip.GzipFile(filename="", fileobj=handle, mode="wb", compresslevel=6, mtime=0) as out:
        # Keys in sorted order, as sort_keys writes them: blocks, deleted, format, runs, sweep_id.
        out.write(f'{{"blocks": {json.dumps(dict(blocks), sort_keys=True)}, '
                  f'"deleted": {json.dumps(sorted(deleted))}, "format": {json.dumps(BUNDLE_FORMAT)}, '
                  f'"runs": ['.encode("utf-8"))
        for number, entry in enumerate(entries):
            out.write((", " if number else "").encode("utf-8") + json.dumps(entry, sort_keys=True).encode("utf-8"))
        out.write(f'], "sweep_id": {json.dumps(sweep_id)}}}'.encode("utf-8"))


def bundle_bytes(sweep_id: str, arm_runs: list[Any], block_runs: list[Any], deleted: Iterable[str] = ()) -> bytes:
    """The bundle of these runs. ``deleted``: the sweep's arm runs deleted when it is written, which it leaves out; a
    reader that finds one of them no longer deleted (restored) searches the sweep instead of trusting the bundle."""
    buffer = io.BytesIO()
    _write_bundle_file(buffer, sweep_id, [_entry(run) for run in sorted(arm_runs, key=lambda r: r.info.run_id)],
                       {run.info.run_id: run.info.run_name for run in block_runs}, deleted)
    return buffer.getvalue()


def write_bundle(client: "TrackingClient", parent_run_id: str, sweep_id: str,
                 known: Optional[tuple["LedgerEntries", dict[str, Optional[str]]]] = None) -> Optional[str]:
    """Write (or rewrite) the sweep's bundle on its parent run; the artifact's SHA-256, None when it failed (the
    readers then search the sweep's runs, as without a bundle). ``known``: every arm run's entry and block run's
    name of the sweep as its writer logged them (``Ledger.runs``); None: they are searched."""
    from mlflow.entities import RunTag, ViewType

    from ablate.tracking.blocks import block_runs
    from trainers.provenance import file_sha256

    try:
        # First withdraw the old bundle: if this rewrite fails, readers search the sweep instead of trusting a
        # bundle that may lack the arms added since (a resumed sweep, a sync).
        withdraw_bundle(client, parent_run_id)
        deleted = deleted_arm_runs(client, sweep_id, ViewType.DELETED_ONLY)
        with tempfile.TemporaryDirectory(prefix="ablate-bundle-") as tmp:
            path = Path(tmp) / BUNDLE_ARTIFACT
            count = None
            if known is not None:
                try:
                    with path.open("wb") as handle:
                        _write_bundle_file(handle, sweep_id, known[0], known[1], deleted)
                    count = len(known[0])
                except OSError as exc:  # the ledger's file could not be read back: search, as without a ledger
                    log.warning("receipt bundle of sweep %s: the ledger could not be read back (%s); its runs are "
                                "searched instead", sweep_id, exc)
            if count is None:
                arms = list(client.arm_runs(sweep_id).values())
                path.write_bytes(bundle_bytes(sweep_id, arms, list(block_runs(client, sweep_id).values()), deleted))
                count = len(arms)
            digest = file_sha256(path)
            client.client.log_artifact(parent_run_id, str(path))
        client.client.log_batch(parent_run_id, tags=[RunTag(SHA_TAG, digest), RunTag(RUNS_TAG, str(count))])
        return digest
    except Exception as exc:  # noqa: BLE001 - a missing bundle only costs readers time, never a receipt
        log.warning("no receipt bundle for sweep %s (readers will search its runs): %s", sweep_id, exc)
        return None


def _load(parent: Any, tracking_uri: str, tmp: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(bundle, None) or (None, why it is not used)."""
    from mlflow.artifacts import download_artifacts

    expected = parent.data.tags.get(SHA_TAG)
    if expected is None:
        return None, None  # written before bundles existed, or by a writer that failed: not a problem
    if parent.info.status not in _ENDED:
        return None, None  # a live or resumed sweep adds runs its last bundle does not list: they are searched
    try:
        path = download_artifacts(artifact_uri=f"{parent.info.artifact_uri.rstrip('/')}/{BUNDLE_ARTIFACT}",
                                  dst_path=str(tmp / parent.info.run_id), tracking_uri=tracking_uri)
        data = Path(path).read_bytes()
        if hashlib.sha256(data).hexdigest() != expected:
            return None, f"its SHA-256 differs from the parent run's {SHA_TAG} tag"
        body = json.loads(gzip.decompress(data))
        if not isinstance(body, dict) or body.get("format") != BUNDLE_FORMAT or not _well_formed(body):
            return None, f"not a well-formed {BUNDLE_FORMAT} bundle"
        if body["sweep_id"] != parent.data.tags.get(TAG + "sweep_id"):
            return None, f"it lists sweep {str(body['sweep_id'])[:80]!r}, not its parent run's"
        return body, None
    except Exception as exc:  # noqa: BLE001 - missing artifact, bad gzip or JSON: the runs are searched instead
        return None, f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"


def _well_formed(body: dict[str, Any]) -> bool:
    # Checked before any entry is used: a re-signed but malformed bundle falls back to the runs, never crashes.
    runs, blocks, deleted = body.get("runs"), body.get("blocks"), body.get("deleted", [])
    return isinstance(body.get("sweep_id"), str) and isinstance(runs, list) and isinstance(blocks, dict) and \
        isinstance(deleted, list) and all(isinstance(run_id, str) for run_id in deleted) and all(
        isinstance(e, dict) and isinstance(e.get("run_id"), str) and isinstance(e.get("artifact_uri"), str)
        and isinstance(e.get("run_name"), (str, type(None))) and isinstance(e.get("tags"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in e["tags"].items()) for e in runs)


def _stand_in(entry: dict[str, Any]) -> BundledRun:
    return BundledRun(_Info(entry["run_id"], entry["run_name"], entry["artifact_uri"]), _Data(dict(entry["tags"])))


def withdraw_bundle(client: "TrackingClient", parent_run_id: str) -> None:
    """Make the parent run's bundle unusable (its SHA tag goes) before any arm is added to its sweep again."""
    from mlflow.exceptions import MlflowException

    try:
        client.client.delete_tag(parent_run_id, SHA_TAG)
    except MlflowException:
        pass  # no bundle yet: nothing to withdraw


def bundled_arm_runs(client: "TrackingClient", sweep_id: Optional[str], tracking_uri: str, with_blocks: bool = True
                     ) -> tuple[dict[str, Any], dict[str, str], list[tuple[str, str]]]:
    """(receipt id -> arm run, block run id -> name, notes) of the experiment's arm runs (one sweep): from the
    bundles of finished sweeps, and searched for every other sweep (block runs only ``with_blocks``). Notes are
    (origin, reason) rejects."""
    from mlflow.entities import ViewType

    from ablate.tracking.mlflow_store import _q

    scope = [f"{_q(TAG + 'sweep_id')} = '{sweep_id}'"] if sweep_id else []
    parents = client.search([f"{_q(TAG + 'role')} = '{ROLE_SWEEP}'"] + scope)
    bundles: dict[str, dict[str, Any]] = {}
    notes: list[tuple[str, str]] = []
    deleted = deleted_arm_runs(client, sweep_id, ViewType.DELETED_ONLY)
    per_sweep = Counter(parent.data.tags.get(TAG + "sweep_id", "") for parent in parents)
    with tempfile.TemporaryDirectory(prefix="ablate-bundles-") as tmp:
        for parent in parents:
            sweep = parent.data.tags.get(TAG + "sweep_id", "")
            if not sweep or per_sweep[sweep] > 1:
                continue  # one bundle could not speak for another parent's runs: the sweep is searched
            body, why = _load(parent, tracking_uri, Path(tmp))
            back = sorted(set(body.get("deleted", [])) - set(deleted)) if body is not None else []
            if back:
                body, why = None, (f"{len(back)} arm run(s) it left out as deleted are deleted no longer (restored, "
                                   f"e.g. {back[0]})")
            if body is not None:
                bundles[sweep] = body
            elif why is not None:
                notes.append((f"receipt bundle of sweep {sweep} (run {parent.info.run_id})",
                              f"not used, the sweep's runs were searched instead: {why}"))
    # Every other sweep's arm runs (no bundle, an unusable one, still running; arm runs whose sweep has no parent
    # run): one search that leaves the bundled sweeps out, so it returns nothing when every sweep has a bundle.
    # A SQL store joins one subquery per tag filter and SQLite stops at 64 tables in a join: past MAX_EXCLUDED
    # bundles, the largest ones are used and the other sweeps are searched like unbundled ones.
    kept = sorted(bundles, key=lambda sweep: (-len(bundles[sweep]["runs"]), sweep))[:MAX_EXCLUDED]
    bundles = {sweep: bundles[sweep] for sweep in kept}
    others = [f"{_q(TAG + 'sweep_id')} != '{sweep}'" for sweep in sorted(bundles)]
    runs: dict[str, Any] = {run.data.tags[TAG + "receipt_id"]: run
                            for run in client.search([f"{_q(TAG + 'role')} = '{ROLE_ARM}'"] + scope + others)}
    blocks: dict[str, str] = {}
    if with_blocks:
        blocks = {run.info.run_id: run.info.run_name
                  for run in client.search([f"{_q(TAG + 'role')} = '{ROLE_BLOCK}'"] + scope + others)}
    # A deleted run a bundle lists is named by the loop below; one it left out (deleted before it was written)
    # is named here like any searched sweep's.
    listed = {entry["run_id"] for body in bundles.values() for entry in body["runs"]}
    notes += deleted_notes(deleted, skip=listed)
    if bundles:
        for sweep, body in sorted(bundles.items()):
            blocks.update(body["blocks"])
            for entry in body["runs"]:
                run = _stand_in(entry)
                tags = run.data.tags
                if run.info.run_id in deleted:
                    notes.append(from_run_tags(f"run {run.info.run_id}", f"deleted after sweep {sweep}'s receipt "
                                               f"bundle was written; not read from the bundle", tags, TAG))
                    continue
                if tags.get(TAG + "sweep_id") != sweep:
                    notes.append(from_run_tags(f"run {run.info.run_id}", f"sweep {sweep}'s receipt bundle lists it "
                                               f"under sweep {tags.get(TAG + 'sweep_id')!r}; not used", tags, TAG))
                    continue
                rid = tags.get(TAG + "receipt_id")
                if rid is None:
                    notes.append(from_run_tags(f"run {run.info.run_id}", f"sweep {sweep}'s receipt bundle lists it "
                                               f"without an {TAG}receipt_id tag", tags, TAG))
                    continue
                if rid in runs and runs[rid].info.run_id != run.info.run_id:
                    notes.append((f"run {run.info.run_id}", f"sweep {sweep}'s receipt bundle lists receipt {rid}, "
                                                            f"which run {runs[rid].info.run_id} also holds; the "
                                                            f"bundle's entry is not used"))
                    continue
                runs[rid] = run
    return runs, blocks, notes


def deleted_arm_runs(client: "TrackingClient", sweep_id: Optional[str], view: Any) -> dict[str, dict[str, str]]:
    """Run id -> tags of the experiment's arm runs (one sweep's) in ``view`` (deleted ones, for the readers)."""
    from ablate.tracking.mlflow_store import _q

    query = " and ".join([f"{_q(TAG + 'role')} = '{ROLE_ARM}'"] +
                         ([f"{_q(TAG + 'sweep_id')} = '{sweep_id}'"] if sweep_id else []))
    found, token = {}, None
    while True:
        page = client.client.search_runs([client.experiment_id], filter_string=query, run_view_type=view,
                                         max_results=1000, page_token=token)
        found.update((run.info.run_id, run.data.tags) for run in page)
        token = page.token
        if not token:
            return found


def deleted_notes(deleted: Mapping[str, Mapping[str, str]], skip: set[str]) -> list[tuple[str, str]]:
    """A reject line for each deleted arm run but the run ids in ``skip`` (named by their bundle's reading):
    a run search leaves deleted runs out, so without this line a deleted arm (a failure, a gated candidate) left
    the evidence without a word."""
    return [from_run_tags(f"run {run_id}", f"arm run of sweep {tags.get(TAG + 'sweep_id')!r} (receipt "
                                           f"{tags.get(TAG + 'receipt_id')}) is deleted in MLflow: its receipt is not "
                                           f"read; restore the run, or promote from the campaign's receipt files, to "
                                           f"count it", tags, TAG)
            for run_id, tags in sorted(deleted.items()) if run_id not in skip]


def read_receipts(client: "TrackingClient", sweep_id: Optional[str], uri: str, receipts: dict[str, Any],
                  rejected: list[tuple[str, str]], links: dict[str, str], use_payload: bool = True,
                  ui_url: Optional[str] = None, run_labels: Optional[dict[str, dict[str, str]]] = None) -> None:
    """``mlflow_store._read_receipts`` with the arm runs of finished sweeps taken from their bundles."""
    from ablate.tracking.mlflow_store import _read_receipts, collect_outcomes
    from ablate.tracking.uri import ui_base

    if not use_payload:  # the authoritative copies only: every receipt.json, as before
        _read_receipts(client, sweep_id, uri, receipts, rejected, links, use_payload, ui_url, run_labels)
        return
    arm_runs, blocks, notes = bundled_arm_runs(client, sweep_id, uri, with_blocks=run_labels is not None)
    rejected.extend(notes)
    runs = [run for _, run in sorted(arm_runs.items())]
    collect_outcomes(client, read_arm_runs(runs, uri, use_payload=True), ui_base(uri, ui_url)[0], blocks, receipts,
                     rejected, links, run_labels)
