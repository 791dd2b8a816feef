"""The direct S3 path's listing: a page that is not a ListObjectsV2 reply is a transient
StorageError (retried like a reset), never an OSError escaping to the caller."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.storage.base import StorageError
from ckptd.storage.s3_direct import DirectPath, Reply, parse_listing


class OnePage:
    """A DirectS3 whose every listing page is ``body``, answered 200."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def list_page(self, params: Any) -> tuple[Reply, bytes]:
        return Reply(200, {}), self.body


@pytest.mark.parametrize(
    "body",
    [
        b"<html>a proxy's error page</html",
        b"<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
    ],
    ids=["not XML", "truncated without a token"],
)
def test_an_unreadable_listing_page_is_a_transient_storage_error(body: bytes) -> None:
    path = object.__new__(DirectPath)
    with pytest.raises(StorageError) as raised:
        list(path._pages(OnePage(body), "run/"))  # type: ignore[arg-type]
    assert raised.value.transient
    assert "list run/" in str(raised.value)


def test_a_listing_page_is_read_with_its_keys_decoded() -> None:
    body = (
        b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<IsTruncated>false</IsTruncated>"
        b"<Contents><Key>run/a%20b</Key><Size>3</Size><ETag>x</ETag></Contents>"
        b"</ListBucketResult>"
    )
    infos, token = parse_listing(body)
    assert [(i.key, i.size) for i in infos] == [("run/a b", 3)] and token is None
