"""docs/design.md's recipes, recomputed from the document alone, agree with what ckptd makes.

An outside verifier has only the document: the file digest, the manifest signature, the
key id and the CRC-32C forms are recomputed here from its text (the domain strings and
block size are read out of it) with hashlib, hmac, json and blake3 only, and compared with
the values ckptd's own code produces. The reference verifier the document prints is run
too, so it cannot drift from the code either. ckptd is called only for the reference
values and to build the manifests.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import hmac
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3

from ckptd.commit.parts import save_id
from ckptd.core import checksum, digest
from ckptd.core.manifest import Manifest, build_manifest, parse_manifest
from ckptd.core.signing import AuthenticationError, KeyRing

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
MiB = 1024 * 1024


def design_text() -> str:
    return DESIGN.read_text(encoding="utf-8")


def section(title: str, text: str | None = None) -> str:
    """The body of the section headed ``title`` (any level), up to the next heading of
    the same or a higher level; fails the test when there is no such heading."""
    lines = (design_text() if text is None else text).splitlines()
    for index, line in enumerate(lines):
        match = re.match(r"^(#+) (.*)$", line)
        if match and match.group(2).strip() == title:
            level = len(match.group(1))
            body: list[str] = []
            for rest in lines[index + 1 :]:
                found = re.match(r"^(#+) ", rest)
                if found and len(found.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    pytest.fail(f"docs/design.md has no section {title!r}")


def bytes_literal(text: str, pattern: str) -> bytes:
    """The first Python bytes literal ``b"..."`` in ``text`` whose content matches
    ``pattern``, evaluated (so ``\\n`` is a newline, as the document writes it)."""
    for literal in re.findall(r'b"(?:[^"\\]|\\.)*"', text):
        value = ast.literal_eval(literal)
        assert isinstance(value, bytes)
        if re.search(pattern, value.decode("ascii")):
            return value
    pytest.fail(f"no bytes literal matching {pattern!r} in docs/design.md")


def quoted(pattern: str, text: str) -> str:
    """The first group of ``pattern`` in ``text``; fails the test when it is not there."""
    found = re.search(pattern, text)
    if found is None:
        pytest.fail(f"docs/design.md no longer says {pattern!r}")
    return found.group(1)


def sample(size: int, seed: int = 1) -> bytes:
    """Deterministic bytes that differ from block to block."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest() * 64
        counter += 1
    return bytes(out[:size])


# -- the file digest ---------------------------------------------------------------------


def recipe_digest(data: bytes) -> str:
    """The file digest as "File digest (authenticated checkpoints, contract)" spells it."""
    recipe = section("File digest (authenticated checkpoints, contract)")
    domain = bytes_literal(recipe, r"digest")
    block = int(quoted(r"bytes\[i \* (\d+) :", recipe))
    assert block == MiB, "the recipe's block is 1 MiB"
    assert f"the domain string, {len(domain)} bytes" in recipe
    top = blake3(domain)
    top.update(len(data).to_bytes(8, "big"))
    for start in range(0, len(data), block):
        top.update(blake3(data[start : start + block]).digest())
    return top.hexdigest()


@pytest.mark.parametrize("size", [0, 1, MiB - 1, MiB, MiB + 1, 2 * MiB + 12345])
def test_the_documented_file_digest_is_the_one_ckptd_computes(size: int) -> None:
    data = sample(size)
    assert recipe_digest(data) == digest.digest_of_bytes(data)


def test_the_documented_file_digest_is_the_one_a_ranged_restore_folds() -> None:
    # A restore hashes each ranged GET (starting on a block) by itself and folds the
    # ranges' block digests: the same value the recipe gives for the whole file.
    data = sample(3 * MiB + 777, seed=2)
    blocks: list[bytes] = []
    for start in range(0, len(data), 2 * MiB):
        ranged = digest.RangeDigest()
        piece = data[start : start + 2 * MiB]
        for pos in range(0, len(piece), 100_000):  # pieces not aligned to blocks
            ranged.update(pos, piece[pos : pos + 100_000])
        blocks += ranged.finish()
    assert digest.file_digest(len(data), blocks) == recipe_digest(data)


