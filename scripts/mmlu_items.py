"""Rebuild mha2mla/data/tasks/mmlu_dev.jsonl, the bundled MMLU dev items, from the copy that lm-evaluation-harness
ships: ``python scripts/mmlu_items.py`` writes it, ``python scripts/mmlu_items.py --check`` only says whether the
shipped file equals what lm-eval's copy gives (exit 1 when not).

lm-eval carries the five MMLU *dev* questions of each of the 57 subjects as few-shot examples of its
``mmlu_flan_cot_fewshot`` tasks (``lm_eval/tasks/mmlu/flan_cot_fewshot/mmlu_<subject>.yaml``). We keep the
question, the four choices and the answer letter (MMLU is MIT-licensed, Hendrycks et al. 2021) and drop
the chain-of-thought rationales. This is an entry point: nothing imports it; ``mha2mla eval`` reads the file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

MMLU_DEV_FILE = Path(__file__).resolve().parent.parent / "mha2mla" / "data" / "tasks" / "mmlu_dev.jsonl"

# "<question>\n(A) <a> (B) <b> (C) <c> (D) <d>", choices split by a space or a newline;
# the question is greedy so an "(A)" inside it stays in the question.
_QUESTION = re.compile(
    r"^(?P<question>.*)\n\(A\) (?P<a>.*?)\s\(B\) (?P<b>.*?)\s\(C\) (?P<c>.*?)\s\(D\) (?P<d>.*)$", re.DOTALL
)
_ANSWER = re.compile(r"answer is \(([ABCD])\)")


def parse_item(subject: str, question: str, target: str) -> dict | None:
    """One MMLU item from a flan-cot few-shot sample, or None when the sample doesn't have the usual shape."""
    match = _QUESTION.match(question.strip())
    answers = _ANSWER.findall(target)
    if match is None or not answers:
        return None
    choices = [" ".join(match[key].split()) for key in "abcd"]
    return {
        "subject": subject,
        "question": match["question"].strip(),
        "choices": choices,
        "answer": "ABCD".index(answers[-1]),  # the rationale's last verdict is the answer
    }


def extract_mmlu_dev_items(lm_eval_tasks_dir: Path | None = None) -> tuple[list[dict], int]:
    """All parseable dev items (sorted by subject, in file order) and the number of samples skipped."""
    if lm_eval_tasks_dir is None:
        import lm_eval.tasks

        lm_eval_tasks_dir = Path(lm_eval.tasks.__file__).parent
    folder = Path(lm_eval_tasks_dir) / "mmlu" / "flan_cot_fewshot"
    items, skipped = [], 0
    for path in sorted(folder.glob("mmlu_*.yaml")):
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
        subject = config["dataset_name"]
        for sample in config.get("fewshot_config", {}).get("samples", []):
            item = parse_item(subject, sample["question"], sample["target"])
            if item is None:
                skipped += 1
            else:
                items.append(item)
    return items, skipped


def item_lines(items: list[dict]) -> str:
    """The items as the shipped file holds them: one JSON object per line."""
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    items, skipped = extract_mmlu_dev_items()
    if args.check:
        same = MMLU_DEV_FILE.read_text(encoding="utf-8") == item_lines(items)
        print(f"{MMLU_DEV_FILE} {'matches' if same else 'differs from'} lm-eval's {len(items)} items")
        return 0 if same else 1
    MMLU_DEV_FILE.write_text(item_lines(items), encoding="utf-8")
    print(f"wrote {len(items)} items to {MMLU_DEV_FILE} ({skipped} samples skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
