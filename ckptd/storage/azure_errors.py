"""Azure SDK failures as ckptd's StorageError, classified once (``ckptd.storage.base``):
which a later attempt may fix, which never will, and which make the destination as
configured unusable (no container, access refused, no or refused credential)."""

from __future__ import annotations

from ckptd.core.extras import install_hint
from ckptd.storage.base import (
    NotFoundError,
    PreconditionFailedError,
    ShortObjectError,
    StorageError,
)

# Azure Blob error codes (x-ms-error-code) a later attempt may fix.
_TRANSIENT_CODES = {"ServerBusy", "InternalError", "OperationTimedOut", "Md5Mismatch"}
_UNUSABLE_CODES = {
    "ContainerNotFound",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "AuthorizationPermissionMismatch",
    "InsufficientAccountPermissions",
    "AccountIsDisabled",
    "KeyBasedAuthenticationNotPermitted",
}


def missing_extra() -> StorageError:
    return StorageError(
        f"az:// destinations need the Azure client, {install_hint('azure')}",
        transient=False,
        code="MissingExtra",
        destination_unusable=True,
    )


def classify(exc: Exception, what: str) -> StorageError:
    """Turn an azure-core / azure-identity failure into a StorageError."""
    if isinstance(exc, StorageError):
        return exc
    from azure.core import exceptions as az

    try:
        from azure.identity import CredentialUnavailableError
    except ImportError:  # an account key or a connection string needs no azure-identity
        CredentialUnavailableError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, CredentialUnavailableError) or (
        isinstance(exc, az.ClientAuthenticationError) and exc.status_code is None
    ):
        return StorageError(
            f"{what}: no Azure credential: DefaultAzureCredential tried the environment "
            "(AZURE_CLIENT_ID/AZURE_TENANT_ID with a secret, certificate or federated token), "
            "workload identity, managed identity and the Azure CLI; or set "
            "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_KEY",
            transient=False,
            code="NoCredentials",
            destination_unusable=True,
        )
    if isinstance(exc, az.HttpResponseError):
        raw = getattr(exc, "error_code", "") or ""
        code = str(getattr(raw, "value", raw))  # the SDK's StorageErrorCode is an enum
        status = int(exc.status_code or 0)
        message = f"{what}: {code or status} {(exc.reason or '')}".strip()
        if status == 412 or code in ("ConditionNotMet", "BlobAlreadyExists"):
            return PreconditionFailedError(message)
        if code == "ContainerNotFound":
            return StorageError(message, transient=False, code=code, destination_unusable=True)
        if status == 416 or code == "InvalidRange":
            return ShortObjectError(message)
        if status == 404:
            return NotFoundError(message, code=code or "404")
        transient = code in _TRANSIENT_CODES or status >= 500 or status in (408, 429)
        unusable = code in _UNUSABLE_CODES or status in (401, 403)
        return StorageError(
            message,
            transient=transient and not unusable,
            code=code or str(status),
            destination_unusable=unusable,
        )
    if isinstance(exc, az.AzureError | ConnectionError | TimeoutError | OSError):
        return StorageError(f"{what}: {exc}", transient=True, code=type(exc).__name__)
    return StorageError(f"{what}: {exc!r}", transient=False, code=type(exc).__name__)
