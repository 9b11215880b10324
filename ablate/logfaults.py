"""A full or read-only disk in one line per record: Ray Tune and MLflow log a traceback per failed write (trial
checkpoints, Tune's state, every SQLite insert), a cascade that buries the one thing to act on.

How to use: ``logging.getLogger(name).addFilter(DiskFaultLines())`` on the loggers that do it (the sweep driver
for Tune's and MLflow's, ``ablate.tracking.writer``'s child for MLflow's); the sweep's summary then says where the
receipts are.
"""

from __future__ import annotations

import logging

DISK_FAULTS = ("No space left on device", "database or disk is full", "Read-only file system", "Disk quota exceeded")


class DiskFaultLines(logging.Filter):
    """A record whose message or exception names a disk fault becomes its first line plus the fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += "\n" + str(record.exc_info[1])
        fault = next((f for f in DISK_FAULTS if f in text), None)
        if fault is not None:
            first = text.strip().splitlines()[0] if text.strip() else ""
            record.msg, record.args = f"{first[:300]} ({fault})", None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True
