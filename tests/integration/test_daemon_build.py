"""The daemon's build (``ckptd.daemon.build``): everything that can fail before the daemon
runs fails there, and a build that fails leaves no lock held behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.config import ConfigError, Settings, load_settings
from ckptd.daemon.service import Service
from ckptd.runtime.instance import AlreadyRunningError


def settings_for(tmp_path: Path, *, tiers: list[dict[str, str]] | None = None) -> Settings:
    watch = tmp_path / "watch"
    watch.mkdir(exist_ok=True)
    return load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": "run", "layout": "marker"}],
            "destination": {"url": f"file://{tmp_path / 'store'}", "name": "nfs"},
            "tiers": tiers or [],
            "state": {"dir": str(tmp_path / "state")},
        },
        environ={},
    )


async def test_a_second_build_on_the_same_state_dir_stops_before_anything_runs(
    tmp_path: Path,
) -> None:
    first = Service(settings_for(tmp_path))
    try:
        with pytest.raises(AlreadyRunningError, match="already uses the state dir"):
            Service(settings_for(tmp_path))
    finally:
        await first.tiers.close()
        first.locks.release()
    again = Service(settings_for(tmp_path))  # the lock went with the first
    await again.tiers.close()
    again.locks.release()


async def test_a_build_that_fails_after_the_locks_lets_them_go(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, tiers=[{"name": "far", "url": f"file://{tmp_path / 'far'}"}])
    # The further tier's journal cannot be opened: <state>/tiers is a file.
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "tiers").write_text("not a dir")
    with pytest.raises(ConfigError, match="cannot open the journal"):
        Service(settings)
    (tmp_path / "state" / "tiers").unlink()
    service = Service(settings)  # neither the state dir's lock nor the watch dir's is held
    assert [t.name for t in service.tiers] == ["nfs", "far"]
    await service.tiers.close()
    service.locks.release()
