"""One dispatcher: each op is resolved once, requested -> observed backend, and the reason is written down.

How to use::

    from kernels.dispatch import Dispatcher
    d = Dispatcher(torch.device("cpu"), strict=False)
    moe_fn = d.resolve("moe", "grouped_mm", dtype=torch.float32, dims=(256, 512)).fn
    d.table()      # [{"op": "moe", "requested": "grouped_mm", "observed": "jagged", "reason": "..."}]
    d.fallbacks()  # the rows where observed != requested: a receipt disqualifier

Each op module registers an ``OpSpec`` at import: its pure-torch reference (the parity oracle) and its backends,
each with an eligibility check and the backend to fall back to. Resolution walks that chain from the requested
backend and records every step it skipped, so "fused on" silently running the fallback is visible in the
receipt. ``strict=True`` (benchmarks, GPU lanes that must not fall back) raises instead of running the fallback.
Tests pin a backend with ``Dispatcher.force`` (bypasses eligibility; the reason says so).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from kernels.capability import Capability, probe

Eligibility = Callable[[Capability, Mapping[str, Any]], tuple[bool, str]]
"""(capability, context) -> (eligible, why). ``why`` is kept in the ledger either way."""


def always(why: str) -> Eligibility:
    """Eligibility for a pure-torch backend that runs everywhere."""

    def check(cap: Capability, ctx: Mapping[str, Any]) -> tuple[bool, str]:
        return True, why

    return check


@dataclass(frozen=True)
class Impl:
    fn: Optional[Callable[..., Any]]
    eligible: Eligibility
    fallback: Optional[str] = None
    """Backend tried next when this one cannot run here; None only for backends that always run."""
    load: Optional[Callable[[], Callable[..., Any]]] = None
    """Lazy import of ``fn`` (Triton, external packages), run only when this backend is resolved."""

    def resolve_fn(self) -> Callable[..., Any]:
        fn = self.load() if self.load is not None else self.fn
        assert fn is not None, "an Impl needs fn or load"
        return fn


@dataclass(frozen=True)
class OpSpec:
    name: str
    ref: Callable[..., Any]
    """Pure-torch reference twin: the oracle parity tests compare every backend against."""
    impls: Mapping[str, Impl]


@dataclass(frozen=True)
class BackendRecord:
    op: str
    requested: str
    observed: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Resolved:
    record: BackendRecord
    fn: Callable[..., Any]


class BackendMismatchError(RuntimeError):
    """Strict mode: the requested backend cannot run here."""


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    for backend, impl in spec.impls.items():
        if impl.fallback is not None and impl.fallback not in spec.impls:
            raise ValueError(f"op {spec.name!r}: backend {backend!r} falls back to unknown {impl.fallback!r}")
    _REGISTRY[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    _ensure_ops_loaded()
    if name not in _REGISTRY:
        raise ValueError(f"unknown op {name!r}; registered ops: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_ops() -> list[str]:
    _ensure_ops_loaded()
    return sorted(_REGISTRY)


def _ensure_ops_loaded() -> None:
    # Op modules register themselves on import; importing the package pulls all of them in (none imports Triton).
    import kernels  # noqa: F401


@dataclass
class Dispatcher:
    device: torch.device
    strict: bool = False
    capability: Capability = field(init=False)
    _ledger: dict[tuple[str, str], Resolved] = field(init=False, default_factory=dict)
    _forced: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.capability = probe(self.device)

    def resolve(self, op: str, requested: str, **ctx: Any) -> Resolved:
        """Pick the backend for ``op`` once. ``ctx`` carries what eligibility needs (dtype, dims)."""
        spec = get_op(op)
        if requested not in spec.impls:
            raise ValueError(f"op {op!r}: unknown backend {requested!r}; valid backends: {sorted(spec.impls)}")
        key = (op, requested)
        if key in self._ledger and op not in self._forced:
            return self._ledger[key]
        if op in self._forced:
            observed = self._forced[op]
            reason = f"forced to {observed!r} by Dispatcher.force (tests); eligibility not checked"
        else:
            observed, reason = self._walk(spec, requested, ctx)
        resolved = Resolved(BackendRecord(op, requested, observed, reason), spec.impls[observed].resolve_fn())
        self._ledger[key] = resolved
        if self.strict and observed != requested:
            raise BackendMismatchError(f"op {op!r}: requested {requested!r} but {observed!r} would run: {reason}")
        return resolved

    def _walk(self, spec: OpSpec, requested: str, ctx: Mapping[str, Any]) -> tuple[str, str]:
        skipped: list[str] = []
        backend: Optional[str] = requested
        seen: set[str] = set()
        while backend is not None and backend not in seen:
            seen.add(backend)
            impl = spec.impls[backend]
            ok, why = impl.eligible(self.capability, ctx)
            if ok:
                if not skipped:
                    return backend, why
                return backend, "; ".join(skipped) + f" -> ran {backend!r} ({why})"
            skipped.append(f"{backend!r} not eligible on {self.device.type}: {why}")
            backend = impl.fallback
        raise RuntimeError(f"op {spec.name!r}: no eligible backend from {requested!r}: {'; '.join(skipped)}")

    def force(self, op: str, backend: str) -> None:
        """Pin ``op`` to ``backend`` for later resolutions (tests only; the reason records it)."""
        spec = get_op(op)
        if backend not in spec.impls:
            raise ValueError(f"op {op!r}: unknown backend {backend!r}; valid backends: {sorted(spec.impls)}")
        self._forced[op] = backend

    @contextlib.contextmanager
    def forced(self, op: str, backend: str) -> Iterator[None]:
        self.force(op, backend)
        try:
            yield
        finally:
            self._forced.pop(op, None)

    def records(self) -> list[BackendRecord]:
        return [r.record for _, r in sorted(self._ledger.items())]

    def table(self) -> list[dict[str, str]]:
        """The resolved backends as plain dicts: exactly what a receipt stores."""
        return [r.as_dict() for r in self.records()]

    def fallbacks(self) -> list[dict[str, str]]:
        return [r.as_dict() for r in self.records() if r.observed != r.requested]
