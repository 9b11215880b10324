"""Family time share: the fraction of step time spent in A, E, M and R blocks, sampled on a few steps.

How to use::

    sampler = FamilySampler(regions, cuda=False, whole_compiled=False)
    with sampler.sampling():           # hooks exist only inside this block, i.e. on sampled steps
        step()
    sampler.add_step(step_s)
    sampler.shares(letters="AEMR")     # {"A": 0.21, "E": 0.34, "M": 0.28, "R": 0.09}; absent families -> None

A block's forward is timed from its forward pre-hook to its forward hook. Its backward window opens when the last
gradient from outside reaches its outputs and closes when it has handed the last gradient back to its inputs. Both
ends are read from gradient hooks on *marker views*: the pre-hook swaps every differentiable input for a view
(the block consumes only the views, so a view's gradient is complete exactly when the block has finished with it)
and the forward hook swaps every differentiable output for a view (only the code after the block consumes those,
so a view's gradient is complete exactly when the rest of the model has handed it back). Hooks on the block's own
tensors would be wrong: a block returns ``(stream, delta, ...)`` where ``stream = stream_in + delta_in`` is also
read by its own norm, so a hook on ``stream`` fires only after the block's whole mixer backward, and a hook on
``stream_in`` only after the *previous* block's mixer backward; that shifted every block's backward onto its
successor (the last block's was lost). Measured on an AEME model with the sequential SSD: M was 0.21 of the step
by those hooks, is 0.70 by these, and 0.77 by taking M's blocks out of the model.

The window opens at the *last* output gradient: an output consumed only far downstream (the MoE aux loss, read
by the loss itself) gets its gradient at the start of the whole backward, long before the block can start. The
hooks fire in time order (on CUDA they record events on the stream in that order), so "last" is "the most
recent call". The share is Σ block time / Σ sampled step time, so embedding, head, loss and optimizer are the
remainder. A view costs no copy, and Dynamo does not recompile for it (same sizes, strides and dtype).

What no block window sees: the autograd engine's per-node work outside the blocks' own backward (the dependency
pass over the whole graph before the first backward node runs, and freeing the graph after the step), ~1 us per
node on CPU. It only matters for a family that records thousands of tiny nodes, e.g. the sequential SSD reference
(one set per time step): there it is the 0.70 vs 0.77 above, so that family's Amdahl bound is conservative. A
compiled region is one node, and on CUDA this is host work that can overlap queued kernels.

Hooks go on the module that is actually called: the compiled wrapper under regional compile (so they run
eagerly and never enter a graph), the block itself under eager. Under whole-model compile the blocks live inside
one graph, so sampled steps run with ``torch.compiler.set_stance("force_eager")`` and the share is an eager proxy
(``method`` says so). On CUDA the hooks record events and the step synchronises once at its end; sampled steps
are excluded from the steady statistics anyway.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ablate.receipts.schema import FAMILIES

_FWD_START, _FWD_END, _BWD_START, _BWD_END = 1, 2, 3, 4


class FamilySampler:
    def __init__(self, regions: list[tuple[str, nn.Module]], cuda: bool, whole_compiled: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` times CPU steps (wall time; tests on a shared host pass a thread CPU clock); CUDA uses events."""
        self.regions = regions
        self.cuda = cuda
        self.clock = clock
        self.whole_compiled = whole_compiled
        self.method = "eager_proxy" if whole_compiled else "hooks"
        self.family_s: dict[str, float] = {letter: 0.0 for letter in FAMILIES}
        self.step_s = 0.0
        self.sampled_steps = 0
        self._windows: list[list[Any]] = []

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def _hooks(self, letter: str, module: nn.Module) -> list[Any]:
        # A window is [letter, fwd_start, fwd_end, bwd_start, bwd_end]; plain lists and one gradient hook per
        # marked tensor keep the sampled step's own cost small (each is a Python call from the autograd engine).
        open_windows: list[list[Any]] = []

        def stamp(window: list[Any], slot: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                window[slot] = self._now()  # the last call wins: it is the latest gradient to cross the boundary

            return hook

        def fwd_pre(mod: nn.Module, args: Any) -> Any:
            window: list[Any] = [letter, None, None, None, None]
            self._windows.append(window)
            open_windows.append(window)
            marked = _mark(args, stamp(window, _BWD_END))
            window[_FWD_START] = self._now()
            return marked

        def fwd_post(mod: nn.Module, args: Any, out: Any) -> Any:
            if not open_windows:
                return None
            window = open_windows.pop()
            window[_FWD_END] = self._now()
            return _mark(out, stamp(window, _BWD_START))

        return [module.register_forward_pre_hook(fwd_pre), module.register_forward_hook(fwd_post)]

    @contextmanager
    def sampling(self) -> Iterator[None]:
        handles: list[Any] = []
        with ExitStack() as stack:
            if self.whole_compiled:
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            for letter, module in self.regions:
                handles.extend(self._hooks(letter, module))
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()
        if self.cuda:
            torch.cuda.synchronize()
        for window in self._windows:
            for start, stop in ((window[_FWD_START], window[_FWD_END]), (window[_BWD_START], window[_BWD_END])):
                if start is not None and stop is not None:
                    elapsed = start.elapsed_time(stop) / 1000.0 if self.cuda else stop - start
                    self.family_s[window[0]] += max(0.0, elapsed)
        self._windows.clear()

    def add_step(self, step_s: float) -> None:
        self.step_s += step_s
        self.sampled_steps += 1

    def shares(self, letters: str) -> dict[str, Optional[float]]:
        """Fraction of sampled step time per family; None for families absent from the pattern or unsampled."""
        out: dict[str, Optional[float]] = {}
        for letter in FAMILIES:
            if letter not in letters or self.sampled_steps == 0 or self.step_s <= 0:
                out[letter] = None
            else:
                out[letter] = min(1.0, self.family_s.get(letter, 0.0) / self.step_s)
        return out


def _mark(value: Any, hook: Callable[[torch.Tensor], None]) -> Any:
    """``value`` with every differentiable tensor (nested in tuples/lists) replaced by a hooked view of itself.

    Only the code on the far side of the boundary sees the views, so each view's gradient hook fires when that
    side is done with it. Non-differentiable values (the MoE counts, a zero initial stream) pass through.
    """
    if isinstance(value, torch.Tensor):
        if not value.requires_grad:
            return value
        view = value.view_as(value)
        view.register_hook(hook)
        return view
    if isinstance(value, (tuple, list)):
        items = [_mark(item, hook) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
