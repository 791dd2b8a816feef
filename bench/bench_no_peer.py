"""What no peer answering costs a restore (#46, bench (c)), on the namespace rig.

```sh
.venv/bin/python bench/bench_no_peer.py                 # 256 MiB, 3 rounds (~2 min)
.venv/bin/python bench/bench_no_peer.py --smoke         # 16 MiB, 1 round (~30 s)
.venv/bin/python bench/bench_no_peer.py --baseline-src /tmp/old-checkout   # before/after
```

Root and the kernel's network namespaces (``tests/support/netns.py``). A SeaweedFS in a
namespace of its own behind a ``--store-mbit`` link (default 1000), a checkpoint of
``--mib`` MiB committed there by ``ckptd run --once``, and a replacement node (its own
namespace, the same link) that restores it with ``ckptd restore --latest --json``:

- **store alone**: ``[peers] enabled = false``;
- **peers gone**: ``[peers]`` on, two peers announced whose hosts' links are down (a
  connect fails after ~3 s: no ARP answer);
- **peers dropping**: ``[peers]`` on, two peers announced whose hosts drop every packet
  (``Rig.silence``: a connect waits for its own timeout).

``restore_wait_seconds`` is the default (10). The announcements are written fresh before
each restore. Rounds rotate the order of the cases; the table gives medians (and the
range) of the wall time of the whole ``ckptd restore`` process, and the extra over the
store alone; and the restore's own ``seconds`` (its ``--json``: from reading the
checkpoint's manifest to the files in place, without the process's start-up, the newest
checkpoint's lookup and the reading of the announcements; the peers' grace is inside). Goal: at most 2 s extra in both peer cases. With ``--baseline-src DIR`` the
peer cases are also run with the ckptd of another checkout (``PYTHONPATH=DIR``), in the
same rounds, for a before/after on the same machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MIB, machine_line  # noqa: E402

from ckptd.peers.model import PeerAnnouncement  # noqa: E402
from ckptd.repository import peer_key  # noqa: E402
from tests.support.netns import Host, Shape  # noqa: E402
from tests.support.peer_cluster import (  # noqa: E402
    BUCKET,
    PEER_PORT,
    RUN_ID,
    S3_ENV,
    PeerRig,
    peer_rig,
)

CASES = ("store alone", "peers gone", "peers dropping")
GOAL_EXTRA_SECONDS = 2.0


def write_checkpoint(base: Path, total: int) -> None:
    """A DCP checkpoint of ``total`` bytes in files of at most 64 MiB, ``.metadata`` last."""
    base.mkdir(parents=True)
    left, i = total, 0
    while left > 0:
        size = min(left, 64 * MIB)
        with open(base / f"__{i}_0.distcp", "wb") as fh:
            block = os.urandom(MIB)
            for _ in range(size // MIB):
                fh.write(block)
            fh.write(os.urandom(size % MIB))
        left -= size
        i += 1
    (base / ".metadata").write_bytes(os.urandom(4096))


def commit_checkpoint(pr: PeerRig, work: Path, mib: int) -> None:
    """``ckptd run --once`` from the test host: one checkpoint committed in the store."""
    watch, state = work / "writer" / "run", work / "writer" / "state"
    write_checkpoint(watch / "step-10", mib * MIB)
    pr.ship_once(watch, state, timeout=600)


def announce(pr: PeerRig, hosts: list[Host]) -> None:
    """Announcements naming only ``hosts`` as the run's peers (ranks 1, 2, ...), fresh."""
    client = pr.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{pr.prefix}/{RUN_ID}/.ckptd-peers/")
    for obj in listed.get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    for rank, host in enumerate(hosts, start=1):
        doc = PeerAnnouncement(
            run_id=RUN_ID,
            node_rank=rank,
            nodes=len(hosts) + 1,
            peer=f"peer-{rank}",
            incarnation="0" * 16,
            host=host.name,
            address=f"{host.address}:{PEER_PORT}",
            quota_bytes=1 << 32,
            free_bytes=1 << 32,
            updated_at=time.time(),
        )
        key = f"{pr.prefix}/{peer_key(RUN_ID, rank)}"
        client.put_object(Bucket=BUCKET, Key=key, Body=doc.to_bytes())


