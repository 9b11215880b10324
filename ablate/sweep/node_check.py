"""Before any block runs: does each node's own deep check vouch for the backends the campaign's lanes request?

How to use::

    docs = read_node_checks(sweep.node_check.path)          # one per alive Ray node (a pinned task per remote node)
    findings = assess(plan_requests(plan), docs, sweep.node_check)
    enforce(findings)                                         # NodeCheckRefused names node, op, backend and why

``ablate doctor --deep --json ~/.ablate/node_check.json`` (cluster.yaml runs it in every worker's set-up) leaves a
document per node. A lane that requests a backend the document found **wrong** (fails its reference twin) is
refused, always: the arms would run it and time a kernel that computes something else. A backend the document
found **unavailable** (cannot run on that device; the arm would silently run the fallback and be disqualified for
it) is refused unless ``node_check.allow_fallback`` names its feature. A node with no current document for the
lane's device (none, unreadable, made by another torch or for the other device) is a warning, or a refusal with
``node_check.required``. A backend that passed only in the Triton interpreter (a CPU check under
``TRITON_INTERPRET=1``) counts as unavailable: arms do not run in the interpreter.

The driver cannot read a remote node's files, so each remote node reads its own with a tiny Ray task pinned to it
(``NodeAffinitySchedulingStrategy``, hard); the driver's own node is read in-process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Optional

from ablate.config.backends import requested_backends
from ablate.config.schema import LaneConfig, NodeCheckConfig

log = logging.getLogger(__name__)

ENV = "ABLATE_NODE_CHECK"
"""Overrides ``node_check.path`` on every node (tests; nodes that keep the document elsewhere)."""
READ_TIMEOUT_S = 60.0
NODE_CHECK_TAG = "ablate.node_check"
"""Parent-run tag: per node, the document's path, digest, device, torch and verdict the sweep was held against."""


@dataclass(frozen=True)
class Request:
    device: str
    """cpu | cuda: where the lane's arms would run on a node (``lane.hardware.device`` and the node's GPUs)."""
    feature: str
    op: str
    backend: str


@dataclass
class NodeDoc:
    node_id: str
    host: str
    has_gpu: bool
    path: str
    document: Optional[dict[str, Any]]
    sha256: Optional[str]
    why: str = ""
    """Why there is no usable document (empty when there is one)."""

    def summary(self) -> dict[str, Any]:
        doc = self.document or {}
        return {"host": self.host, "path": self.path, "sha256": (self.sha256 or "")[:16] or None,
                "device": doc.get("device"), "ok": doc.get("ok"), "torch": doc.get("torch_version"),
                "why": self.why or None}


@dataclass(frozen=True)
class Finding:
    host: str
    status: str
    """wrong | unavailable | interpreted | unchecked | no-document"""
    refuses: bool
    reason: str
    request: Optional[Request] = None

    def line(self) -> str:
        if self.request is None:
            return f"{self.host}: {self.status}: {self.reason}"
        req = self.request
        return f"{self.host}: {req.feature} -> {req.op}/{req.backend} on {req.device}: {self.status}: {self.reason}"


class NodeCheckRefused(RuntimeError):
    """A lane requests a backend a node's deep check found wrong or absent; the message lists every finding."""


def lane_device(lane: LaneConfig, has_gpu: bool) -> str:
    return "cuda" if lane.hardware.device.value in ("cuda", "auto") and has_gpu else "cpu"


def lane_requests(lanes: Iterable[LaneConfig], has_gpu: bool) -> set[Request]:
    out = set()
    for lane in lanes:
        device = lane_device(lane, has_gpu)
        for op, (feature, backend) in requested_backends(lane.model, lane.features, device == "cuda").items():
            out.add(Request(device, feature, op, backend))
    return out


def plan_lanes(plan: Any) -> list[LaneConfig]:
    """Every distinct lane any arm of the plan trains (baselines and candidates)."""
    seen: dict[str, LaneConfig] = {}
    for block in plan.blocks:
        for arm in block.arms:
            seen.setdefault(repr(arm.lane), arm.lane)
    return list(seen.values())


def _torch_version() -> Optional[str]:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def read_document(path_setting: str, node_id: str = "", host: Optional[str] = None, has_gpu: bool = False) -> NodeDoc:
    """This node's document, checked for what makes it unusable (missing, unreadable, another torch)."""
    path = Path(os.environ.get(ENV) or path_setting).expanduser()
    doc = NodeDoc(node_id, host or socket.gethostname(), has_gpu, str(path), None, None)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        doc.why = f"no document at {path}: run `ablate doctor --deep --json {path}` on this node"
        return doc
    except OSError as exc:
        doc.why = f"{path} cannot be read: {exc.strerror or exc}"
        return doc
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
            raise ValueError("not an `ablate doctor --deep` document (no backends list)")
    except ValueError as exc:
        doc.why = f"{path} is not a node check document: {exc}"
        return doc
    torch_now = _torch_version()
    # The local-version suffix (+cpu, +cu128) is part of what was checked: a CPU wheel says nothing of a CUDA one.
    if torch_now and data.get("torch_version") and str(data["torch_version"]) != torch_now:
        doc.why = (f"{path} was made with torch {data['torch_version']}, this node runs torch {torch_now}: "
                   f"run `ablate doctor --deep` again")
        return doc
    doc.document, doc.sha256 = data, hashlib.sha256(raw).hexdigest()
    return doc


