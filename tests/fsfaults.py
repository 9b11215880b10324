"""Real filesystem faults for tests (imported by name: tests/ is on sys.path via conftest).

Where the test machine allows it (root with the right to mount: the CI container and the dev box), a fault is a
real tiny ``tmpfs``, filled to its last byte (``ENOSPC``) or remounted read-only (``EROFS``). Elsewhere a test
either uses ``chmod`` (a read-only directory for a non-root user) or injects the errno at the write call
(``inject_errno``); ``fault_dir`` picks what the machine supports and says which.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@functools.lru_cache(maxsize=1)
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN, not in a locked-down container)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    probe = Path(tempfile.mkdtemp(prefix="ablate-tmpfs-probe-"))
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                                 capture_output=True).returncode == 0
        if mounted:
            subprocess.run(["umount", str(probe)], capture_output=True)
        return mounted
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


@contextlib.contextmanager
def tmpfs(path: Path, size_kb: int = 512) -> Iterator[Path]:
    """A real, size-limited tmpfs mounted at ``path`` for the duration."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill the filesystem holding ``directory`` to its last byte; returns the filler file."""
    filler = directory / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        block = b"\0" * 4096
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                if len(block) == 1:
                    break
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    return filler


def remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def inject_errno(monkeypatch: pytest.MonkeyPatch, under: Path, code: int = errno.ENOSPC) -> None:
    """Make ``os.write`` and ``os.fsync`` on files under ``under`` fail with ``code``, as a full disk does (a
    buffered write reaches the disk, and reports ENOSPC, at its flush/fsync)."""
    real_write, real_fsync = os.write, os.fsync
    root = str(under.resolve())

    def target(fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def write(fd: int, data: bytes) -> int:  # type: ignore[override]
        if target(fd).startswith(root):
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    def fsync(fd: int) -> None:
        if target(fd).startswith(root):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)


@contextlib.contextmanager
def fault_dir(kind: str, base: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """(a directory that refuses writes as ``kind`` says, how): "full" (ENOSPC) or "read-only" (EROFS/EACCES).
    A real tmpfs where the machine allows mounting; else chmod (read-only, non-root) or an injected ENOSPC."""
    target = base / "mnt"
    if can_mount():
        with tmpfs(target, size_kb=256):
            (target / "receipts").mkdir()
            if kind == "full":
                fill(target)
            else:
                remount_read_only(target)
            yield target, "tmpfs"
        return
    target.mkdir(parents=True)
    (target / "receipts").mkdir()
    if kind == "read-only" and os.geteuid() != 0:
        for path in (target / "receipts", target):
            path.chmod(0o555)
        try:
            yield target, "chmod"
        finally:
            for path in (target, target / "receipts"):
                path.chmod(0o755)
        return
    if kind == "read-only":
        pytest.skip("root without mount rights: no real read-only directory to test against")
    inject_errno(monkeypatch, target)
    yield target, "injected"
