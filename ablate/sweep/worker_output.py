"""Keep Ray's teardown of an idle worker off the sweep's console.

Ray's workers turn SIGTERM into ``SystemExit`` (``ray._private.worker``'s ``sigterm_handler``). When Ray reclaims a
trial's worker and the signal lands while the interpreter runs a weakref callback, Python cannot raise there and
prints "Exception ignored in ... SystemExit: 1" instead; Ray forwards that to the driver after the sweep's last
progress line (fresh-clone CI, 1 run in 6). It says nothing about the campaign (the worker was done; its receipts
are in), so the driver drops exactly that traceback and forwards everything else a worker prints. The worker's log
file in the Ray session directory keeps it.

Ray exposes no public hook for the lines it forwards, so this wraps the handler ``ray.init`` registers on
``global_worker_stdstream_dispatcher`` under the same name (``ray.shutdown`` removes it by that name).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

_HANDLER = "ray_print_logs"
_OPENS = ("Exception ignored in", "Traceback (most recent call last):")
# The frame Ray's handler raises from; the message is the one ``raise_sys_exit_with_custom_error_message`` gives.
_SIGTERM_FRAME = re.compile(r", in sigterm_handler$")
_LAST = re.compile(r"^SystemExit: 1$")
_MOST_HELD = 400  # lines: a traceback longer than this is passed on as it comes, not held


class TeardownFilter:
    """Per worker (ip, pid, stream): a traceback is held from its first line to its ``SystemExit`` line and dropped
    when Ray's SIGTERM handler raised it; any other traceback, or a held one that ends in another way, is passed
    on whole and in order, under the task or actor name of the batch it started in. A traceback split over two
    batches is held across them; one a worker never finished (killed while printing) is passed on by ``flush``."""

    def __init__(self, forward: Callable[[dict[str, Any]], None]):
        self.forward = forward
        self.held: dict[tuple, tuple[dict[str, Any], list[str]]] = {}
        self.dropped = 0

    def __call__(self, data: dict[str, Any]) -> None:
        lines = data.get("lines")
        if not isinstance(lines, list):
            self.forward(data)
            return
        key = (data.get("ip"), data.get("pid"), data.get("is_err"))
        started, held = self.held.pop(key, (data, None))
        kept: list[str] = []
        for line in lines:
            if held is None:
                if line.startswith(_OPENS):
                    self._send(data, kept)
                    started, held, kept = data, [line], []
                else:
                    kept.append(line)
                continue
            held.append(line)
            if _LAST.match(line) and any(_SIGTERM_FRAME.search(h.rstrip()) for h in held):
                self.dropped += 1
                log.debug("dropped a worker's SIGTERM-at-teardown traceback: %s", held)
                held = None
            elif _ends(line) or len(held) > _MOST_HELD:
                self._send(started, held)
                held = None
        if held is not None:
            self.held[key] = (started, held)
        self._send(data, kept)

    def flush(self) -> None:
        """Pass on what is still held (a worker that stopped mid-traceback), before Ray stops forwarding; a held
        traceback already in Ray's SIGTERM handler is the teardown one, cut short, and is dropped."""
        held, self.held = self.held, {}
        for started, lines in held.values():
            if any(_SIGTERM_FRAME.search(line.rstrip()) for line in lines):
                self.dropped += 1
                continue
            self._send(started, lines)

    def _send(self, data: dict[str, Any], lines: list[str]) -> None:
        if lines:
            self.forward({**data, "lines": lines})


def _ends(line: str) -> bool:
    """A traceback's exception line: unindented, not blank, not a new traceback or chained-exception header."""
    return bool(line) and not line[0].isspace() and not line.startswith(_OPENS) and not line.startswith(
        ("During handling", "The above exception"))


def _dispatcher() -> Any:
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    return global_worker_stdstream_dispatcher


def _installed() -> list[Any]:
    return [handler for name, handler in getattr(_dispatcher(), "handlers", None) or () if name == _HANDLER]


def drop_teardown_tracebacks() -> Optional[TeardownFilter]:
    """Wrap the driver's worker-output handler (after ``ray.init``; again is a no-op). None when Ray forwards no
    worker output here (``log_to_driver=False``) or its dispatcher has changed shape, in which case everything is
    left as Ray has it."""
    current = _installed()
    if len(current) != 1:
        return None
    if isinstance(current[0], TeardownFilter):
        return current[0]
    wrapped = TeardownFilter(current[0])
    _dispatcher().remove_handler(_HANDLER)
    _dispatcher().add_handler(_HANDLER, wrapped)
    return wrapped


def flush_held() -> None:
    """``TeardownFilter.flush`` of the installed filter, if any: call before ``ray.shutdown``."""
    for handler in _installed():
        if isinstance(handler, TeardownFilter):
            handler.flush()
