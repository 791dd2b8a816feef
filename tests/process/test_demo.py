"""README's quick start: `make demo` commits, lists and verifies three checkpoints.

The README block is marked skip in the docs test (``test_docs_as_written.py``): make
installs ./.venv first, which needs the network. This runs the command it then runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.process.test_docs_as_written import clean_environment


def test_the_quick_start_demo_commits_lists_and_verifies_three_checkpoints(
    tmp_path: Path,
) -> None:
    """README: "3 checkpoints committed, listed, verified"."""
    done = subprocess.run(
        [sys.executable, "-m", "ckptd.devtools.demo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_environment(),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert 'ckptd_checkpoints_committed_total{run="demo-run"} 3.0' in done.stdout
    assert "demo done" in done.stdout
