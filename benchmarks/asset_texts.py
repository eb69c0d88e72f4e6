"""How ``make assets`` (scripts/assets.py) cleans the texts it fetches from Debian packages into plain text: the
unseen-domain texts (the fortune files, the Debian Policy Manual; docs/eval.md) and the general healing texts (Jane
Austen's novels out of R's lazy-load database, the C++ Annotations, Git's manuals; docs/recover.md). Lab code: the
package only reads the cleaned files from the cache (``mha2mla.io.cache``, ``mha2mla.io.assets``).

``python benchmarks/asset_texts.py KIND FILE...`` prints the plain text of already downloaded files: ``plain`` (each
file's text), ``fortunes`` (fortune data files, entries interleaved) or ``austen`` (an ``Rdata.rdb``'s novels).
"""

from __future__ import annotations

import argparse
import struct
import sys
import zlib
from pathlib import Path

# The fortune-mod files read, in this order: quotations, aphorisms, verse and anecdotes (no computing, no definitions).
FORTUNE_FILES = ("people", "wisdom", "songs-poems", "humorists", "love", "education", "art", "politics", "law")


def plain_text(raw: str) -> str:
    """``raw`` with tabs expanded, trailing blanks removed and runs of blank lines cut to one, ending in a newline."""
    lines, blank = [], True  # True: drop blank lines at the start
    for line in raw.expandtabs(8).splitlines():
        line = line.rstrip()
        if line or not blank:
            lines.append(line)
        blank = not line
    return "\n".join(lines).strip("\n") + "\n"


def fortune_entries(raw: str) -> list[str]:
    """The entries of one fortune data file (separated by lines holding only ``%``), each as ``plain_text``."""
    entries, current = [], []
    for line in raw.splitlines() + ["%"]:
        if line.strip() == "%":
            if "".join(current).strip():
                entries.append(plain_text("\n".join(current)))
            current = []
        else:
            current.append(line)
    return entries


def fortunes_text(files: list[str]) -> str:
    """One text from the raw fortune files ``files``: their entries interleaved by position (an entry a fifth into
    its file sits beside the others' entries a fifth in, so every slice mixes the files), a blank line between."""
    parts = [fortune_entries(raw) for raw in files]
    keyed = [(i / len(part), f, entry) for f, part in enumerate(parts) for i, entry in enumerate(part)]
    return "\n".join(entry for _, _, entry in sorted(keyed, key=lambda item: item[:2]))



def r_character_vector(serialized: bytes) -> list[str]:
    """The strings of one R character vector serialized in R's XDR format (version 2 or 3), as a lazy-load database
    stores each object: header ``X\\n``, three version integers (and, in version 3, the native encoding's name), then
    the STRSXP (type 16) with its length and one CHARSXP (type 9: flags, byte length, bytes; length -1 is NA) per
    element. NA elements are skipped; anything else is a ValueError."""
    def integer(at: int) -> int:
        return struct.unpack(">i", serialized[at:at + 4])[0]

    if serialized[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    position = 14 if integer(2) == 2 else 18 + integer(14)  # past the versions (and the encoding's name)
    if integer(position) & 0xFF != 16:
        raise ValueError("the serialized object is not a character vector")
    count, position, strings = integer(position + 4), position + 8, []
    for _ in range(count):
        if integer(position) & 0xFF != 9:
            raise ValueError("a character vector element is not a CHARSXP")
        length = integer(position + 4)
        position += 8
        if length >= 0:
            strings.append(serialized[position:position + length].decode("utf-8", errors="replace"))
            position += length
    return strings


def r_lazy_load_vectors(database: bytes) -> list[list[str]]:
    """Every character vector stored in an R lazy-load database (``Rdata.rdb``: objects back to back, each a 4-byte
    big-endian length then a zlib stream of its serialization), in file order; other objects are skipped."""
    vectors, position = [], 0
    while position < len(database):
        stream = zlib.decompressobj()
        raw = stream.decompress(database[position + 4:])
        position = len(database) - len(stream.unused_data)
        try:
            vectors.append(r_character_vector(raw))
        except (ValueError, struct.error):
            continue
    return vectors


def novel_text(lines: list[str]) -> str:
    """A novel stored one printed line per element: paragraphs (runs of non-empty lines) joined into one line each,
    a blank line between them, as ``plain_text``."""
    paragraphs, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return plain_text("\n\n".join(paragraphs))


def austen_text(database: bytes) -> str:
    """Jane Austen's novels out of janeaustenr's ``Rdata.rdb``: one character vector per novel (the long ones; the
    package's other vectors are short tables), one printed line per element."""
    return "\n".join(novel_text(lines) for lines in r_lazy_load_vectors(database) if len(lines) > 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("plain", "fortunes", "austen"), help="how to read the files")
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    if args.kind == "austen":
        text = "".join(austen_text(path.read_bytes()) for path in args.files)
    else:
        raw = [path.read_text(encoding="utf-8", errors="replace") for path in args.files]
        text = fortunes_text(raw) if args.kind == "fortunes" else "".join(plain_text(item) for item in raw)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
