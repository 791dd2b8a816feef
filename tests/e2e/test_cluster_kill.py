"""``kill -9`` of a node's daemon at random instants never yields a committed checkpoint
missing a shard, and a re-save under the same name never mixes two saves.

Saves are written as DCP's ``FileSystemWriter`` writes them on node-local disks (each
rank's ``__R_0.distcp`` on its own node, then the coordinator's ``.metadata.tmp`` renamed to
``.metadata`` on node 0), with random bytes, so many saves fit in a short test. The victim
of each kill is node 0 (it holds the commit record and announces), node 1, or both.

The campaign is seeded; the seed is printed. More instants (the variables are not named
``CKPTD_*``: the daemons would take them for config keys)::

    CLUSTER_KILL_INSTANTS=60 CLUSTER_KILL_SEED=7 .venv/bin/pytest -q -s tests/e2e/test_cluster_kill.py
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.commit.parts import CLOCK_SKEW_SECONDS, SAVE_TAIL_SECONDS, save_tail_seconds
from ckptd.devtools.locals3 import LocalS3
from tests.support.cluster import Cluster, Node, Store, check_committed, snapshot
from tests.support.daemon import wait_until
from tests.support.writers import write_bytes

INSTANTS = int(os.environ.get("CLUSTER_KILL_INSTANTS", "12"))
SEED = int(os.environ.get("CLUSTER_KILL_SEED", str(random.SystemRandom().randrange(10**6))))
RANKS_PER_NODE = 2
#: Uploads slowed so a kill lands mid-upload (node-wide cap, each daemon its own).
THROTTLE = {"max_upload_mib_per_s": 4, "part_size_mib": 5}


def write_node_shards(node: Node, name: str, rng: random.Random, size: int) -> None:
    """This node's ranks each write their shard, as FileSystemWriter does."""
    for local in range(RANKS_PER_NODE):
        rank = node.rank * RANKS_PER_NODE + local
        write_bytes(node.checkpoint(name) / f"__{rank}_0.distcp", size + rng.randrange(4096))


def write_metadata(node: Node, name: str) -> None:
    """The coordinator's commit record, after every rank's shard: tmp, then rename."""
    directory = node.checkpoint(name)
    write_bytes(directory / ".metadata.tmp", 2000 + len(name))
    os.replace(directory / ".metadata.tmp", directory / ".metadata")


def write_save(cluster: Cluster, name: str, rng: random.Random, size: int) -> None:
    for node in reversed(cluster.members):  # node 0 last: its .metadata closes the save
        write_node_shards(node, name, rng, size)
    write_metadata(cluster[0], name)


def test_kill9_at_random_instants_never_commits_a_checkpoint_missing_a_shard(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    print(f"kill -9 campaign: seed {SEED}, {INSTANTS} instants (CLUSTER_KILL_SEED to replay)")
    rng = random.Random(SEED)
    store = Store(s3_client, s3_prefix)
    size = 3 << 19  # 1.5 MiB a shard: about 0.75 s of upload per node at the cap
    with Cluster(
        tmp_path, 2, s3_dest, local_s3.endpoint_url, destination=dict(THROTTLE)
    ) as cluster:
        cluster.start()
        # One undisturbed save sets the window the kills are drawn from.
        began = time.monotonic()
        write_save(cluster, "step-0", rng, size)
        wait_until(lambda: store.manifest("step-0"), 60, "step-0", details=cluster.logs)
        window = (time.monotonic() - began) * 1.2
        print(f"an undisturbed save commits in {window / 1.2:.2f} s; kills within {window:.2f} s")

        checked: set[str] = set()
        victims_seen: set[str] = set()
        # Every victim at least once (in a seeded order), then drawn: 12 free draws miss
        # one of the three for about 1 seed in 130.
        kinds = ["node 0", "node 1", "both"]
        victims = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(INSTANTS)]
        for i in range(1, INSTANTS + 1):
            name = f"step-{i}"
            victim = victims[i - 1]
            delay = rng.uniform(0, window)
            ranks = {"node 0": (0,), "node 1": (1,), "both": (0, 1)}[victim]
            write_save(cluster, name, rng, size)
            time.sleep(delay)  # the kill instant itself, not a synchronisation
            cluster.kill9(*ranks)
            victims_seen.add(victim)
            state = {
                "parts": [r for r in (0, 1) if store.part(name, r)],
                "committed": store.manifest(name) is not None,
            }
            print(f"  {name}: kill -9 {victim} at +{delay:.2f} s -> {state}")
            # Whatever is committed by now is whole: every shard of both nodes.
            for committed in set(store.committed()) - checked:
                check_committed(store, committed, cluster.local_files(committed), nodes=2)
                checked.add(committed)
            cluster.start(*ranks)

        names = {f"step-{i}" for i in range(INSTANTS + 1)}
        wait_until(
            lambda: set(store.committed()) == names,
            120,
            "every save committed after the restarts",
            details=lambda: f"committed {store.committed()}\n{cluster.logs()}",
        )
        for name in sorted(names):
            check_committed(store, name, cluster.local_files(name), nodes=2)
        latest = store.latest()
        assert latest is not None and latest["checkpoint"] == f"step-{INSTANTS}"
        if INSTANTS >= 3:
            assert victims_seen == {"node 0", "node 1", "both"}


