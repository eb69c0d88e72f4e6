"""Four-way "which passage continues this one?" items, built from a cached text with a fixed seed.

The unseen-domain multiple-choice tasks (``fortunes_mc``, ``debian_policy_mc``; docs/eval.md) are made of them:
a paragraph of the text is cut at the space nearest its middle; the first half is the context, its own second half
the answer, and the second halves of three other paragraphs of the same text (of similar length, so length alone
does not give the answer away) the distractors. Nothing is shipped: the items are rebuilt from the cached text at
task-build time, the same for the same text and seed. Paragraphs are taken from the last third of the text, so no
item repeats a passage of the perplexity documents, which start a third of the way in and span about 64k
characters (``tasks.held_out_documents``).
"""

from __future__ import annotations

import random

from mha2mla import UserError

START_FRACTION = 2 / 3  # where the paragraphs start: past the perplexity documents of every cached text
NUM_ITEMS = 100  # items per text
SEED = 1234
PARAGRAPH_CHARACTERS = (120, 600)  # a paragraph this long (inclusive) makes an item: a sentence or two each side
LENGTH_RATIO = 2.0  # a distractor's second half is at most this many times longer or shorter than the answer


def paragraphs(text: str) -> list[str]:
    """The blank-line-separated paragraphs of ``text`` from START_FRACTION on (beginning on a line boundary) whose
    length lies in PARAGRAPH_CHARACTERS, first occurrence only."""
    start = text.find("\n", int(len(text) * START_FRACTION)) + 1
    shortest, longest = PARAGRAPH_CHARACTERS
    blocks = (block.strip("\n") for block in text[start:].split("\n\n"))
    kept = [block for block in blocks if shortest <= len(block) <= longest and _word_gaps(block)]
    return list(dict.fromkeys(kept))


def _word_gaps(paragraph: str) -> list[int]:
    """Positions of the single spaces between two words (not in indentation or runs of spaces)."""
    return [
        i
        for i in range(1, len(paragraph) - 1)
        if paragraph[i] == " " and not paragraph[i - 1].isspace() and not paragraph[i + 1].isspace()
    ]


def split_at_middle(paragraph: str) -> tuple[str, str]:
    """``paragraph`` cut at the single space between words nearest its middle: (context, continuation), the space
    dropped (lm-eval puts it back as the target delimiter), so ``context + " " + continuation == paragraph``."""
    middle = len(paragraph) // 2
    cut = min(_word_gaps(paragraph), key=lambda i: (abs(i - middle), i))
    return paragraph[:cut], paragraph[cut + 1 :]


def continuation_items(text: str, num_items: int = NUM_ITEMS, seed: int = SEED) -> list[dict]:
    """``num_items`` items ``{"context", "choices" (four continuations), "answer" (index of the true one)}`` from
    ``text``; a UserError when it has too few paragraphs."""
    pairs = [split_at_middle(paragraph) for paragraph in paragraphs(text)]
    if len(pairs) < num_items + 3:
        raise UserError(f"the text has {len(pairs)} paragraphs of {PARAGRAPH_CHARACTERS[0]}-{PARAGRAPH_CHARACTERS[1]} "
                        f"characters in its last third; {num_items + 3} are needed for {num_items} items.")
    rng = random.Random(seed)
    items = []
    for index in rng.sample(range(len(pairs)), num_items):
        context, ending = pairs[index]
        similar = [
            other
            for j, (_, other) in enumerate(pairs)
            if j != index and other != ending and 1 / LENGTH_RATIO <= len(other) / len(ending) <= LENGTH_RATIO
        ]
        if len(set(similar)) < 3:  # an unusually long or short answer: any other ending will do
            similar = [other for j, (_, other) in enumerate(pairs) if j != index and other != ending]
        choices = rng.sample(sorted(set(similar)), 3)
        answer = rng.randrange(4)
        choices.insert(answer, ending)
        items.append({"context": context, "choices": choices, "answer": answer})
    return items
