"""``ckptd run --once`` decides a rewritten name as the daemon does (issue 44 item 2), and
ships a backlog in step order (issue 45), against the session's SeaweedFS.

A trainer rolls back: checkpoints 20, 40 and 60 committed, it resumes from 40 and saves
50 and 60 again. The same sequence, byte for byte (every file's bytes come from a seed),
goes to a node that runs ``ckptd run --once`` after each of the trainer's lives and to a
node whose ``ckptd run`` (a real process) watches it save. Both stores must then hold the
same slots with the same bytes (read back) and the same LATEST, and ``run --once`` on each
node afterwards must exit the same:

- reported (``ckptd.trainer.report_resumed``): the new 60 commits as
  ``checkpoint-60~<trajectory>``, LATEST follows it, the old 60 keeps its bytes; exit 0;
- not reported: the new 60 is a conflict (the old 60 keeps its bytes and LATEST), the
  local copy is kept; exit 1.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

import ckptd.trainer
from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.writers import local_files

RUN = "run"


def save(root: Path, step: int, life: int) -> Path:
    """An HF-shaped checkpoint whose bytes depend only on (step, life), so the two nodes
    save the same content; a name saved before is moved aside first, as a trainer's
    rewrite replaces it (the old bytes go to ``<root>/../kept``)."""
    d = root / f"checkpoint-{step}"
    if d.exists():
        kept = root.parent / "kept"
        kept.mkdir(exist_ok=True)
        shutil.move(str(d), kept / f"{d.name}-life-{life - 1}")
    rng = random.Random(f"{step}/{life}")
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(rng.randbytes(150_000))
    (d / "optimizer.pt").write_bytes(rng.randbytes(70_000))
    (d / "config.json").write_text('{"model_type": "toy"}')
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "life": life}))
    return d


def node(tmp_path: Path, name: str, local_s3: LocalS3, dest: str) -> Daemon:
    root = tmp_path / name
    (root / "run").mkdir(parents=True)
    return Daemon.configured(
        root,
        watch=[{"dir": root / "run", "run_id": RUN, "settle_seconds": 0.2}],
        dest=dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=root / "state",
    )


def stored(s3: Any, prefix: str) -> tuple[str, dict[str, dict[str, bytes]]]:
    """LATEST's slot, and every committed slot's files read back from the store (a slot
    counts as committed when its manifest is there; its files are the ones it names)."""

    def get(key: str) -> bytes:
        return bytes(s3.get_object(Bucket="ckpt", Key=key)["Body"].read())

    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt", Prefix=f"{prefix}/{RUN}/")
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    slots: dict[str, dict[str, bytes]] = {}
    for key in keys:
        if key.endswith("/ckptd.manifest.json"):
            slot = key.split("/")[-2]
            doc = json.loads(get(key))
            if doc.get("format") != "ckptd.manifest/1":
                continue  # a redirect
            slots[slot] = {
                f["path"]: get(f"{prefix}/{RUN}/{slot}/{f['path']}") for f in doc["files"]
            }
    latest = json.loads(get(f"{prefix}/{RUN}/LATEST"))["checkpoint"]
    return str(latest), slots


def events(text: str, event: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                out.append(doc)
    return out


def run_once(daemon: Daemon) -> tuple[int, str]:
    done = run_cli("run", "--once", config=daemon.config)
    return done.returncode, done.stderr


def once_node(daemon: Daemon, root: Path, reported: bool) -> tuple[int, str]:
    """The trainer's two lives, each followed by ``run --once``; the second's result."""
    run = root / "run"
    for step in (20, 40, 60):
        save(run, step, 0)
    code, log = run_once(daemon)
    assert code == 0, log[-3000:]
    if reported:
        ckptd.trainer.report_resumed(run / "checkpoint-40", watch_dir=run)
    save(run, 50, 1)
    save(run, 60, 1)
    return run_once(daemon)


def daemon_node(daemon: Daemon, root: Path, reported: bool) -> None:
    """The same lives with ``ckptd run`` beside the trainer, which waits for each save
    to be dealt with before the next, as a trainer's steps between saves let it."""
    run = root / "run"
    with daemon:
        for step in (20, 40, 60):
            save(run, step, 0)
            wait_until(
                lambda s=step: daemon.events_named(  # type: ignore[misc]
                    "checkpoint_committed", checkpoint=f"checkpoint-{s}"
                ),
                60,
                f"checkpoint-{step} committed",
                details=daemon.log_text,
            )
        if reported:
            ckptd.trainer.report_resumed(run / "checkpoint-40", watch_dir=run)
        save(run, 50, 1)
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-50"),
            60,
            "checkpoint-50 committed",
            details=daemon.log_text,
        )
        save(run, 60, 1)
        if reported:
            wait_until(
                lambda: (
                    len(daemon.events_named("checkpoint_committed", checkpoint="checkpoint-60"))
                    == 2
                ),
                60,
                "the new checkpoint-60 committed",
                details=daemon.log_text,
            )
        else:
            wait_until(
                lambda: daemon.events_named("checkpoint_conflict", checkpoint="checkpoint-60"),
                60,
                "the new checkpoint-60 refused",
                details=daemon.log_text,
            )
        assert daemon.events_named("checkpoint_resaved_after_commit", checkpoint="checkpoint-60")


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "not-reported"])
def test_run_once_decides_a_rollback_as_the_daemon_does(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
    reported: bool,
) -> None:
    once_root, daemon_root = tmp_path / "once", tmp_path / "daemon"
    once = node(tmp_path, "once", local_s3, f"{s3_dest}-once")
    beside = node(tmp_path, "daemon", local_s3, f"{s3_dest}-daemon")
    code, log = once_node(once, once_root, reported)
    daemon_node(beside, daemon_root, reported)
    # run --once after the daemon: nothing new to ship, and the same verdict (a later
    # run --once says a conflict again).
    after_daemon, after_log = run_once(beside)

    assert events(log, "checkpoint_resaved_after_commit"), log[-3000:]
    assert code == after_daemon == (0 if reported else 1), (log[-3000:], after_log[-3000:])
    latest, slots = stored(s3_client, f"{s3_prefix}-once")
    assert (latest, slots) == stored(s3_client, f"{s3_prefix}-daemon")

    run = once_root / "run"
    kept = once_root / "kept"
    # The old 60 keeps its bytes in its home slot either way (I1).
    assert slots["checkpoint-60"] == local_files(kept / "checkpoint-60-life-0")
    assert slots["checkpoint-50"] == local_files(run / "checkpoint-50")
    for step in (20, 40):
        assert slots[f"checkpoint-{step}"] == local_files(run / f"checkpoint-{step}")
    new_60 = [s for s in slots if s.startswith("checkpoint-60~")]
    if reported:
        # A new trajectory: the new 60 in its own slot, byte for byte, and LATEST on it.
        assert len(new_60) == 1 and latest == new_60[0]
        assert slots[new_60[0]] == local_files(run / "checkpoint-60")
        assert not events(log, "checkpoint_conflict")
    else:
        # A conflict, loud, with the local copy kept and LATEST where it was.
        assert new_60 == [] and latest == "checkpoint-60"
        assert events(log, "checkpoint_conflict")
        assert local_files(run / "checkpoint-60") != slots["checkpoint-60"]
        assert json.loads((run / "checkpoint-60" / "trainer_state.json").read_text())["life"] == 1
        assert "checkpoints_not_shipped" in after_log