def read_node_checks(path_setting: str) -> list[NodeDoc]:
    """One document per alive node of the connected Ray cluster."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    docs: list[NodeDoc] = []
    remote: list[tuple[dict[str, Any], Any]] = []
    for node in nodes:
        node_id, has_gpu = node["NodeID"], node.get("Resources", {}).get("GPU", 0) > 0
        host = node.get("NodeManagerHostname") or node.get("NodeManagerAddress") or node_id[:12]
        if node_id == here:
            docs.append(read_document(path_setting, node_id, host, has_gpu))
        else:
            remote.append((node, _remote_reader().options(scheduling_strategy=_pinned(node_id))
                           .remote(path_setting, node_id, host, has_gpu)))
    for node, ref in remote:
        host = node.get("NodeManagerHostname") or node["NodeID"][:12]
        try:
            docs.append(ray.get(ref, timeout=READ_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - a node that cannot answer has no usable document
            docs.append(NodeDoc(node["NodeID"], host, node.get("Resources", {}).get("GPU", 0) > 0,
                                path_setting, None, None, f"the node did not answer ({type(exc).__name__}: {exc})"))
    return docs


def _pinned(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


_REMOTE: Any = None


def _remote_reader() -> Any:
    global _REMOTE
    if _REMOTE is None:
        import ray

        # No CPU reserved: it must run even on a node whose CPUs a running sweep already holds.
        _REMOTE = ray.remote(num_cpus=0, max_retries=0)(read_document)
    return _REMOTE


def _row(document: dict[str, Any], op: str, backend: str) -> Optional[dict[str, Any]]:
    for row in document.get("backends", []):
        if isinstance(row, dict) and row.get("op") == op and row.get("backend") == backend:
            return row
    return None


def failed_backends(doc: NodeDoc, device: str, ran: list[dict[str, Any]]) -> list[str]:
    """``op/backend`` of every backend an arm ran (dispatcher table rows) that this node's document, made for the
    arm's device, marks wrong: the receipt's BACKEND_FAILED_NODE_CHECK."""
    if doc.document is None or str(doc.document.get("device", "")).split(":")[0] != device:
        return []
    return [f"{r['op']}/{r['observed']}" for r in ran
            if (_row(doc.document, r["op"], r["observed"]) or {}).get("status") == "wrong"]


def _wrong_detail(row: dict[str, Any]) -> str:
    failed = [p for p in row.get("parity") or [] if isinstance(p, dict) and not p.get("ok")]
    parts = [f"{p.get('dtype')} {p.get('size')}: " + (p.get("error") or f"error {p.get('rel_error')} > tolerance "
                                                                        f"{p.get('tolerance')}") for p in failed[:2]]
    return "fails its reference twin (" + ("; ".join(parts) or row.get("reason") or "see the document") + ")"


def assess(requests_for: Any, docs: list[NodeDoc], config: NodeCheckConfig) -> list[Finding]:
    """Findings for every node: ``requests_for(has_gpu)`` gives the requests of the plan on such a node."""
    findings: list[Finding] = []
    for doc in docs:
        requests = requests_for(doc.has_gpu)
        devices = {r.device for r in requests}
        checked = str((doc.document or {}).get("device", "")).split(":")[0]
        unenforced = "" if config.required else " (node_check.required is false: not enforced)"
        if doc.document is None:
            findings.append(Finding(doc.host, "no-document", config.required, doc.why + unenforced))
            continue
        for device in sorted(devices - {checked}):  # e.g. a CPU lane on a GPU node checked on CUDA only
            findings.append(Finding(doc.host, "no-document", config.required,
                                    f"{doc.path} checked device {checked or '?'}, the lane runs on {device} here: "
                                    f"run `ablate doctor --deep --device {device}` on this node" + unenforced))
        for req in sorted(requests, key=lambda r: (r.op, r.backend)):
            if req.device != checked:
                continue
            row = _row(doc.document, req.op, req.backend)
            allowed = req.feature in config.allow_fallback
            if row is None:
                findings.append(Finding(doc.host, "unchecked", config.required,
                                        f"{doc.path} has no row for it (a narrowed --op run?)", req))
            elif row.get("status") == "wrong":
                findings.append(Finding(doc.host, "wrong", True, _wrong_detail(row), req))
            elif row.get("status") in ("unavailable", "interpreted"):
                why = (f"passed only in the Triton interpreter, which arms do not use"
                       if row.get("status") == "interpreted" else
                       f"cannot run here; arms would run {row.get('observed')} instead ({row.get('reason')})")
                findings.append(Finding(doc.host, row["status"], not allowed,
                                        why + (" (allowed by node_check.allow_fallback)" if allowed else
                                               f"; allow it with node_check.allow_fallback: [{req.feature}]"), req))
    return findings


def enforce(findings: list[Finding]) -> None:
    """Raise ``NodeCheckRefused`` for refusing findings; log the rest as warnings."""
    refusing = [f for f in findings if f.refuses]
    for finding in findings:
        if not finding.refuses:
            log.warning("node check: %s", finding.line())
    if refusing:
        raise NodeCheckRefused("refused before any block: the node check does not vouch for what the campaign "
                               "requests:\n" + "\n".join(f"  {f.line()}" for f in refusing))


def check_plan(plan: Any, config: NodeCheckConfig) -> list[dict[str, Any]]:
    """Read every node's document, refuse or warn, and return the per-node summary the sweep records."""
    lanes = plan_lanes(plan)
    docs = read_node_checks(config.path)
    enforce(assess(lambda has_gpu: lane_requests(lanes, has_gpu), docs, config))
    return [doc.summary() for doc in docs]

