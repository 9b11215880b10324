"""One dispatcher: each op is resolved once per context, requested -> observed backend, and the reason is written down.

How to use::

    from kernels.dispatch import Dispatcher
    d = Dispatcher(torch.device("cpu"), strict=False, compile_posture="regional")
    moe_fn = d.resolve("moe", "grouped_mm", dtype=torch.float32, dims=(256, 512)).fn
    d.table()      # [{"op": "moe", "requested": "grouped_mm", "observed": "jagged", "reason": "..."}]
    d.fallbacks()  # the rows where observed != requested: a receipt disqualifier

Each op module registers an ``OpSpec`` at import: its pure-torch reference (the parity oracle) and its backends,
each with an eligibility check and the backend to fall back to. Resolution walks that chain from the requested
backend and records every step it skipped, so "fused on" silently running the fallback is visible in the
receipt. ``strict=True`` (benchmarks, GPU lanes that must not fall back) raises instead of running the fallback,
on every resolution that would fall back, not only the first. Results are cached per (op, requested, context):
eligibility reads the context (``dims``, ``dtype``, ...), so one answer is never reused for another context.

``compile_posture`` says whether the ops will run inside a compiled graph (``regional``/``whole``) or not
(``eager``). A backend whose code defers to another backend while Dynamo traces it declares so
(``Impl.traced_as``), and under a compiling posture the record names the backend that really runs, and ``fn`` is
that backend's function, so every row of ``table()`` says what executes. Audit of the registered backends: only
``add_rmsnorm``'s ``compiled`` defers (to ``eager``); the Triton and CPU expert ops are custom ops that stay
opaque in a graph, and the ``is_compiling()`` branches in ``kernels.ssd`` swap eager-only workspaces for
functional forms of the same chunked algorithm.

Tests pin a backend with ``Dispatcher.force`` / ``Dispatcher.forced`` (bypasses eligibility; the reason says so;
the context manager leaves later resolutions unforced).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from kernels.capability import Capability, probe

COMPILE_POSTURES = ("eager", "regional", "whole")
"""Where ops run: outside any compiled graph, inside per-block compiled regions, inside one whole-model graph."""

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
    traced_as: Optional[tuple[str, str]] = None
    """(backend, why) when this backend's code runs another backend's while Dynamo traces it; under a compiling
    posture that backend is what runs, so resolution records it (and hands out its function) instead."""

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
        if impl.traced_as is not None and impl.traced_as[0] not in spec.impls:
            raise ValueError(f"op {spec.name!r}: backend {backend!r} is traced as unknown {impl.traced_as[0]!r}")
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
    compile_posture: str = "eager"
    """eager | regional | whole: whether ops will run inside a compiled graph (``lane.compile.posture``)."""
    capability: Capability = field(init=False)
    _ledger: dict[tuple[Any, ...], Resolved] = field(init=False, default_factory=dict)
    _forced: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        posture = getattr(self.compile_posture, "value", self.compile_posture)
        if posture not in COMPILE_POSTURES:
            raise ValueError(f"Dispatcher compile_posture: got {posture!r}; allowed: {', '.join(COMPILE_POSTURES)}")
        self.compile_posture = posture
        self.capability = probe(self.device)

    def resolve(self, op: str, requested: str, **ctx: Any) -> Resolved:
        """Pick the backend for ``op`` once per context. ``ctx`` carries what eligibility needs (dtype, dims)."""
        spec = get_op(op)
        if requested not in spec.impls:
            raise ValueError(f"op {op!r}: unknown backend {requested!r}; valid backends: {sorted(spec.impls)}")
        forced = self._forced.get(op)
        key = (op, requested, forced, _freeze(ctx))
        resolved = self._ledger.get(key)
        if resolved is None:
            if forced is not None:
                observed, reason = forced, f"forced to {forced!r} by Dispatcher.force (tests); eligibility not checked"
            else:
                observed, reason = self._walk(spec, requested, ctx)
            observed, reason = self._as_traced(spec, observed, reason)
            resolved = Resolved(BackendRecord(op, requested, observed, reason), spec.impls[observed].resolve_fn())
            # Recorded even when strict refuses it below, so a receipt can show why the arm stopped.
            self._ledger[key] = resolved
        if self.strict and resolved.record.observed != requested:
            raise BackendMismatchError(f"op {op!r}: requested {requested!r} but {resolved.record.observed!r} "
                                       f"would run: {resolved.record.reason}")
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

    def _as_traced(self, spec: OpSpec, observed: str, reason: str) -> tuple[str, str]:
        traced = spec.impls[observed].traced_as
        if self.compile_posture == "eager" or traced is None:
            return observed, reason
        backend, why = traced
        posture = self.compile_posture
        return backend, f"{reason}; compile posture {posture}, so not {observed!r}: {why} -> ran {backend!r}"

    def force(self, op: str, backend: str) -> None:
        """Pin ``op`` to ``backend`` for later resolutions (tests only; the reason records it)."""
        spec = get_op(op)
        if backend not in spec.impls:
            raise ValueError(f"op {op!r}: unknown backend {backend!r}; valid backends: {sorted(spec.impls)}")
        self._forced[op] = backend

    @contextlib.contextmanager
    def forced(self, op: str, backend: str) -> Iterator[None]:
        """``force`` for the body only; afterwards resolutions see the previous pin (usually none) again."""
        previous = self._forced.get(op)
        self.force(op, backend)
        try:
            yield
        finally:
            if previous is None:
                self._forced.pop(op, None)
            else:
                self._forced[op] = previous

    def records(self) -> list[BackendRecord]:
        """Every distinct resolution handed out, by op and requested backend (then first use)."""
        unique = list(dict.fromkeys(r.record for r in self._ledger.values()))
        return sorted(unique, key=lambda record: (record.op, record.requested))

    def table(self) -> list[dict[str, str]]:
        """The resolved backends as plain dicts: exactly what a receipt stores."""
        return [r.as_dict() for r in self.records()]

    def fallbacks(self) -> list[dict[str, str]]:
        return [r.as_dict() for r in self.records() if r.observed != r.requested]


def _freeze(value: Any) -> Any:
    """A hashable, order-independent stand-in for a resolution context (dims lists become tuples)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
