"""``ckptd status`` as a rich table (ckptd/cli/statusview.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from ckptd.cli.humanize import human_bytes, human_seconds
from ckptd.cli.statusview import progress_text, render_status
from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import run_cli, wait_until
from tests.support.ops import hf_daemon
from tests.support.writers import write_hf

GiB = 1024**3


def render(doc: dict[str, Any], width: int = 160) -> str:
    out = io.StringIO()
    render_status(doc, Console(file=out, width=width, color_system=None, force_terminal=False))
    return out.getvalue()


def status_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "runs": {
            "run1": {
                "dir": "/data/ckpt/run1",
                "layout": "auto",
                "pending": ["checkpoint-20", "checkpoint-30"],
                "uploading": {
                    "checkpoint": "checkpoint-20",
                    "bytes_total": 4 * GiB,
                    "bytes_sent": 1 * GiB,
                },
                "last_committed": {
                    "checkpoint": "checkpoint-10",
                    "step": 10,
                    "bytes": 4 * GiB,
                    "committed_at": "2026-12-02T12:00:09Z",
                },
                "failed": {},
                "sync_lag_seconds": 754.2,
            },
            "eval": {
                "dir": "/data/ckpt/eval",
                "layout": "hf",
                "pending": [],
                "uploading": None,
                "last_committed": None,
                "failed": {"checkpoint-3": "AccessDenied"},
                "sync_lag_seconds": 0,
            },
        },
        "destination": {"url": "s3://bucket/prefix", "ok": True},
        "preemption": {"notice": False},
    }
    doc.update(overrides)
    return doc


def test_table_shows_run_pending_progress_last_commit_and_lag() -> None:
    text = render(status_doc())
    for header in ("RUN", "PENDING", "UPLOADING", "LATEST", "LAG", "FAILED"):
        assert header in text
    row = next(line for line in text.splitlines() if "run1" in line)
    assert "│ 2 " in row or " 2 │" in row  # two pending
    assert "checkpoint-20" in row and "25%" in row and "1.0 GiB/4.0 GiB" in row
    assert "checkpoint-10 (step 10)" in row
    assert "12m34s" in row
    assert "2026-12-02T12:00:09Z" in text
    assert "destination: s3://bucket/prefix  ok" in text
    assert "notice: none" in text
    # Runs are sorted; the idle run shows dashes and its failure count.
    eval_row = next(line for line in text.splitlines() if "eval" in line)
    assert text.index("eval") < text.index("run1")
    assert eval_row.count("-") >= 2 and " 1 " in eval_row


def test_notice_and_unreachable_destination_stand_out() -> None:
    doc = status_doc(
        destination={"url": "s3://bucket/prefix", "ok": False},
        preemption={
            "notice": True,
            "source": "aws",
            "kind": "terminate",
            "deadline": "2026-12-02T12:02:00Z",
            "noticed_at": "2026-12-02T12:00:00Z",
        },
    )
    text = render(doc)
    assert "UNREACHABLE" in text
    assert "notice: aws/terminate" in text
    assert "deadline 2026-12-02T12:02:00Z" in text
    out = io.StringIO()
    render_status(doc, Console(file=out, width=160, force_terminal=True, color_system="standard"))
    assert "\x1b[" in out.getvalue()  # colour on a terminal


def test_empty_and_sparse_documents_render() -> None:
    assert "no runs watched" in render({"runs": {}})
    assert "notice: none" in render({})
    sparse = {"runs": {"r": {"pending": None, "uploading": {"checkpoint": "c"}}}}
    assert "0%" in render(sparse)


def test_helpers() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_seconds(0) == "0s"
    assert human_seconds(75) == "1m15s"
    assert human_seconds(3 * 3600 + 120) == "3h02m"
    assert progress_text(None).plain == "-"
    bar = progress_text({"checkpoint": "c", "bytes_total": 10, "bytes_sent": 20}).plain
    assert "100%" in bar  # never more than all of it


def test_renders_a_live_daemons_status(tmp_path: Path, local_s3: LocalS3, s3_dest: str) -> None:
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest)
    with daemon:
        write_hf(root, 10)
        wait_until(
            lambda: (
                (daemon.get_json("/v1/status")["runs"]["run1"]["last_committed"] or {}).get("step")
                == 10
            ),
            30,
            "commit",
        )
        text = render(daemon.get_json("/v1/status"))
        assert daemon.stop() == 0
    assert "checkpoint-10 (step 10)" in text
    assert s3_dest in text


def test_ckptd_status_prints_the_rich_table(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """``ckptd status`` (no --json) renders through statusview; --json is unchanged."""
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest)
    with daemon:
        write_hf(root, 10)
        wait_until(
            lambda: daemon.metric("ckptd_checkpoints_committed_total", run="run1") >= 1,
            30,
            "commit",
        )
        table = run_cli("status", config=daemon.config, timeout=60)
        as_json = run_cli("status", "--json", config=daemon.config, timeout=60)
        assert daemon.stop() == 0
    assert table.returncode == 0, table.stderr
    for header in ("RUN", "PENDING", "UPLOADING", "LATEST", "LAG"):
        assert header in table.stdout, table.stdout
    assert "checkpoint-10 (step 10)" in table.stdout
    assert "notice: none" in table.stdout
    assert json.loads(as_json.stdout)["runs"]["run1"]["last_committed"]["step"] == 10
    assert json.loads(as_json.stdout)["runs"]["run1"]["latest"]["checkpoint"] == "checkpoint-10"


def test_the_latest_column_shows_what_latest_names_not_the_last_commit_in_time() -> None:
    """A backlog shipped 20 then 10 (or an abandoned trajectory's checkpoint committed
    last): the column names what LATEST names, and the other commit beneath it."""
    doc = status_doc()
    run = doc["runs"]["run1"]
    run["latest"] = {
        "checkpoint": "checkpoint-20",
        "step": 20,
        "committed_at": "2026-12-02T12:00:05Z",
    }
    text = render(doc)
    row = next(line for line in text.splitlines() if "run1" in line)
    assert "checkpoint-20 (step 20)" in row
    assert "last commit: checkpoint-10" in text


def test_the_supervised_trainer_renders_under_exec_only() -> None:
    assert "trainer:" not in render({})
    trainer = {
        "pid": 4242,
        "starts": 3,
        "restarts": 2,
        "max_restarts": 10,
        "last_exit": {"code": -9, "cause": "signal:SIGKILL"},
        "resumed_from": "step-40",
        "gave_up": None,
    }
    text = render({"trainer": trainer})
    assert "trainer: pid 4242  starts 3  restarts 2/10  last exit signal:SIGKILL" in text
    assert "resumed from step-40" in text
    gave_up = render({"trainer": {**trainer, "pid": None, "gave_up": "failed at start-up"}})
    assert "not running" in gave_up and "gave up: failed at start-up" in gave_up
    restored = {"checkpoint": "step-40", "skipped": False, "tier": "peers"}
    restored |= {"peer_bytes": 3 << 30, "store_bytes": 512 << 20}
    text = render({"trainer": {**trainer, "restored": restored}}, width=220)
    assert (
        f"restored step-40 from peers ({human_bytes(3 << 30)} from peers, "
        f"{human_bytes(512 << 20)} from the store)"
    ) in text
    skipped = {"checkpoint": "step-40", "skipped": True, "seconds": 0.0}
    assert "restored step-40" not in render({"trainer": {**trainer, "restored": skipped}})


def test_each_further_tier_shows_reachability_backlog_and_last_commit() -> None:
    def tier(url: str, ok: bool, pending: list[str], last: str | None) -> dict[str, Any]:
        run = {"pending": pending, "last_committed": last and {"checkpoint": last}}
        return {"destination": {"url": url, "ok": ok}, "runs": {"run1": run}}

    doc = status_doc(
        tiers={
            "nfs": tier("file:///mnt/nfs", True, [], "checkpoint-20"),
            "s3": tier("s3://b/p", False, ["checkpoint-20", "checkpoint-30"], "checkpoint-10"),
        }
    )
    text = render(doc)
    line = next(line for line in text.splitlines() if line.startswith("tier s3"))
    assert "s3://b/p" in line and "UNREACHABLE" in line
    assert "run1: last checkpoint-10, 2 behind" in line
    assert not any(line.startswith("tier nfs") for line in text.splitlines())  # the first
    doc["tiers"]["s3"]["destination"]["error"] = "access to bucket 'b' denied"
    assert "UNREACHABLE: access to bucket 'b' denied" in render(doc)


def test_a_checkpoint_given_up_is_named_with_why() -> None:
    text = render(status_doc())
    assert "given up: eval/checkpoint-3: AccessDenied" in text
    assert "tier" not in render(status_doc())  # one destination: no tier lines


def test_status_names_why_the_destination_is_unreachable_and_counts_failures_as_the_metric(
    tmp_path: Path, local_s3: LocalS3, missing_bucket: str
) -> None:
    """Against a bucket that does not exist, ``ckptd status`` once showed UNREACHABLE with
    no cause and FAILED 0 while ``ckptd_checkpoints_failed_total{reason="unusable"}`` grew:
    the column counted checkpoints given up (a many-node conflict), the metric every failed
    attempt. The cause is shown, and the column is the metric's count."""
    daemon, root = hf_daemon(tmp_path, local_s3, f"s3://{missing_bucket}/p")
    with daemon:
        write_hf(root, 10)
        wait_until(
            lambda: (
                daemon.metric("ckptd_checkpoints_failed_total", run="run1", reason="unusable") >= 2
            ),
            60,
            "two failed attempts",
        )
        before = daemon.metric("ckptd_checkpoints_failed_total", run="run1", reason="unusable")
        doc = daemon.get_json("/v1/status")
        table = run_cli("status", config=daemon.config, env={"COLUMNS": "200"}, timeout=60)
        after = daemon.metric("ckptd_checkpoints_failed_total", run="run1", reason="unusable")
        assert daemon.stop() == 0
    failures = doc["runs"]["run1"]["failures"]
    assert before <= failures["count"] <= after
    assert failures["by_reason"]["unusable"] == failures["count"]
    assert failures["last"]["checkpoint"] == "checkpoint-10"
    assert "NoSuchBucket" in failures["last"]["error"]
    assert f"bucket '{missing_bucket}' does not exist" in doc["destination"]["error"]
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if x.startswith("destination:"))
    assert f"UNREACHABLE: bucket '{missing_bucket}' does not exist" in line, table.stdout
    row = next(x for x in table.stdout.splitlines() if "run1" in x and "│" in x)
    assert row.rstrip(" │").split()[-1].isdigit()
    assert before <= int(row.rstrip(" │").split()[-1]) <= after + 1
    assert "failing: run1/checkpoint-10 (unusable" in table.stdout
