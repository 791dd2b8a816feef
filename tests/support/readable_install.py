"""ckptd installed where another user can run it, for the tests that run it as another uid.

Those tests (``setpriv --reuid``) cannot run this interpreter's ckptd: the checkout, its
``.venv`` and the interpreter's own prefix (pyenv under ``/root``, say) may be readable by
root alone, as they are when the repository is cloned into a ``mktemp -d`` (mode 0700).
So ckptd is brought to such a user: a venv in a world-readable temporary directory, over
an interpreter of this Python version that every user can read, holding a copy of the
ckptd package under test and of the distributions it needs at run time (the same files
this interpreter imports, so the versions cannot differ).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

import ckptd


class NotReadable(Exception):
    """No copy another user could run can be made here; the message says why, in one line."""


def readable_by_others(path: Path) -> bool:
    """Whether a user with no relation to the owner can reach ``path`` and read it."""
    path = path.resolve()
    for parent in path.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            return False
    mode = path.stat().st_mode
    wanted = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & wanted == wanted


def _ask(python: str, code: str) -> str:
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def readable_interpreter() -> str:
    """An interpreter of this very Python version whose binary and standard library every
    user can read: this venv's base interpreter if it is, else the system's."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = getattr(sys, "_base_executable", sys.executable)
    candidates = [
        os.path.realpath(base),
        f"/usr/local/bin/python{version}",
        f"/usr/bin/python{version}",
    ]
    for candidate in dict.fromkeys(candidates):
        path = Path(candidate)
        if not path.is_file() or not readable_by_others(path):
            continue
        if not path.stat().st_mode & stat.S_IXOTH:
            continue
        found, stdlib = _ask(
            candidate,
            "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]); "
            "print(sysconfig.get_path('stdlib'))",
        ).splitlines()
        if found == version and readable_by_others(Path(stdlib)):
            return os.path.realpath(candidate)
    raise NotReadable(
        f"no Python {version} that other users can read (this one is {os.path.realpath(base)}, "
        f"tried {', '.join(candidates[1:])})"
    )


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def runtime_distributions() -> list[metadata.Distribution]:
    """The installed distributions ckptd needs at run time (its requirements without extras,
    and theirs), ckptd itself excluded."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(metadata.requires("ckptd") or [])
    while todo:
        requirement = Requirement(todo.pop())
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        if _name(requirement.name) in found:
            continue
        distribution = metadata.distribution(requirement.name)
        found[_name(requirement.name)] = distribution
        todo.extend(distribution.requires or [])
    return list(found.values())


def _place_readable(source: Path, target: Path) -> None:
    """A hard link where the file is already readable by everyone (same inode, instant),
    else a copy made readable; mtimes are kept either way, so compiled .pyc stay valid."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.stat().st_mode & stat.S_IROTH:
        try:
            os.link(source, target)
            return
        except OSError:  # another filesystem, or links refused: copy instead
            pass
    shutil.copy2(source, target)
    target.chmod(0o755 if source.stat().st_mode & stat.S_IXUSR else 0o644)


def install_readable_ckptd(root: Path) -> list[str]:
    """Make the venv under ``root`` (which must be readable by others) and return the
    command that starts ckptd there, as ``[python, "-m", "ckptd"]``."""
    if not readable_by_others(root):
        raise NotReadable(f"{root} is not reachable by other users")
    venv = root / "venv"
    subprocess.run(
        [readable_interpreter(), "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        check=True,
        timeout=120,
    )
    python = str(venv / "bin" / "python")
    site = Path(_ask(python, "import sysconfig; print(sysconfig.get_path('purelib'))"))
    package = Path(ckptd.__file__).parent
    for source in package.rglob("*"):
        if source.is_file() and "__pycache__" not in source.parts:
            _place_readable(source, site / "ckptd" / source.relative_to(package))
    for distribution in runtime_distributions():
        for file in distribution.files or []:
            source = Path(str(distribution.locate_file(file)))
            if ".." not in file.parts and source.is_file():
                _place_readable(source, site / file)
    for directory, _, _ in os.walk(root):
        Path(directory).chmod(0o755)
    # The other user cannot write __pycache__ here: compile ckptd once, now, as root.
    subprocess.run([python, "-m", "compileall", "-q", str(site / "ckptd")], check=True, timeout=300)
    return [python, "-m", "ckptd"]
