"""A watch dir that does not exist when the daemon starts (the trainer creates it
later, or it is restored into place by a rename) is watched from the tick it appears,
and what it already holds then is shipped at once, not at the next periodic rescan."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.daemon import Daemon, wait_until
from tests.support.writers import write_hf


def test_checkpoints_in_a_watch_dir_that_appears_later_ship_at_once(tmp_path: Path) -> None:
    run = tmp_path / "watch" / "run"
    store = tmp_path / "store"
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": run, "settle_seconds": 0, "rescan_seconds": 600}],
        dest=f"file://{store}",
        state_dir=tmp_path / "state",
    )
    with daemon:
        wait_until(lambda: daemon.events_named("watch_dir_missing"), 10, "the missing dir said")
        staged = tmp_path / "staged"
        write_hf(staged, 7)
        shutil.move(staged, run)  # appears whole, checkpoint and all, in one rename
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-7"),
            10,  # the periodic rescan is 600 s away: only the new watch's first look counts
            "the checkpoint committed",
            details=daemon.log_text,
        )
    assert (store / "run" / "checkpoint-7" / "ckptd.manifest.json").is_file()
