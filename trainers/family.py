"""Family time share: the fraction of step time spent in A, E, M and R blocks, sampled on a few steps.

How to use::

    sampler = FamilySampler(regions, cuda=False, whole_compiled=False)
    with sampler.sampling():           # hooks exist only inside this block, i.e. on sampled steps
        step()
    sampler.add_step(step_s)
    sampler.shares(letters="AEMR")     # {"A": 0.21, "E": 0.34, "M": 0.28, "R": 0.09}; absent families -> None

Forward pre/post hooks time each block's forward; gradient hooks on the block's outputs (backward can start)
and inputs (backward is done) time its backward. Module full-backward hooks are not used: they do not fire on a
``torch.compile`` wrapper, while gradient hooks work the same under eager and compiled regions. The share is
Σ block time / Σ sampled step time, so embedding, head, loss and optimizer are the remainder. Hooks go on the
module that is actually called: the compiled wrapper under regional compile (so they run eagerly and never
enter a graph), the block itself under eager. Under whole-model compile the blocks live inside one graph,
so sampled steps run with ``torch.compiler.set_stance("force_eager")`` and the share is an eager proxy
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


class FamilySampler:
    def __init__(self, regions: list[tuple[str, nn.Module]], cuda: bool, whole_compiled: bool) -> None:
        self.regions = regions
        self.cuda = cuda
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
        return time.perf_counter()

    def _hooks(self, letter: str, module: nn.Module) -> list[Any]:
        # A window is [letter, fwd_start, fwd_end, bwd_start, bwd_end]; lists and one gradient hook per side keep
        # the sampled step's own cost small (each tensor hook is a Python call from the autograd engine).
        open_windows: list[list[Any]] = []

        def stamp(window: list[Any], slot: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                window[slot] = self._now()

            return hook

        def fwd_pre(mod: nn.Module, args: Any) -> None:
            window: list[Any] = [letter, None, None, None, None]
            self._windows.append(window)
            first = _first_grad_tensor(args)
            if first is not None:
                first.register_hook(stamp(window, 4))      # grad of an input: the block's backward is done
            open_windows.append(window)
            window[1] = self._now()

        def fwd_post(mod: nn.Module, args: Any, out: Any) -> None:
            if not open_windows:
                return
            window = open_windows.pop()
            window[2] = self._now()
            first = _first_grad_tensor(out)
            if first is not None:
                first.register_hook(stamp(window, 3))      # grad of the main output: its backward starts

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
        for letter, *stamps in self._windows:
            for start, stop in ((stamps[0], stamps[1]), (stamps[2], stamps[3])):
                if start is not None and stop is not None:
                    elapsed = start.elapsed_time(stop) / 1000.0 if self.cuda else stop - start
                    self.family_s[letter] += max(0.0, elapsed)
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


def _first_grad_tensor(value: Any) -> Optional[torch.Tensor]:
    """The first tensor taking part in autograd in a block's (nested) inputs or outputs, in order.

    Blocks take and return (stream, delta[, extras]); stream and delta reach the next block together, so one
    gradient hook per side marks the block's backward boundaries.
    """
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None
