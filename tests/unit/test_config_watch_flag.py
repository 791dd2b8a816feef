"""``--watch DIR`` over a config file that watches the same directory keeps that entry's
settings (issue 45: the file's ``layout = "hf"`` and ``run_id`` were dropped, and the run
took the directory's name): the flags' own settings over the file's, other directories
still replaced."""

from __future__ import annotations

from pathlib import Path

from ckptd.config import load_settings


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(text)
    return path


def test_watch_flag_keeps_the_files_settings_for_that_dir(tmp_path: Path) -> None:
    config = _file(
        tmp_path,
        f'[[watch]]\ndir = "{tmp_path}/ckpt/run1"\nrun_id = "llama-7b"\nlayout = "hf"\n'
        'settle_seconds = 7\n[[watch]]\ndir = "/elsewhere/run2"\n',
    )
    settings = load_settings(
        config, overrides={"watch": [{"dir": str(tmp_path / "ckpt" / "run1")}]}, environ={}
    )
    (watch,) = settings.watch  # the other directory is still replaced
    assert watch.effective_run_id == "llama-7b"
    assert watch.layout == "hf" and watch.settle_seconds == 7


def test_the_flags_own_settings_win_over_the_files(tmp_path: Path) -> None:
    config = _file(tmp_path, f'[[watch]]\ndir = "{tmp_path}/run1"\nrun_id = "a"\nlayout = "hf"\n')
    settings = load_settings(
        config,
        overrides={"watch": [{"dir": str(tmp_path / "run1"), "run_id": "b", "layout": "dcp"}]},
        environ={},
    )
    (watch,) = settings.watch
    assert (watch.effective_run_id, watch.layout) == ("b", "dcp")


def test_another_dir_takes_nothing_from_the_file(tmp_path: Path) -> None:
    config = _file(tmp_path, f'[[watch]]\ndir = "{tmp_path}/run1"\nlayout = "hf"\n')
    settings = load_settings(
        config, overrides={"watch": [{"dir": str(tmp_path / "run2")}]}, environ={}
    )
    (watch,) = settings.watch
    assert watch.effective_run_id == "run2" and watch.layout == "auto"