def test_run_once_ships_a_backlog_in_step_order_and_says_no_rollback(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """Issue 45: checkpoint-10 and checkpoint-20 waiting, no trainer report: 10 commits
    first, then 20, and nothing warns of a rollback that never happened."""
    root = tmp_path / "node"
    daemon = node(tmp_path, "node", local_s3, s3_dest)
    save(root / "run", 20, 0)
    save(root / "run", 10, 0)
    code, log = run_once(daemon)
    assert code == 0, log[-3000:]
    assert [e["checkpoint"] for e in events(log, "checkpoint_committed")] == [
        "checkpoint-10",
        "checkpoint-20",
    ]
    assert not events(log, "latest_not_moved"), log[-3000:]
    latest, slots = stored(s3_client, s3_prefix)
    assert latest == "checkpoint-20"
    assert slots == {
        name: local_files(root / "run" / name) for name in ("checkpoint-10", "checkpoint-20")
    }


def test_a_daemon_started_after_a_rewrite_it_did_not_see_decides_it_at_start(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """A rollback that re-saves checkpoint-60 while no daemon runs sends no file event:
    the daemon started afterwards looks at committed names too, and refuses the new 60
    loudly (no report: a conflict), its bytes never over the old 60's."""
    root = tmp_path / "node"
    daemon = node(tmp_path, "node", local_s3, s3_dest)
    run = root / "run"
    with daemon:
        for step in (20, 40, 60):
            save(run, step, 0)
        for step in (20, 40, 60):
            wait_until(
                lambda s=step: daemon.events_named(  # type: ignore[misc]
                    "checkpoint_committed", checkpoint=f"checkpoint-{s}"
                ),
                60,
                f"checkpoint-{step} committed",
                details=daemon.log_text,
            )
    save(run, 60, 1)  # while no daemon runs
    restarted = daemon  # the same node's daemon, started again
    with restarted:
        wait_until(
            lambda: restarted.events_named("checkpoint_conflict", checkpoint="checkpoint-60"),
            60,
            "the re-saved checkpoint-60 refused at start",
            details=restarted.log_text,
        )
        assert restarted.events_named("checkpoint_resaved_after_commit", checkpoint="checkpoint-60")
    latest, slots = stored(s3_client, s3_prefix)
    assert latest == "checkpoint-60"
    assert slots["checkpoint-60"] == local_files(root / "kept" / "checkpoint-60-life-0")
    assert json.loads((run / "checkpoint-60" / "trainer_state.json").read_text())["life"] == 1