def test_the_documented_algorithm_name_is_ckptds() -> None:
    assert f"`{digest.ALGORITHM}`" in section("File digest (authenticated checkpoints, contract)")


# -- the manifest signature --------------------------------------------------------------


def recipe_signature(stored: bytes, key: bytes) -> str:
    """The signature as "Signature" spells it, steps 1 to 4."""
    domain = bytes_literal(section("Signature"), r"signature")
    doc = json.loads(stored)
    doc.pop("signature", None)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, domain + canonical.encode("ascii"), hashlib.sha256).hexdigest()


def recipe_key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:8]


def key_file(tmp_path: Path, name: str = "manifest.key") -> tuple[Path, bytes]:
    """A key file as `openssl rand -hex 32 > FILE` makes one (with its newline), and
    the key the document says it holds (the hex text, stripped, as ASCII bytes)."""
    text = hashlib.sha256(name.encode()).hexdigest()
    path = tmp_path / name
    path.write_text(text + "\n")
    return path, text.encode("ascii")


def manifests() -> list[Manifest]:
    """Manifests that exercise the canonical form: non-ASCII text (one character beyond
    the BMP), a step-less name, many nodes, unknown fields at both levels."""
    one = build_manifest(
        run_id="run1",
        checkpoint="checkpoint-500",
        step=500,
        layout="hf",
        host="nœud-17",
        created_at=1_764_676_800,
        committed_at=1_764_676_809,
        files=[("model.safetensors", 3 * MiB, "9f8e7d6c"), ("config.json", 1024, "1a2b3c4d")],
        environment={"ckptd": "0.1.0", "python": "3.11.7", "note": '\U0001f680 "q" \\ /'},
        digests={"model.safetensors": "ab" * 32, "config.json": "cd" * 32},
        digest_algorithm=digest.ALGORITHM,
    )
    cluster = build_manifest(
        run_id="run-2",
        checkpoint="final",
        step=None,
        layout="dcp",
        host="node-0",
        created_at=1_764_676_000,
        committed_at=1_764_676_100,
        files=[("__0_0.distcp", 10, "00000001"), ("__1_0.distcp", 20, "00000002")],
        environment={},
        nodes=2,
        save="0c1d2e3f",
        digests={"__0_0.distcp": "01" * 32, "__1_0.distcp": "02" * 32},
        digest_algorithm=digest.ALGORITHM,
    )
    # A later ckptd's fields: kept when parsed, and signed.
    doc: dict[str, Any] = one.to_document()
    doc["future"] = {"b": [1, 2, {"z": None}], "a": True}
    doc["files"][0]["future_file_field"] = "x"
    extra = parse_manifest(json.dumps(doc).encode())
    return [one, cluster, extra]


@pytest.mark.parametrize("index", range(3))
def test_the_documented_signature_is_the_one_ckptd_signs(tmp_path: Path, index: int) -> None:
    path, key = key_file(tmp_path)
    ring = KeyRing.from_files(path)
    signed = ring.sign(manifests()[index])
    stored = signed.to_bytes()  # what goes to the store
    assert signed.key_id == recipe_key_id(key)
    assert signed.signature == recipe_signature(stored, key)
    # Any re-serialisation with the same values verifies the same way.
    compact = json.dumps(json.loads(stored), separators=(",", ":")).encode()
    assert recipe_signature(compact, key) == signed.signature


def test_a_manifest_signed_by_the_documented_recipe_passes_ckptds_check(tmp_path: Path) -> None:
    old_path, old_key = key_file(tmp_path, "old.key")
    new_path, _ = key_file(tmp_path, "new.key")
    ring = KeyRing.from_files(new_path, [old_path])  # the outside signer holds the old key
    doc = manifests()[0].to_document()
    doc["digest"] = digest.ALGORITHM
    doc["key_id"] = recipe_key_id(old_key)
    body = json.dumps(doc).encode()
    doc["signature"] = recipe_signature(body, old_key)
    ring.check(parse_manifest(json.dumps(doc, indent=4).encode()))

    doc["host"] = "elsewhere"  # any edited field breaks it
    with pytest.raises(AuthenticationError, match="does not match"):
        ring.check(parse_manifest(json.dumps(doc).encode()))


