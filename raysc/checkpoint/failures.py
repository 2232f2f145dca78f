"""Which storage failures are worth retrying.

A save that fails because the disk is full, the bucket's quota is spent, the
credentials may not write or the bucket is gone fails the same way on every
retry: retrying each file with backoff only burns the run's time (a 24 MB store
took a tiny run from ~12,000 to ~830 tokens/s). Throttling, 5xx answers, timeouts
and dropped connections are transient and are retried.

Errors arrive as ``OSError`` with an errno (local and network file systems), as
the Python exceptions s3fs translates S3 error codes into (``PermissionError``,
``FileNotFoundError``), or as an ``OSError`` whose cause is botocore's
``ClientError`` carrying the S3 error code (s3fs passes unknown codes such as
``QuotaExceeded`` through that way). We walk the exception chain for all three.
"""

from __future__ import annotations

import errno

# errno values no retry can fix
PERMANENT_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large for the file system",
}
# S3 (and S3-compatible: MinIO, Ceph RGW) error codes no retry can fix
PERMANENT_CODES = {
    "AccessDenied": "permission denied",
    "AllAccessDisabled": "permission denied",
    "AccountProblem": "permission denied",
    "InvalidAccessKeyId": "bad credentials",
    "SignatureDoesNotMatch": "bad credentials",
    "ExpiredToken": "expired credentials",
    "NoSuchBucket": "the bucket does not exist",
    "InvalidBucketName": "invalid bucket name",
    "QuotaExceeded": "quota exceeded",
    "XMinioAdminBucketQuotaExceeded": "quota exceeded",
    "XMinioStorageFull": "no space left on the server",
    "EntityTooLarge": "object too large for the store",
}


def _chain(exc: BaseException):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def permanent_reason(exc: BaseException) -> str | None:
    """Why ``exc`` cannot be fixed by retrying (e.g. "quota exceeded"), or None if it may be transient."""
    for e in _chain(exc):
        code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code")
        if code in PERMANENT_CODES:
            return f"{PERMANENT_CODES[code]} ({code})"
        if isinstance(e, OSError) and e.errno in PERMANENT_ERRNOS:
            return PERMANENT_ERRNOS[e.errno]
        if isinstance(e, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            return {PermissionError: "permission denied", FileNotFoundError: "the bucket or directory is missing"}.get(
                type(e), type(e).__name__
            )
    return None


class PermanentStorageError(OSError):
    """A store error that retrying cannot fix; ``reason`` says which (no space, quota, permission ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail

    def __reduce__(self):
        return (PermanentStorageError, (self.reason, self.detail))
