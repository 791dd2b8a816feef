"""A trainer that installs ckptd's listener, says ``ready``, sees the notice, and exits
normally; the test keeps signalling it until it is gone."""

from __future__ import annotations

import sys
import time

import ckptd.trainer


def main() -> None:
    ckptd.trainer.install(sys.argv[1])
    print("ready", flush=True)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # the training loop, saving on the notice
        ckptd.trainer.preempted()
        time.sleep(0.01)
    assert ckptd.trainer.preempted()


if __name__ == "__main__":
    main()
