"""``python -m ckptd``: the process's entry, which ends a finished ``restore`` or ``run --once``
with ``os._exit`` past the interpreter's teardown (``ckptd.cli.main.entry``)."""

from ckptd.cli.main import entry

entry()
