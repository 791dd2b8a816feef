"""A cluster restore that reads each byte from the store once (#46): several real
``ckptd restore`` processes restoring the same checkpoint at once, from a real SeaweedFS
behind a loopback proxy whose responses share one paced link (the store's uplink) and
which counts every byte the store sent, from outside ckptd.

Every node's tree is compared byte for byte with what was committed; what a participant
gets wrong (it dies mid-restore, serves damaged or cut-short bytes) costs time or store
egress, never a wrong byte, and leaves nothing partial in place.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import Settings
from ckptd.devtools.locals3 import free_port
from ckptd.peers.sharing import rendezvous
from ckptd.peers.sharing.server import Served, ShareServer, _Handler
from ckptd.repository import Repository, sharing_key
from ckptd.store.restore.staging import manifest_identity
from ckptd.store.tiers import open_tiers
from tests.integration.test_peer_restore import commit_files
from tests.support.faultproxy import FaultProxy
from tests.support.peers import TOKEN
from tests.support.trainers.procs import script_env

MiB = 1024 * 1024
NAME = "step-10"


def checkpoint_files(seed: int = 46) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = {f"__{i}_0.distcp": rnd.randbytes(MiB // 2 + 4099 * i) for i in range(24)}
    files.update({f"extra/{i:02d}.bin": rnd.randbytes(700 + 31 * i) for i in range(24)})
    files[".metadata"] = rnd.randbytes(2222)
    return files


def node_config(tmp: Path, rank: int, nodes: int, dest: str, endpoint: str) -> Path:
    token = tmp / "cluster.token"
    token.write_bytes(TOKEN)
    path = tmp / f"node-{rank}.toml"
    path.write_text(
        "\n".join(
            [
                "[destination]",
                f"url = {json.dumps(dest)}",
                f"endpoint_url = {json.dumps(endpoint)}",
                "[state]",
                f"dir = {json.dumps(str(tmp / f'state-{rank}'))}",
                "[cluster]",
                f"nodes = {nodes}",
                f"node_rank = {rank}",
                "[peers]",
                "enabled = true",
                f"token_file = {json.dumps(str(token))}",
                "quota_gib = 1",
                'listen = "127.0.0.1:9465"',
            ]
        )
        + "\n"
    )
    return path


def start_restore(tmp: Path, config: Path, to: Path) -> subprocess.Popen[str]:
    to.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptd",
            "restore",
            "--config",
            str(config),
            "--run",
            "run",
            "--latest",
            "--to",
            str(to),
            "--json",
            "--no-progress",
            "--log-level",
            "info",
        ],
        env=script_env(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out), err


def assert_tree(root: Path, files: dict[str, bytes]) -> None:
    """``root/NAME`` holds exactly ``files``, byte for byte, and no staging dir is left."""
    tree = root / NAME
    found = {p.relative_to(tree).as_posix(): p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    assert sorted(found) == sorted(files)
    assert all(found[k] == files[k] for k in files), "a restored file differs"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".ckptd-restore-")]


def object_gets(method: str, path: str, query: str) -> bool:
    """The checkpoint's data objects (not its manifest, not a listing)."""
    return method == "GET" and f"/{NAME}/" in path and not path.endswith(".json")


def records(settings: Settings) -> list[str]:
    repo = Repository(open_tiers(settings)[0].storage)
    return [i.key for i in repo.storage.list_objects("run/.ckptd-sharing/")]


@pytest.fixture
def scene(tmp_path: Path, s3_dest: str, local_s3: Any, fault_proxy: FaultProxy) -> Iterator[Any]:
    """The checkpoint committed in SeaweedFS (directly), the proxy in front of it."""
    settings = Settings(
        destination={"url": s3_dest, "endpoint_url": local_s3.endpoint_url},
        state={"dir": tmp_path / "state"},
    )
    files = checkpoint_files()
    commit_files(settings, files)
    yield settings, files
    fault_proxy.open_gate()


