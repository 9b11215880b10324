"""Receipt payloads already checked and accepted, remembered per user, so reading the same store again skips their
checks.

Why: checking a receipt (schema, re-derived figures, digest) was ~0.8 ms of pure Python (~0.3 ms now), and every
``ablate promote`` reads the whole experiment again: 10,000 receipts were 7 s of a 25 s promotion on two cores, almost
all of them receipts the previous promotion had already checked.

Why it is exact: whether a payload is a valid receipt depends only on its bytes, on the code that checks them and on
the clock. An entry is the sha256 of the exact payload bytes, in a file named by the checking code's fingerprint
(the source of the validator and of the payload reader as they were when the reader was imported, the Python and
pydantic versions): other bytes or other code never hit. Only payloads that are exactly the accepted model's own JSON
are kept (``bulk_read._check_result``), so the reader rebuilds the very model that was checked, and the clock's
check (``schema.in_the_future``) is repeated on every hit. A hit is also checked against its run's tags.

The file lives in the user cache (``ablate.user_cache``: ``$ABLATE_CACHE_DIR``, ``off`` turns it off). Whoever
can write the file decides which payloads skip the checks, so a file (or directory) owned by another user, or
writable by group or others, is ignored; so is a damaged one. A cache that cannot be opened or written only costs
time. New entries are appended, in one write each. Only reads of many runs use the cache
(``bulk_read.CACHE_MIN_RUNS``): opening it reads all of it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from ablate.user_cache import CACHE_ENV, OFF, cache_dir  # noqa: F401 - CACHE_ENV, OFF: part of this module's API
from ablate.user_cache import private as _private
from ablate.user_cache import trusted as _trusted

_MAGIC = b"ablate-accepted-receipts 1\n"
_DIGEST_BYTES = 32
_CHECKING_CODE = ("ablate/receipts/schema.py", "ablate/receipts/derive.py", "ablate/receipts/store.py",
                  "ablate/tracking/payload.py", "ablate/tracking/bulk_read.py")
"""What decides whether a payload is accepted: the validator, the derivations it re-computes, the digest check,
the payload decoder and the parse in the reader."""
_ROOT = Path(__file__).resolve().parents[2]


def checking_fingerprint(root: Path = _ROOT) -> str:
    """The fingerprint of the checking code under ``root``. Taken once, when the reader is imported
    (``bulk_read.CHECKING_FINGERPRINT``): a long-running driver whose checkout is edited meanwhile keeps writing
    under the code it runs, never under the new code's name."""
    import pydantic
    import pydantic_core

    digest = hashlib.sha256()
    for name in _CHECKING_CODE:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    for version in (sys.version, pydantic.VERSION, pydantic_core.__version__):
        digest.update(version.encode() + b"\0")
    return digest.hexdigest()[:20]


def payload_key(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class AcceptedPayloads:
    """The keys (``payload_key``) of payloads accepted under one checking code; ``add`` then ``save``."""

    def __init__(self, path: Optional[Path], read: bool = True) -> None:
        """``read`` off: only ``add`` and ``save`` (a writer), without holding every key the file has (~100 bytes of
        memory each, for the life of a sweep); a key it adds again is appended again, which a reader's set drops."""
        self.path = path
        self._known = _read(path)[0] if path is not None and read else set()
        self._new: set[bytes] = set()

    @classmethod
    def open(cls, fingerprint: Optional[str], read: bool = True) -> "AcceptedPayloads":
        """The cache of the code with ``fingerprint``; a disabled one when it is off, when there is no fingerprint
        (the checking code's source is not installed) or no cache directory (no home)."""
        try:
            directory = cache_dir()
        except (RuntimeError, OSError):  # Path.home() without HOME and without a passwd entry
            directory = None
        if directory is None or fingerprint is None:
            return cls(None)
        return cls(directory / f"accepted-{fingerprint}.bin", read=read)

    @property
    def empty(self) -> bool:
        """Nothing remembered: every payload will be checked in full."""
        return not self._known

    def __contains__(self, key: bytes) -> bool:
        return key in self._known

    def add(self, keys: Iterable[bytes]) -> None:
        self._new.update(key for key in keys if key not in self._known)

    def save(self) -> None:
        """Appends the new keys in one write; a missing file is created whole, a damaged or misaligned one written
        anew (atomically: a reader never sees half a file)."""
        if self.path is None or not self._new:
            return
        new = b"".join(sorted(self._new))
        try:  # all of it: a cache directory this user cannot reach (another user's home) costs time, never a sweep
            if self.path.parent.exists() and not _private(self.path.parent):
                return  # never read from such a directory: writing there would only rewrite the file on every read
            if not self.path.exists() and _create(self.path, new):
                _prune(self.path)
                self._saved()
                return
            if _appendable(self.path):
                descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                try:
                    os.write(descriptor, new)
                finally:
                    os.close(descriptor)
            else:
                _write_new(self.path, b"".join(sorted(_read(self.path)[0])) + new)
                _prune(self.path)
        except OSError:  # read-only, full or unreachable cache directory: the next read checks these again
            return
        self._saved()

    def _saved(self) -> None:
        self._known |= self._new
        self._new = set()


KEEP_OTHER_FILES = 4
"""Files of other checking code kept beside the current one (the most recently written): an edited checkout makes a
new fingerprint each time, and an old file is only useful to code that may come back (a switched branch)."""


def _prune(current: Path) -> None:
    others = sorted((p for p in current.parent.glob("accepted-*.bin") if p != current),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in others[KEEP_OTHER_FILES:]:
        stale.unlink(missing_ok=True)


def _read(path: Path) -> tuple[set[bytes], bool]:
    """(keys, whether new keys may be appended): nothing from a file that is missing, not ours, damaged or of
    another format; a torn last entry (an interrupted append) is left out and the file is rewritten on the next
    save."""
    try:
        if not _trusted(path):
            return set(), False
        data = path.read_bytes()
    except OSError:
        return set(), False
    if not data.startswith(_MAGIC):
        return set(), False
    body = data[len(_MAGIC):]
    whole = len(body) - len(body) % _DIGEST_BYTES
    return {body[i:i + _DIGEST_BYTES] for i in range(0, whole, _DIGEST_BYTES)}, whole == len(body)


def _appendable(path: Path) -> bool:
    """Ours, of this format and whole (a torn last entry would misalign every key appended after it), from its
    header and size alone: a writer need not read every key."""
    try:
        if not _trusted(path):
            return False
        with path.open("rb") as handle:
            head = handle.read(len(_MAGIC))
            size = os.fstat(handle.fileno()).st_size
    except OSError:
        return False
    return head == _MAGIC and (size - len(_MAGIC)) % _DIGEST_BYTES == 0


def _write_new(path: Path, body: bytes, replace: bool = True) -> bool:
    """``path`` holds ``body`` whole, or (``replace`` off) False when another writer made ``path`` first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=".accepted-", delete=False)  # mode 0600
    try:
        with handle:
            handle.write(_MAGIC + body)
        if replace:
            os.replace(handle.name, path)
        else:
            try:
                os.link(handle.name, path)
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links (some network and FUSE ones): the race stays open
                os.replace(handle.name, path)
        return True
    finally:
        if os.path.exists(handle.name):  # replaced (or linked: this name is the file's second one), or an error
            os.unlink(handle.name)


def _create(path: Path, body: bytes) -> bool:
    """A new file with ``body``; False when another writer created it first (two sweeps closing at once, or a
    sweep and a promotion), whose keys replacing it would lose: those are then appended to instead."""
    return _write_new(path, body, replace=False)