# -- the reference verifier the document prints -------------------------------------------


def reference_verifier() -> dict[str, Callable[..., Any]]:
    """The ```python block of "Signature", executed; it may import only what an outside
    verifier has (the standard library's hashlib, hmac, json, and blake3)."""
    blocks = re.findall(r"```python\n(.*?)```", section("Signature"), flags=re.S)
    assert len(blocks) == 1, "one reference verifier in the Signature section"
    tree = ast.parse(blocks[0])
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"hashlib", "hmac", "json", "blake3"}, imported
    namespace: dict[str, Any] = {}
    exec(compile(tree, "docs/design.md", "exec"), namespace)
    return namespace


def test_the_documents_reference_verifier_agrees_with_ckptd(tmp_path: Path) -> None:
    verifier = reference_verifier()
    for size in (0, MiB, 2 * MiB + 5):
        data = sample(size, seed=3)
        assert verifier["file_digest"](data) == digest.digest_of_bytes(data)
    path, _ = key_file(tmp_path)
    key = verifier["key_from_file"](path.read_bytes())
    ring = KeyRing.from_files(path)
    assert verifier["key_id"](key) == ring.signing_id
    for manifest in manifests():
        signed = ring.sign(manifest)
        assert verifier["manifest_signature"](signed.to_bytes(), key) == signed.signature


# -- CRC-32C and the ids made of it ------------------------------------------------------


def recipe_crc32c(data: bytes) -> int:
    """CRC-32C as "CRC-32C" defines it: reflected polynomial, initial value and final
    XOR 0xFFFFFFFF (bit by bit: slow, for small inputs)."""
    poly = int(quoted(r"polynomial `(0x[0-9A-F]+)`", section("CRC-32C")), 16)
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (poly if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_documented_check_value_is_the_crc32c_ckptd_computes() -> None:
    check = int(quoted(r'`"123456789"` gives `(0x[0-9A-F]+)`', section("CRC-32C")), 16)
    assert recipe_crc32c(b"123456789") == check == checksum.crc32c(b"123456789")


def test_the_documented_crc32c_forms_are_ckptds() -> None:
    parts = [sample(1000, seed=s) for s in (4, 5, 6)]
    whole = recipe_crc32c(b"".join(parts))
    assert whole == checksum.crc32c(b"".join(parts))
    hex_form = f"{whole:08x}"
    assert hex_form == checksum.to_hex(whole) and re.fullmatch(r"[0-9a-f]{8}", hex_form)
    assert base64.b64encode(whole.to_bytes(4, "big")).decode() == checksum.to_base64(whole)
    part_crcs = [recipe_crc32c(p) for p in parts]
    joined = b"".join(c.to_bytes(4, "big") for c in part_crcs)
    composite = base64.b64encode(recipe_crc32c(joined).to_bytes(4, "big")).decode()
    assert f"{composite}-{len(parts)}" == checksum.s3_composite(part_crcs)
    # Folding the parts' values gives the whole file's: what the manifest records.
    assert (
        checksum.combine_parts((c, len(p)) for c, p in zip(part_crcs, parts, strict=True)) == whole
    )


def test_the_documented_save_id_is_ckptds() -> None:
    files = [("b/shard.distcp", 20, 1_700_000_000_000_000_002), ("a.pt", 10, 17)]
    text = "".join(f"{p}\t{s}\t{m}\n" for p, s, m in sorted(files))
    assert f"{recipe_crc32c(text.encode('utf-8')):08x}" == save_id(files)
    assert "`<path>\\t<size>\\t<mtime_ns>\\n`" in section("The save id")
