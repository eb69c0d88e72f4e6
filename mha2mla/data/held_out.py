"""Token slices of a text file: the project's held-out evaluation slices and a user's own text.

The held-out slice of a text starts ``start_fraction`` (a third) of the way in, on a line boundary; it is never
used for calibration (the bundled sample or the first part of a file) nor for recovery training. The texts
themselves (King James Bible, Python 3.11 docs) are fetched into the cache by ``make assets``
(``mha2mla.io.cache.cached_held_out_text`` returns their files); any other text file works the same way.
"""

from __future__ import annotations

from pathlib import Path

from mha2mla import UserError

CHARS_PER_TOKEN = 8  # a generous bound: tokenise this many characters per wanted token, then cut


def _read_text(path: str | Path) -> str:
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise UserError(f"text file {path} {what}; pass the path of a UTF-8 text file.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; convert it to UTF-8 or pass another file.") from None


def text_token_ids(tokenizer, path: str | Path, max_tokens: int, start_fraction: float = 0.0) -> list[int]:
    """Up to ``max_tokens`` token ids of the text in ``path``, from ``start_fraction`` of the way in (by characters,
    moved forward to the next line start when above 0)."""
    text = _read_text(path)
    start = 0
    if start_fraction > 0:
        start = text.find("\n", int(len(text) * start_fraction)) + 1  # begin on a line boundary
    window = text[start : start + max_tokens * CHARS_PER_TOKEN]
    return tokenizer(window, add_special_tokens=False)["input_ids"][:max_tokens]


def held_out_token_ids(tokenizer, path: str | Path, num_tokens: int = 16384, start_fraction: float = 1 / 3) -> list[int]:
    """Exactly ``num_tokens`` token ids of the text in ``path``, starting ``start_fraction`` of the way in.

    This is the evaluation slice used throughout the project's benchmarks (16,384 tokens from a third of the
    way into the KJV or the Python docs).
    """
    ids = text_token_ids(tokenizer, path, num_tokens, start_fraction)
    if len(ids) < num_tokens:
        raise UserError(f"{path} has fewer than {num_tokens} tokens after its start point; pass a longer text.")
    return ids
