"""Durable writes and content hashes: the bottom layer every store builds on.

A write is durable once its data and its name survive a power cut: the file's blocks are
fsynced, and so is the folder entry that names it. Each helper below says which of the two it
makes durable.

Two checksums, for two jobs. Integrity (did these bytes reach the disk whole?) is CRC32C,
computed in hardware (SSE4.2 / ARMv8 CRC instructions, ~10 GB/s a core), while the bytes are
written: `write_stream` checksums each chunk just before its write syscall, while it is in the
CPU's cache, so the data is read from memory once. Identity (is this the same model, the same
data?) stays SHA-256 (`sha256_file`), where a collision would matter."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import crc32c as _crc32c

CHUNK = 4 << 20         # checksummed and written at once: fits the cache, large enough to stream
WRITEBACK = 64 << 20    # write-back is started every this many bytes, not left to the final fsync
DIRECT_ALIGN = 4096     # O_DIRECT: buffer address, file offset and length in whole pages


def fsync_file(path: Path) -> None:
    """Make a written file's contents durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's contents, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def crc32c_bytes(data: bytes) -> str:
    """CRC32C of a small buffer, as hex."""
    return f"{_crc32c.crc32c(data):08x}"


def crc32c_file(path: Path, chunk: int = CHUNK) -> str:
    """CRC32C of a file's contents (for files written by someone else, and for verification)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            crc = _crc32c.crc32c(block, crc)
    return f"{crc:08x}"


def _libc_sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None: without it write-back waits for the fsync."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _libc_sync_file_range()
_START, _WAIT = 2, 1 | 4  # SYNC_FILE_RANGE_WRITE; SYNC_FILE_RANGE_WAIT_BEFORE | _WAIT_AFTER


class _Streamer:
    """Keeps the disk busy while a file is written: after each WRITEBACK bytes, starts the
    write-back of that window and waits for the one before (so at most two windows are dirty,
    and the final fsync has little left to do), then drops the written window from the page
    cache (a checkpoint is not read again by this process; its pages would only push out the
    training's). Only hints: where the kernel refuses them, the fsync still makes it durable."""

    def __init__(self, fd: int):
        self.fd, self.started, self.waited = fd, 0, 0
        self.ok = _sync_file_range is not None

    def wrote(self, upto: int) -> None:
        if not self.ok or upto - self.started < WRITEBACK:
            return
        if _sync_file_range(self.fd, self.started, upto - self.started, _START) != 0:
            self.ok = False  # e.g. a file system that does not support it: the fsync does it all
            return
        if self.started > self.waited:  # the previous window: wait for it, then evict it
            _sync_file_range(self.fd, self.waited, self.started - self.waited, _WAIT | _START)
            os.posix_fadvise(self.fd, self.waited, self.started - self.waited, os.POSIX_FADV_DONTNEED)
            self.waited = self.started
        self.started = upto


def write_stream(path: Path, parts: Iterable[Any]) -> dict[str, Any]:
    """Create `path` from buffers (bytes-like: memoryviews of tensors, bytes), checksum it while
    writing, and make its contents durable. Returns {"bytes": size, "crc32c": hex}; the folder
    entry is the caller's to fsync. No copy is made: each buffer goes from memory to the page
    cache in CHUNK-sized write syscalls."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        crc, size, streamer = 0, 0, _Streamer(fd)
        for part in parts:
            view = memoryview(part).cast("B")
            for at in range(0, len(view), CHUNK):
                chunk = view[at:at + CHUNK]
                crc = _crc32c.crc32c(chunk, crc)  # while the chunk is in cache, just before its write
                _write_all(fd, chunk)
                size += len(chunk)
                streamer.wrote(size)
        os.fsync(fd)  # durability point: every block on disk before a manifest can name the file
        if streamer.ok and size > streamer.waited:
            os.posix_fadvise(fd, streamer.waited, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {"bytes": size, "crc32c": f"{crc:08x}"}


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk):]


def write_image(path: Path, image: memoryview, size: int) -> dict[str, Any]:
    """Create `path` holding the first `size` bytes of `image`, a page-aligned buffer whose length
    is a whole number of pages, with O_DIRECT: the disk reads the bytes from this memory, so
    nothing is copied into the page cache (the copy was most of a persist's CPU time, taken from
    training). The last page is written whole and the file truncated to `size`. Checksummed as
    it is written and durable on return, like write_stream, which it falls back to where the
    file system refuses O_DIRECT (tmpfs) or the buffer is not aligned."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct or len(image) % DIRECT_ALIGN or _address(image) % DIRECT_ALIGN:
        return write_stream(path, [image[:size]])
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | direct, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return write_stream(path, [image[:size]])
    try:
        crc = 0
        for at in range(0, len(image), CHUNK):
            chunk = image[at:at + CHUNK]
            crc = _crc32c.crc32c(chunk[:max(0, size - at)], crc)
            try:
                _write_all(fd, chunk)
            except OSError as e:  # refused at the first write (some FUSE file systems): buffered
                if e.errno != errno.EINVAL or at:
                    raise
                os.close(fd)
                fd = -1
                os.unlink(path)
                return write_stream(path, [image[:size]])
        os.ftruncate(fd, size)  # the padding of the last page goes; its size is metadata the fsync covers
        os.fsync(fd)  # durability point: data (already on the device) and size, before a manifest names it
    finally:
        if fd >= 0:
            os.close(fd)
    return {"bytes": size, "crc32c": f"{crc:08x}"}


def _address(buf: memoryview) -> int:
    """Where a writable buffer's memory starts."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def write_durable(path: Path, text: str) -> None:
    """Replace a small file atomically and durably: temp file, fsync, rename, fsync folder."""
    # Named by process and thread: two threads of one service writing the same file at once (two
    # submits of one recipe) each rename their own.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk: no temp file left behind per try, and the error names the file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if e.filename is None:
            e.filename = str(path)
        raise
    fsync_dir(path.parent)


def open_append(path: Path) -> IO[str]:
    """Open a log for appending; a file created here gets a durable name (fsync of its folder),
    or fsyncing its contents later would keep data that a power cut leaves without a name."""
    new = not path.exists()
    f = open(path, "a")
    if new:
        fsync_dir(path.parent)
    return f


def append_durable(path: Path, text: str) -> None:
    """Append `text` to a log and make it durable before returning."""
    with open_append(path) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
