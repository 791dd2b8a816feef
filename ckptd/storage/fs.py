"""Shared-filesystem backend (NFS, Lustre, NVMe-oF mounts): ``file:///mnt/shared/ckpt``.

Every object is written under a temporary name in its final directory, fsynced, renamed
into place, and the directory fsynced, so a reader (or a node that crashes half-way)
never sees a partial file under a real name. The conditional write uses ``link()``,
which is atomic and fails on an existing name, NFS included. Multipart uploads are a
temporary file written at part offsets; the journal is the record of finished parts.

Capabilities: ConditionalWrite, ServerSideCopy, MultipartUpload. Not PartListing (the
parts of an upload are ranges of one file; which were written cannot be told) nor
StoreChecksums (a filesystem keeps none; size is what it can confirm).

Written bytes leave the writer's page cache once fsynced (``posix_fadvise(DONTNEED)``):
the store's copy is not read again on this node, and a 100 GiB checkpoint written to a
shared NVMe must not evict the trainer's dataset.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckptd.core import checksum
from ckptd.runtime.yielding import drop_cached
from ckptd.storage.base import (
    STREAM_PIECE,
    FileRange,
    NotFoundError,
    ObjectInfo,
    PartBody,
    PartInfo,
    PreconditionFailedError,
    RangeSink,
    ShortObjectError,
    StorageError,
)

_TMP_MARK = ".ckptd-"
_TMP_SUFFIX = ".tmp"
_PERMANENT_ERRNOS = {
    errno.ENOSPC,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EDQUOT,
    errno.ENOTDIR,
    # Never heals by retrying; copy_file_range's is handled by falling back to sendfile,
    # so one reaching the caller is a real misconfiguration.
    errno.EXDEV,
}
# copy_file_range refuses these pairs of files (another filesystem, since Linux 5.19 for
# most; a filesystem without the call): the same bytes then go through sendfile.
_NO_COPY_RANGE_ERRNOS = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}
# The filesystem refuses this node: the destination as configured can never work.
_UNUSABLE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def _error(exc: OSError, what: str, *, at_root: bool = False) -> StorageError:
    if exc.errno == errno.ENOENT:
        return NotFoundError(f"{what}: {exc.strerror}")
    transient = exc.errno not in _PERMANENT_ERRNOS
    return StorageError(
        f"{what}: {exc.strerror or exc}",
        transient=transient,
        code=errno.errorcode.get(exc.errno or 0, "OSError"),
        # At the root, ENOTDIR means a file stands where the root (or a directory above
        # it) must be, so the root can never be made.
        destination_unusable=exc.errno in _UNUSABLE_ERRNOS
        or (at_root and exc.errno == errno.ENOTDIR),
    )


def _check_crc(data: bytes, crc32c: int, what: str) -> None:
    # The S3 backend has the store check each body against the CRC-32C ckptd computed;
    # a filesystem cannot, so this backend checks before writing, with the same result:
    # a body that does not match is refused and nothing is written.
    if checksum.crc32c(data) != crc32c:
        raise StorageError(f"{what}: CRC-32C mismatch", transient=True, code="BadDigest")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_temp(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name and name.endswith(_TMP_SUFFIX)


class FileStorage:
    """Objects as files under a root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.url = f"file://{self.root}"
        # Until copy_file_range is refused once (``_NO_COPY_RANGE_ERRNOS``).
        self._copy_file_range_works = True

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        # Keys come from manifests and checkpoint listings; refuse any that could
        # climb out of the root (the guarantee: nothing written outside the named dir).
        if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"refusing unsafe key {key!r}", transient=False, code="InvalidKey")
        return self.root.joinpath(*parts)

    def _temp_for(self, target: Path, tag: str) -> Path:
        return target.parent / f".{target.name}{_TMP_MARK}{tag}{_TMP_SUFFIX}"

    def _write_new(self, target: Path, data: bytes) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._temp_for(target, uuid.uuid4().hex)
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
                drop_cached(fh.fileno(), 0, len(data))
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write (ENOSPC) leaves no debris
            raise
        return tmp

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        target = self._path(key)
        _check_crc(data, crc32c, f"put {key}")
        try:
            tmp = self._write_new(target, data)
            try:
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(target.parent)
        except OSError as exc:
            raise _error(exc, f"put {key}") from exc
        return ObjectInfo(key, len(data))

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        target = self._path(key)
        _check_crc(data, crc32c, f"conditional put {key}")
        try:
            tmp = self._write_new(target, data)
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise PreconditionFailedError(f"conditional put {key}: exists") from None
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(target.parent)
        except OSError as exc:
            raise _error(exc, f"conditional put {key}") from exc
        return ObjectInfo(key, len(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise _error(exc, f"get {key}") from exc

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        try:
            with open(self._path(key), "rb", buffering=0) as fh:
                pos = 0
                while pos < length:
                    piece = os.pread(fh.fileno(), min(STREAM_PIECE, length - pos), start + pos)
                    if not piece:
                        raise ShortObjectError(
                            f"get {key}: {pos} of {length} bytes at {start}, then the file ended"
                        )
                    sink(pos, piece)
                    pos += len(piece)
        except OSError as exc:
            raise _error(exc, f"get {key}") from exc

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _error(exc, f"head {key}") from exc
        return ObjectInfo(key, st.st_size, modified=st.st_mtime)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._path(base_key) if base_key else self.root
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in sorted(filenames):
                if _is_temp(name):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    size = full.stat().st_size
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key, size)

    def list_children(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        try:
            return sorted(
                e.name for e in os.scandir(base) if e.is_dir() and not e.name.startswith(".")
            )
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _error(exc, f"list {base}") from exc

    def delete(self, keys: list[str]) -> None:
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise _error(exc, f"delete {key}") from exc
            parents.add(path.parent)
        # Tidy directories a deletion emptied, deepest first, never the root itself.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        src, target = self._path(src_key), self._path(dst_key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._temp_for(target, uuid.uuid4().hex)
            # copyfile uses copy_file_range/sendfile: the kernel (or an NFS 4.2 server)
            # moves the bytes, not this process.
            try:
                shutil.copyfile(src, tmp)
                with open(tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a failed copy (ENOSPC) leaves no debris
                raise
            _fsync_dir(target.parent)
            return ObjectInfo(dst_key, target.stat().st_size)
        except OSError as exc:
            raise _error(exc, f"copy {src_key} -> {dst_key}") from exc

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe{_TMP_MARK}{uuid.uuid4().hex}{_TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise _error(exc, f"destination {self.root}", at_root=True) from exc

    # -- multipart ----------------------------------------------------------------

    def _upload_path(self, key: str, upload_id: str) -> Path:
        if not upload_id.isalnum():
            raise StorageError(
                f"bad upload id {upload_id!r}", transient=False, code="InvalidUpload"
            )
        return self._temp_for(self._path(key), upload_id)

    def create_upload(self, key: str) -> str:
        upload_id = uuid.uuid4().hex
        path = self._upload_path(key, upload_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=False)
        except OSError as exc:
            raise _error(exc, f"create upload {key}") from exc
        return upload_id

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        path = self._upload_path(key, upload_id)
        if isinstance(data, FileRange):
            return self._copy_range(key, upload_id, number, offset, data, crc32c)
        _check_crc(data, crc32c, f"upload part {number} of {key}")
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            raise NotFoundError(f"upload part {number} of {key}: upload {upload_id} gone") from None
        except OSError as exc:
            raise _error(exc, f"upload part {number} of {key}") from exc
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], offset + written)
            # The journal records this part as finished right after: it must be durable.
            os.fsync(fd)
            drop_cached(fd, offset, len(view))
        except OSError as exc:
            raise _error(exc, f"upload part {number} of {key}") from exc
        finally:
            os.close(fd)
        return PartInfo(number, len(data), "", crc32c)

    def _copy_range(
        self, key: str, upload_id: str, number: int, offset: int, data: FileRange, crc32c: int
    ) -> PartInfo:
        # copy_file_range: the kernel (or an NFS 4.2 server) moves the bytes. The caller
        # checksummed this range and re-checks the source file before committing.
        path = self._upload_path(key, upload_id)
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            raise NotFoundError(f"upload part {number} of {key}: upload {upload_id} gone") from None
        try:
            copied = 0
            in_kernel = self._copy_file_range_works
            while copied < data.length:
                left, src, dst = data.length - copied, data.offset + copied, offset + copied
                if in_kernel:
                    try:
                        n = os.copy_file_range(data.fd, fd, left, src, dst)
                    except OSError as exc:
                        if exc.errno not in _NO_COPY_RANGE_ERRNOS:
                            raise
                        # A shared mount is another filesystem than the node's disk.
                        in_kernel = self._copy_file_range_works = False
                        continue
                else:
                    os.lseek(fd, dst, os.SEEK_SET)  # sendfile writes at the file position
                    n = os.sendfile(fd, data.fd, src, left)
                if n == 0:
                    raise StorageError(
                        f"upload part {number} of {key}: source shrank", transient=False
                    )
                copied += n
            os.fsync(fd)
            drop_cached(fd, offset, data.length)
        except OSError as exc:
            raise _error(exc, f"upload part {number} of {key}") from exc
        finally:
            os.close(fd)
        return PartInfo(number, data.length, "", crc32c)

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        path, target = self._upload_path(key, upload_id), self._path(key)
        size = sum(p.size for p in parts)
        try:
            with open(path, "rb+") as fh:
                fh.truncate(size)
                os.fsync(fh.fileno())
                # Each part dropped its own range after its fsync, but a page still busy
                # then (written back by another part's fsync, or by the kernel) stays
                # cached: measured under load, 2 MiB of a 12 MiB copy. Once more, whole.
                drop_cached(fh.fileno(), 0, size)
            os.replace(path, target)
            _fsync_dir(target.parent)
        except FileNotFoundError:
            raise NotFoundError(
                f"complete {key}: upload {upload_id} gone", code="NoSuchUpload"
            ) from None
        except OSError as exc:
            raise _error(exc, f"complete {key}") from exc
        return ObjectInfo(key, size)

    def abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self._upload_path(key, upload_id).unlink(missing_ok=True)
        except OSError as exc:
            raise _error(exc, f"abort upload {key}") from exc

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        found = []
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._path(base_key) if base_key else self.root
        if not base.is_dir():
            return []
        for dirpath, _dirs, filenames in os.walk(base):
            for name in filenames:
                if not _is_temp(name):
                    continue
                stem, _, tag = name[1 : -len(_TMP_SUFFIX)].rpartition(_TMP_MARK)
                key = (Path(dirpath) / stem).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    found.append((key, tag))
        return found