def start_together(
    tmp: Path, settings: Settings, nodes: int, dest: str, proxy: FaultProxy
) -> list[subprocess.Popen[str]]:
    """``nodes`` restores started at once: their data waits (``proxy``'s gate) until every
    one wrote its record, whatever the machine's load; the store's counters start then."""
    proxy.close_gate(object_gets)
    procs = [
        start_restore(tmp, node_config(tmp, rank, nodes, dest, proxy.url), tmp / f"node-{rank}")
        for rank in range(nodes)
    ]
    wait_until(lambda: len(records(settings)) == nodes, 120, f"{nodes} records in the store")
    proxy.reset_counters()
    proxy.open_gate()
    return procs


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_three_nodes_restoring_together_read_each_byte_from_the_store_once(
    tmp_path: Path, scene: Any, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    settings, files = scene
    total = sum(len(v) for v in files.values())
    fault_proxy.set_down_rate(4 * MiB)
    procs = start_together(tmp_path, settings, 3, s3_dest, fault_proxy)
    docs = [finished(p)[0] for p in procs]
    for rank in range(3):
        assert_tree(tmp_path / f"node-{rank}", files)
    # From outside ckptd: the store sent each byte about once (requests' own overhead,
    # and two nodes that claimed one file in the same instant, stay within 10 %).
    assert fault_proxy.bytes_down <= 1.1 * total, (fault_proxy.bytes_down, total, docs)
    # ... and each node says where its bytes came from.
    assert all(d["peer_bytes"] + d["store_bytes"] == total for d in docs), docs
    assert sum(d["store_bytes"] for d in docs) <= 1.1 * total, docs
    assert sum(1 for d in docs if d["peer_bytes"] > 0) >= 2, docs
    wait_until(lambda: records(settings) == [], 30, "every record deleted")


def test_a_node_killed_mid_restore_has_its_share_taken_over(
    tmp_path: Path, scene: Any, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    settings, files = scene
    fault_proxy.set_down_rate(2 * MiB)
    procs = start_together(tmp_path, settings, 3, s3_dest, fault_proxy)
    # Node 1 dies while the store is sending (a part of a file of its share in flight).
    wait_until(lambda: fault_proxy.bytes_down >= 3 * MiB, 120, "3 MiB out of the store")
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(timeout=30)
    for rank in (0, 2):
        finished(procs[rank])
        assert_tree(tmp_path / f"node-{rank}", files)
    # The dead node left only its hidden staging dir: nothing partial in place.
    assert not (tmp_path / "node-1" / NAME).exists()


class _Damaging(_Handler):
    """A participant that serves every file with its first byte flipped, or cut short."""

    cut_short = False

    def _file(self, number: int) -> None:
        size = self.server.served_sizes[number]  # type: ignore[attr-defined]
        wanted = self.headers.get("Range", f"bytes=0-{size - 1}")
        start, end = (int(x) for x in wanted.removeprefix("bytes=").split("-"))
        body = bytearray(self.server.bodies[number][start : end + 1])  # type: ignore[attr-defined]
        body[0] ^= 0xFF
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.cut_short:
            self.wfile.write(bytes(body[: len(body) // 2]))
            self.close_connection = True
            return
        self.wfile.write(bytes(body))


class _CutShort(_Damaging):
    cut_short = True


@pytest.mark.parametrize("handler", [_Damaging, _CutShort], ids=["damaged", "cut-short"])
def test_a_participant_serving_bad_bytes_is_caught_and_the_store_serves_instead(
    tmp_path: Path, scene: Any, s3_dest: str, fault_proxy: FaultProxy, handler: Any
) -> None:
    settings, files = scene
    total = sum(len(v) for v in files.values())
    repo = Repository(open_tiers(settings)[0].storage)
    manifest = repo.resolve("run", None)
    session = rendezvous.session_of(manifest.checkpoint, manifest_identity(manifest))
    # Says it holds every file, and is done (so the node does not wait on it at the end).
    every = {"version": 1, "verified": [[0, len(manifest.files) - 1]], "claims": {}, "done": True}

    def state(after: int, asker: str) -> dict[str, Any]:
        time.sleep(0.3)  # a held poll, as a real participant's
        return every

    liar = ShareServer(
        "127.0.0.1", session, TOKEN, state, Served(tmp_path, tmp_path), lambda n: None
    )
    liar.RequestHandlerClass = handler
    liar.served_sizes = [f.size for f in manifest.files]  # type: ignore[attr-defined]
    liar.bodies = [files[f.path] for f in manifest.files]  # type: ignore[attr-defined]
    liar.start()
    try:
        me = rendezvous.Participant(rendezvous.new_node(), f"127.0.0.1:{liar.port}", time.time())
        rendezvous.announce(repo, "run", session, me)
        # The store slow enough that the liar is heard before most files are fetched.
        fault_proxy.set_down_rate(2 * MiB)
        proc = start_restore(
            tmp_path, node_config(tmp_path, 0, 2, s3_dest, fault_proxy.url), tmp_path / "node"
        )
        doc, err = finished(proc)
    finally:
        liar.stop()
        repo.storage.delete([sharing_key("run", session, me.node)])
    assert_tree(tmp_path / "node", files)
    # Every byte kept came from the store in the end; what the liar served was caught.
    assert doc["store_bytes"] >= total - doc["peer_bytes"]
    caught = "restore_share_bad_bytes" if handler is _Damaging else "restore_share_read_failed"
    assert caught in err, err[-3000:]


def test_a_node_alone_restores_as_today_and_leaves_no_record(
    tmp_path: Path, scene: Any, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    settings, files = scene
    total = sum(len(v) for v in files.values())
    proc = start_restore(
        tmp_path, node_config(tmp_path, 0, 4, s3_dest, fault_proxy.url), tmp_path / "alone"
    )
    doc, _ = finished(proc)
    assert_tree(tmp_path / "alone", files)
    assert doc["peer_bytes"] == 0 and doc["store_bytes"] == total
    assert records(settings) == []
    assert NAME in os.listdir(tmp_path / "alone")


def test_a_fixed_share_port_is_where_each_node_serves_its_share(
    tmp_path: Path, scene: Any, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    """``[peers] share_port``: every node's record names that port (two hosts, here two
    loopback addresses), and the nodes read from each other there."""
    settings, files = scene
    port = free_port()
    fault_proxy.close_gate(object_gets)
    procs = []
    for rank in range(2):
        config = node_config(tmp_path, rank, 2, s3_dest, fault_proxy.url)
        config.write_text(
            config.read_text().replace(
                'listen = "127.0.0.1:9465"',
                f'listen = "127.0.0.{rank + 1}:9465"\nshare_port = {port}',
            )
        )
        procs.append(start_restore(tmp_path, config, tmp_path / f"node-{rank}"))
    wait_until(lambda: len(records(settings)) == 2, 120, "2 records in the store")
    storage = open_tiers(settings)[0].storage
    addresses = sorted(json.loads(storage.get_bytes(key))["address"] for key in records(settings))
    assert addresses == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    fault_proxy.open_gate()
    docs = [finished(p)[0] for p in procs]
    for rank in range(2):
        assert_tree(tmp_path / f"node-{rank}", files)
    assert sum(d["peer_bytes"] for d in docs) > 0, docs


EXEC_TRAINER = (
    "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('CKPTD_RESUME_FROM', ''))"
)


def test_fresh_nodes_under_ckptd_exec_share_the_restore_before_the_trainer_starts(
    tmp_path: Path, scene: Any, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    """Two ``ckptd exec`` on fresh nodes (the job replaced whole): each trainer starts on
    the whole checkpoint, byte for byte, and the store sent it about once."""
    settings, files = scene
    total = sum(len(v) for v in files.values())
    fault_proxy.close_gate(object_gets)
    fault_proxy.set_down_rate(4 * MiB)
    procs, told = [], []
    for rank in range(2):
        node = tmp_path / f"exec-{rank}"
        config = node_config(tmp_path, rank, 2, s3_dest, fault_proxy.url)
        text = config.read_text().replace(
            'listen = "127.0.0.1:9465"', f'listen = "127.0.0.1:{free_port()}"'
        )
        text += f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
        watch = f'[[watch]]\ndir = {json.dumps(str(node / "run"))}\nrun_id = "run"\n'
        config.write_text(watch + text + '[preemption]\nprovider = "none"\n')
        told.append(node / "told.txt")
        node.mkdir()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ckptd",
                    "exec",
                    "--config",
                    str(config),
                    "--",
                    sys.executable,
                    "-c",
                    EXEC_TRAINER,
                    str(told[-1]),
                ],
                env=script_env(node),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )

    def both_recorded() -> bool:
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(
                    f"exec exited {proc.returncode}: {proc.communicate()[1][-3000:]}"
                )
        return len(records(settings)) == 2

    try:
        wait_until(both_recorded, 120, "two records in the store")
        fault_proxy.reset_counters()
        fault_proxy.open_gate()
        logs = []
        for proc in procs:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            logs.append(err)
        for rank in range(2):
            assert_tree(tmp_path / f"exec-{rank}" / "run", files)
            assert told[rank].read_text().endswith(NAME)  # the trainer resumed from it
        restored = [
            json.loads(line)
            for err in logs
            for line in err.splitlines()
            if line.startswith("{") and '"exec_restored"' in line
        ]
        gets = [r.path for r in fault_proxy.requests if object_gets(r.method, r.path, r.query)]
        twice = sorted({p.rsplit("/", 1)[-1] for p in gets if gets.count(p) > 1})
        sharing = [line for err in logs for line in err.splitlines() if '"restore_share' in line]
        why = (restored, twice, sharing[-20:])
        assert len(restored) == 2, why
        assert sum(r["store_bytes"] for r in restored) <= 1.1 * total, why
        assert any(r["peer_bytes"] > 0 for r in restored), restored
        assert fault_proxy.bytes_down <= 1.1 * total
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