def restore(
    host: Host, config: Path, to: Path, src: Path | None = None
) -> tuple[float, dict[str, Any]]:
    """``ckptd restore --latest --json`` inside ``host``: (seconds, its document)."""
    shutil.rmtree(to, ignore_errors=True)
    argv = host.argv(
        [
            *(sys.executable, "-m", "ckptd", "restore", "--run", RUN_ID, "--latest"),
            *("--to", str(to), "--json", "--no-progress", "--config", str(config)),
        ]
    )
    env = {**os.environ, **S3_ENV}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    started = time.monotonic()
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=600, cwd=src or ROOT
    )
    took = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    doc = json.loads(done.stdout)
    shutil.rmtree(to, ignore_errors=True)
    return took, doc


def measure(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(args.store_mbit)
    with peer_rig(work, store=shape, prefix="nopeer") as pr:
        commit_checkpoint(pr, work, args.mib)
        node = pr.add_node(0, nodes=3, shape=shape, name="replacement", start=False)
        store_only = node.root / "store-only.toml"
        store_only.write_text(
            node.config.read_text().replace("[peers]\nenabled = true", "[peers]\nenabled = false")
        )
        with_peers = node.root / "peers.toml"
        with_peers.write_text(
            node.config.read_text().replace("restore_wait_seconds = 5\n", "")  # the default
        )
        gone = [pr.rig.add_host(f"gone{i}") for i in (1, 2)]
        for host in gone:
            pr.rig.link(host, up=False)
        dropping = [pr.rig.add_host(f"drop{i}") for i in (1, 2)]
        for host in dropping:
            pr.rig.silence(host)
        link = pr.rig.measure(pr.store_host, node.host, mib=16)
        runs: list[tuple[str, str]] = [(c, "this") for c in CASES]
        if args.baseline_src:
            runs += [(c, "baseline") for c in CASES[1:]]
        seconds: dict[str, list[float]] = {f"{c} ({v})": [] for c, v in runs}
        own: dict[str, list[float]] = {label: [] for label in seconds}
        docs: dict[str, dict[str, Any]] = {}
        to = work / "restored"
        for round_ in range(args.rounds):
            k = round_ % len(runs)
            for case, version in runs[k:] + runs[:k]:
                announce(pr, gone if case == "peers gone" else dropping)
                config = store_only if case == "store alone" else with_peers
                src = Path(args.baseline_src) if version == "baseline" else None
                took, doc = restore(node.host, config, to, src)
                label = f"{case} ({version})"
                seconds[label].append(took)
                own[label].append(float(doc["seconds"]))
                docs[label] = doc
                print(f"  round {round_ + 1} {label}: {took:.2f} s", flush=True)
    return {"link_mbit": link, "seconds": seconds, "own_seconds": own, "documents": docs}


def table(result: dict[str, Any], args: argparse.Namespace) -> str:
    seconds = result["seconds"]
    base = statistics.median(seconds["store alone (this)"])
    rows = [
        "| restore | median | range | extra over the store alone | the restore's own "
        "seconds (its extra) | peer bytes | store bytes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    own = result["own_seconds"]
    own_base = statistics.median(own["store alone (this)"])
    for label, values in seconds.items():
        median = statistics.median(values)
        inner = statistics.median(own[label])
        doc = result["documents"][label]
        rows.append(
            f"| {label} | {median:.2f} s | {min(values):.2f}-{max(values):.2f} s | "
            f"{median - base:+.2f} s | {inner:.2f} s ({inner - own_base:+.2f} s) | "
            f"{doc.get('peer_bytes', '-')} | {doc.get('store_bytes', '-')} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="checkpoint size (MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store-mbit", type=float, default=1000.0)
    parser.add_argument("--baseline-src", default=None, help="another checkout to compare")
    parser.add_argument("--smoke", action="store_true", help="16 MiB, one round")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.rounds = 16, 1
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-nopeer-") as tmp:
        result = measure(Path(tmp), args)
    print(
        f"\n{args.mib} MiB checkpoint, store link {args.store_mbit:g} Mbit "
        f"(measured {result['link_mbit']:.0f}), {args.rounds} round(s), "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end\n"
    )
    print(table(result, args))
    seconds = result["seconds"]
    base = statistics.median(seconds["store alone (this)"])
    worst = max(
        statistics.median(seconds[f"{c} (this)"]) - base for c in ("peers gone", "peers dropping")
    )
    print(f"\nworst extra: {worst:.2f} s (goal <= {GOAL_EXTRA_SECONDS:g} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2))
    return 0 if worst <= GOAL_EXTRA_SECONDS or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
