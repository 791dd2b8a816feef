"""docs/stores.md's minimal IAM policy for S3 grants exactly the actions the S3 backend's
requests need: each botocore call in ``ckptd/storage/s3.py`` (read from its source, the
paginators included), mapped to the IAM action that authorizes it."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import ckptd.storage.s3

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "stores.md"
# Each S3 operation botocore may be asked for, as a client method name, and the IAM
# action it needs (AWS's "Actions, resources, and condition keys for Amazon S3"; the
# conditional PutObject needs no more than PutObject). A copy also reads its source,
# which s3:GetObject covers.
ACTION_OF = {
    "put_object": "s3:PutObject",
    "create_multipart_upload": "s3:PutObject",
    "upload_part": "s3:PutObject",
    "complete_multipart_upload": "s3:PutObject",
    "copy_object": "s3:PutObject",
    "upload_part_copy": "s3:PutObject",
    "get_object": "s3:GetObject",
    "head_object": "s3:GetObject",
    "delete_objects": "s3:DeleteObject",
    "abort_multipart_upload": "s3:AbortMultipartUpload",
    "list_parts": "s3:ListMultipartUploadParts",
    "list_objects_v2": "s3:ListBucket",
    "head_bucket": "s3:ListBucket",
    "list_multipart_uploads": "s3:ListBucketMultipartUploads",
}
COPIES = {"copy_object", "upload_part_copy"}  # and s3:GetObject on the source


def operations() -> set[str]:
    """Every S3 operation s3.py calls: ``self._client.NAME(...)`` and
    ``self._client.get_paginator("NAME")``."""
    tree = ast.parse(Path(ckptd.storage.s3.__file__).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.value, ast.Attribute):
            continue
        if node.value.attr != "_client":
            continue
        # ``meta`` is botocore's description of the client (its resolved endpoint), no call.
        if node.attr not in ("get_paginator", "meta"):
            found.add(node.attr)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get_paginator"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
    return found


def documented_policy() -> dict[str, set[str]]:
    """Statement Sid -> its actions, from the page's one IAM policy."""
    blocks = re.findall(r"^( *)```json\n(.*?)^\1```", PAGE.read_text(), re.DOTALL | re.MULTILINE)
    (policy,) = [json.loads(textwrap.dedent(body)) for _, body in blocks if "s3:" in body]
    return {s["Sid"]: set(s["Action"]) for s in policy["Statement"]}


def test_the_policy_grants_exactly_what_the_s3_backend_calls() -> None:
    called = operations()
    assert {"put_object", "list_objects_v2", "list_parts"} <= called  # the reader reads
    unknown = called - set(ACTION_OF)
    assert unknown == set(), f"map these S3 calls to IAM actions here and in stores.md: {unknown}"
    needed = {ACTION_OF[op] for op in called} | ({"s3:GetObject"} if called & COPIES else set())
    policy = documented_policy()
    assert set().union(*policy.values()) == needed
    # Bucket-level actions on the bucket, object-level ones on the prefix.
    assert policy["CkptdBucket"] == {"s3:ListBucket", "s3:ListBucketMultipartUploads"}
