"""ckptd's optional extras: what each installs, and the one-line hint that names it.

ckptd is not on a package index: it is installed from its checkout or from a wheel built
there (docs/operations.md, "Installing"). So a missing extra is named by the packages
it installs, which any index has, and by how to reinstall ckptd with it from its
checkout. ``pyproject.toml``'s ``[project.optional-dependencies]`` must say the same
(``tests/unit/test_store_extras.py`` compares them).
"""

from __future__ import annotations

EXTRAS: dict[str, tuple[str, ...]] = {
    "gcs": ("google-auth>=2.30", "requests>=2.31"),
    "azure": ("azure-storage-blob>=12.26", "azure-identity>=1.19"),
    "report": ("plotly>=6",),
    "nvml": ("nvidia-ml-py>=12",),
}


def install_hint(extra: str) -> str:
    """How to get ``extra``'s packages, in one line."""
    packages = " ".join(f"'{p}'" for p in EXTRAS[extra])
    return (
        f"ckptd's [{extra}] extra: pip install {packages} "
        f"(or, in ckptd's checkout, pip install '.[{extra}]')"
    )


__all__ = ["EXTRAS", "install_hint"]
