"""A FUSE pass-through file system that can simulate a power cut.

SIGKILL leaves the kernel's page cache intact, so a missing fsync goes unnoticed after it. This
layer keeps, beside the live tree, the state a disk would hold after a power cut, under the
strictest reading of POSIX:

- a file's contents become durable only when the file is fsynced (the contents at that moment);
- a folder's entries (creations, renames, deletions) become durable only when the folder itself
  is fsynced; an entry refers to an inode, so a renamed folder keeps its own durable entries;
- a file whose entry is durable but whose data never was comes back empty.

When unmounted, the layer replaces the live tree with that durable image: the next mount sees
what the machine would see after the cut. Run `python tests/powercut_fs.py BACKING MOUNTPOINT`
(foreground; needs /dev/fuse, Debian's `fuse` and the `fusepy` binding).
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import stat
import sys
from pathlib import Path

from fuse import FUSE, FuseOSError, Operations


class PowerCutFS(Operations):
    def __init__(self, backing: str):
        self.root = os.path.realpath(backing)
        self.blobs = Path(f"{self.root}.durable")  # durable file contents, one per inode
        shutil.rmtree(self.blobs, ignore_errors=True)
        self.blobs.mkdir()
        self.counter = itertools.count(1)
        self.ids: dict[int, int] = {}  # backing st_ino -> our inode id (st_ino may be reused)
        self.entries: dict[int, dict[str, int]] = {}  # durable folder entries, by folder id
        self.is_dir: dict[int, bool] = {}
        self.root_id = self._id(self.root)
        # Everything present at mount time is durable.
        for folder, dirs, files in os.walk(self.root):
            self._sync_dir(folder)
            for name in files:
                self._sync_file(os.path.join(folder, name))

    # -- the durability model ------------------------------------------------------------------
    def _id(self, full: str, st: os.stat_result | None = None) -> int:
        st = st or os.lstat(full)
        if st.st_ino not in self.ids:
            self.ids[st.st_ino] = next(self.counter)
        ident = self.ids[st.st_ino]
        self.is_dir[ident] = stat.S_ISDIR(st.st_mode)
        return ident

    def _forget(self, full: str) -> None:
        """`full` is about to lose its last name: a new file may get its st_ino."""
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1:
            self.ids.pop(st.st_ino, None)

    def _sync_file(self, full: str, fh: int | None = None) -> None:
        st = os.fstat(fh) if fh is not None else os.lstat(full)
        ident = self._id(full, st)
        tmp = self.blobs / f"{ident}.tmp"
        with open(full if fh is None else f"/proc/self/fd/{fh}", "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, self.blobs / str(ident))

    def _sync_dir(self, full: str) -> None:
        self.entries[self._id(full)] = {name: self._id(os.path.join(full, name))
                                        for name in os.listdir(full)}

    def cut(self) -> None:
        """Replace the live tree with what the disk holds durably."""
        image = f"{self.root}.image"
        shutil.rmtree(image, ignore_errors=True)
        self._rebuild(self.root_id, image)
        shutil.rmtree(self.root)
        os.rename(image, self.root)
        shutil.rmtree(self.blobs)

    def _rebuild(self, ident: int, dest: str) -> None:
        os.mkdir(dest)
        for name, child in self.entries.get(ident, {}).items():
            target = os.path.join(dest, name)
            if self.is_dir.get(child):
                self._rebuild(child, target)
            elif (self.blobs / str(child)).exists():
                shutil.copyfile(self.blobs / str(child), target)
            else:
                open(target, "wb").close()  # the name was durable, the data never was

    # -- pass-through operations ---------------------------------------------------------------
    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def __call__(self, op, path, *args):
        try:
            return super().__call__(op, path, *args)
        except OSError as e:
            if isinstance(e, FuseOSError):
                raise
            raise FuseOSError(e.errno or errno.EIO) from None

    def access(self, path, mode):
        if not os.access(self._full(path), mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                            "st_nlink", "st_size", "st_uid", "st_blocks")}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._full(path))]

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                            "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def chmod(self, path, mode):
        os.chmod(self._full(path), mode)

    def chown(self, path, uid, gid):
        os.chown(self._full(path), uid, gid)

    def utimens(self, path, times=None):
        os.utime(self._full(path), times)

    def mkdir(self, path, mode):
        os.mkdir(self._full(path), mode)

    def rmdir(self, path):
        self._forget(self._full(path))
        os.rmdir(self._full(path))

    def unlink(self, path):
        self._forget(self._full(path))
        os.unlink(self._full(path))

    def rename(self, old, new):
        self._forget(self._full(new))
        os.rename(self._full(old), self._full(new))

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)

    def open(self, path, flags):
        return os.open(self._full(path), flags)

    def create(self, path, mode, fi=None):
        return os.open(self._full(path), os.O_RDWR | os.O_CREAT, mode)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        pass  # close() is not a durability point

    def release(self, path, fh):
        os.close(fh)

    def fsync(self, path, datasync, fh):
        self._sync_file(self._full(path), fh)

    def opendir(self, path):
        return 0

    def releasedir(self, path, fh):
        pass

    def fsyncdir(self, path, datasync, fh):
        self._sync_dir(self._full(path))

    def destroy(self, path):
        self.cut()


def main() -> None:
    backing, mountpoint = sys.argv[1:3]
    # hard_remove: a name renamed over or unlinked while open goes at once, as on a disk file
    # system (libfuse otherwise hides it, and answers EBUSY when it cannot).
    FUSE(PowerCutFS(backing), mountpoint, foreground=True, nothreads=True, hard_remove=True)


if __name__ == "__main__":
    main()
