"""How ``scripts/assets.py`` (``make assets``) fetches: one command run, its failure one ``AssetError`` saying what
to fix, and a Debian package downloaded at its pinned version with ``apt-get download`` (nothing is installed) and
unpacked with ``dpkg-deb``. No entry point: scripts/assets.py imports it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


class AssetError(RuntimeError):
    """A fetch failed; the message says what and how to fix it."""


def run_command(cmd: list[str], cwd: Path) -> None:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssetError(f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-300:]}); check access to the package registry.")


# The Debian package versions the texts were measured with (docs/benchmarks.md). A later version changes its text
# (python3.11-doc's deb12u9 security update moved the Python docs' held-out slice: source perplexity 12.752 -> 12.767),
# and with it every figure scored on it; a pinned version the registry no longer has falls back to its current one,
# with a warning.
PINNED = {
    "bible-kjv-text": "4.38", "bible-kjv": "4.38", "python3.11-doc": "3.11.2-6+deb12u8",
    "fortunes": "1:1.99.1-7.3", "debian-policy": "4.6.2.0",
    "r-cran-janeaustenr": "1.0.0-1", "c++-annotations-txt": "12.2.0-2", "git-doc": "1:2.39.5-0+deb12u3",
}


def apt_download(spec: str, cwd: Path) -> bool:
    """``apt-get download SPEC`` into ``cwd``, once more after refreshing the package lists; True when it worked."""
    for attempt in range(2):
        if subprocess.run(["apt-get", "download", "-q", spec], cwd=cwd, capture_output=True).returncode == 0:
            return True
        if attempt == 0:  # package lists may be missing or stale on a fresh machine
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
    return False


def apt_extract(package: str, dest: Path) -> str:
    """Download one Debian package at its pinned version (no install) and extract it into ``dest``; return the
    version fetched."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise AssetError(
            f"the held-out texts come from the Debian package {package}, which needs apt-get and dpkg-deb; "
            "fetch them on a Debian/Ubuntu machine and copy the cache's text/ folder, or use `mha2mla eval --text FILE`."
        )
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pinned = f"{package}={PINNED[package]}"
        if not apt_download(pinned, Path(tmp)):
            print(f"warning: the registry has no {pinned}; fetching its current version, whose text may differ "
                  "from the one docs/benchmarks.md was measured on.", file=sys.stderr)
            run_command(["apt-get", "download", "-q", package], Path(tmp))
        deb = glob.glob(os.path.join(tmp, "*.deb"))[0]
        run_command(["dpkg-deb", "-x", deb, str(dest)], Path(tmp))
        version = subprocess.run(["dpkg-deb", "-f", deb, "Version"], capture_output=True, text=True)
        return version.stdout.strip()
