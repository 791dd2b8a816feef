"""``python -m ckptd ARGS...``, but importing ckptd from a given directory.

    python bench/_run_ckptd.py SRC_DIR ARGS...

The benchmark copies ckptd's sources once at its start and runs every ckptd measurement
from that copy, so all runs of one benchmark measure the same code even while the working
tree is being edited. ckptd is installed editable, and setuptools' editable finder sits on
``sys.meta_path`` ahead of ``sys.path``; it is removed here so the copy is what imports.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    src, args = sys.argv[1], sys.argv[2:]
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in f.__module__]
    sys.path.insert(0, src)
    sys.argv = ["ckptd", *args]
    runpy.run_module("ckptd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