@pytest.mark.parametrize("announcer", ["down", "up"])
def test_a_resave_under_the_same_name_never_mixes_two_saves(
    announcer: str, tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    """Save A is announced and node 0 ships its part while node 1's daemon is down. Then
    the trainer saves the same name again (B, same sizes, new bytes): node 1's shards
    first, with node 1's daemon started while A's announcement may still be in the store,
    then node 0's shards and ``.metadata``. What is committed is B on both nodes; A's part
    (its objects still in the store) is never merged with B's.

    ``down``: node 0's daemon is stopped from A's part until B is whole, so A's
    announcement stays; B comes 10 s after A. ``up``: node 0's daemon runs throughout
    and sees its files change at once (B seconds after A)."""
    store = Store(s3_client, s3_prefix)
    size = 256 * 1024
    name = "step-10"
    with Cluster(tmp_path / "c", 2, s3_dest, local_s3.endpoint_url) as cluster:
        write_save(cluster, name, random.Random(1), size)
        if announcer == "down":
            # What ties a follower's files to a save is time (``files_fit_save``): for DCP,
            # whose .metadata follows every rank's files, shards newer than the announcing
            # node's newest by more than the clock skew belong to a later save. B comes
            # 10 s after A here (a restart alone takes longer), a third of the 30 s tail
            # of layouts whose record may come before other ranks' last writes.
            a_time = time.time() - 5 * CLOCK_SKEW_SECONDS
            assert save_tail_seconds("dcp") == CLOCK_SKEW_SECONDS < 10 < SAVE_TAIL_SECONDS
            for node in cluster.members:
                for path in node.checkpoint(name).iterdir():
                    os.utime(path, (a_time, a_time))
        cluster.start(0)
        wait_until(lambda: store.part(name, 0), 60, "node 0's part of save A", details=cluster.logs)
        announced = store.announcement(name)
        assert announced is not None
        save_a = announced["save"]
        if announcer == "down":
            cluster.stop(0)
        assert store.manifest(name) is None

        # Save B: same writer, same sizes (a size check cannot tell them apart), new bytes.
        for node in cluster.members:
            for path in list(node.checkpoint(name).iterdir()):
                path.unlink()
        sizes_b = random.Random(1)
        write_node_shards(cluster[1], name, sizes_b, size)
        cluster.start(1)
        # An observation window, not a synchronisation: many poll intervals in which node 1
        # could take A's announcement for its shards' and commit a mix.
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert store.manifest(name) is None, "committed save A's part with save B's"
            time.sleep(0.1)
        write_node_shards(cluster[0], name, sizes_b, size)
        write_metadata(cluster[0], name)
        b = snapshot(cluster.local_files(name), tmp_path / "save-b")
        if announcer == "down":
            cluster.start(0)
        wait_until(lambda: store.manifest(name), 60, "the commit of save B", details=cluster.logs)
        manifest = check_committed(store, name, b, nodes=2)
        assert manifest.get("save") != save_a
