"""Compile posture (eager | regional | whole) and what the compiler actually did. The warmup rule that decides
whether explicit warmup steps run is torch-free, in ``ablate.config.warmup``.

How to use::

    watch = CompileWatch()                      # install before the first compiled call
    regions = compile_regions(model, blocks, backend="inductor")   # regional posture
    ... steps ...; watch.events_since(mark)     # per-step compile events (also lazy backward compiles)
    watch.record(...)                           # the receipt's observed.compile block

Compile time is labelled from dynamo's compile callbacks (``torch._dynamo.callback``), which bracket compiles
even inside a training step, so a recompile in the steady state is seen as such instead of guessed from a
step index. ``torch._dynamo.utils.counters`` and ``get_compilation_metrics`` are private but long-lived; every
use is guarded and a missing API is written as null, never 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ablate.config.warmup import WarmupDecision


def _replace_module(root: nn.Module, target: nn.Module, new: nn.Module) -> bool:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is target:
                setattr(parent, name, new)
                return True
    return False


def compile_regions(model: nn.Module, blocks: Iterable[tuple[str, nn.Module]], backend: str,
                    fullgraph: bool = True) -> list[tuple[str, nn.Module]]:
    """Regional posture: swap every block for ``torch.compile(block, fullgraph=...)`` in its parent.

    A wrapper (not ``block.compile()`` in place) keeps module hooks outside the compiled region: family-share
    hooks on the wrapper run eagerly and neither break the graph nor add a guard. Returns (letter, wrapper).
    """
    regions = []
    for letter, block in list(blocks):
        wrapped = torch.compile(block, backend=backend, fullgraph=fullgraph)
        if not _replace_module(model, block, wrapped):
            raise RuntimeError(f"regional compile: block {type(block).__name__} ({letter}) has no parent module "
                               "in the model; the model must hold its blocks as submodules")
        regions.append((letter, wrapped))
    return regions


def _counters() -> Optional[Any]:
    try:
        from torch._dynamo.utils import counters

        return counters
    except Exception:  # noqa: BLE001 - private API; absent -> null fields
        return None


def _metrics() -> Optional[list[Any]]:
    try:
        from torch._dynamo.utils import get_compilation_metrics

        return list(get_compilation_metrics())
    except Exception:  # noqa: BLE001
        return None


@dataclass
class CounterSnapshot:
    unique_graphs: Optional[int]
    graph_breaks: dict[str, int]
    cache_hits: Optional[int]
    cache_misses: Optional[int]
    num_metrics: Optional[int]


def snapshot() -> CounterSnapshot:
    counters = _counters()
    metrics = _metrics()
    if counters is None:
        return CounterSnapshot(None, {}, None, None, len(metrics) if metrics is not None else None)
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return CounterSnapshot(int(counters["stats"]["unique_graphs"]), dict(counters["graph_break"]), int(hits),
                           int(misses), len(metrics) if metrics is not None else None)


class CompileWatch:
    """Counts dynamo compile events (with their duration) through the compile callbacks."""

    def __init__(self) -> None:
        self.events = 0
        self.seconds = 0.0
        self._open: Optional[float] = None
        self.available = False
        self._handler: Any = None
        try:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._on_start)
            callback_handler.register_end_callback(self._on_end)
            self._handler = callback_handler
            self.available = True
        except Exception:  # noqa: BLE001 - private API; without it steps are never compile-tagged
            pass
        self.start = snapshot()

    def _on_start(self, args: Any) -> None:
        self.events += 1
        self._open = time.perf_counter()

    def _on_end(self, args: Any) -> None:
        if self._open is not None:
            self.seconds += time.perf_counter() - self._open
            self._open = None

    def close(self) -> None:
        if self._handler is not None:
            try:
                self._handler.remove_start_callback(self._on_start)
                self._handler.remove_end_callback(self._on_end)
            except ValueError:
                pass
            self._handler = None

    def record(self, posture: str, decision: WarmupDecision, steady_events: Optional[int],
               observed_posture: Optional[str] = None) -> dict[str, Any]:
        """The receipt's CompileRecord fields, as diffs since this watch was created."""
        end = snapshot()
        start = self.start
        breaks = {k: v - start.graph_breaks.get(k, 0) for k, v in end.graph_breaks.items()
                  if v - start.graph_breaks.get(k, 0) > 0}
        metrics = _metrics()
        recompiles: Optional[int] = None
        reasons: list[str] = []
        if metrics is not None and start.num_metrics is not None:
            new = metrics[start.num_metrics:]
            reasons = [str(m.recompile_reason) for m in new if getattr(m, "recompile_reason", None)]
            recompiles = len(reasons)

        def diff(a: Optional[int], b: Optional[int]) -> Optional[int]:
            return None if a is None or b is None else a - b

        unique_graphs = diff(end.unique_graphs, start.unique_graphs)
        if observed_posture is None:
            observed_posture = posture if posture == "eager" or (unique_graphs or 0) > 0 else "eager"
        return {
            "posture_requested": posture,
            "posture_observed": observed_posture,
            "warmup_requested": decision.requested,
            "warmup_resolved": decision.resolved,
            "warmup_reason": decision.reason,
            "unique_graphs": unique_graphs,
            "graph_breaks": sum(breaks.values()) if end.unique_graphs is not None else None,
            "graph_break_reasons": [f"{count}x {reason[:300]}" for reason, count in breaks.items()],
            "recompiles": recompiles,
            "recompile_reasons": reasons[:20],
            "recompiles_in_steady_state": steady_events if self.available else None,
            "compile_time_s": self.seconds if self.available else None,
            "cache_hits": diff(end.cache_hits, start.cache_hits),
            "cache_misses": diff(end.cache_misses, start.cache_misses),
        }


def is_graph_break_error(exc: BaseException) -> bool:
    """fullgraph=True turns a graph break into an exception; it is still a GRAPH_BREAK, not a mystery failure."""
    try:
        from torch._dynamo.exc import Unsupported
    except Exception:  # noqa: BLE001
        return False
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, Unsupported):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
