"""The unseen-domain yardstick: the continuation items, the tasks lm-eval runs
offline on a tiny random model, and the in-domain / unseen labels of the report.

Synthetic texts stand in for the fetched ones in a temporary MHA2MLA_CACHE, so nothing is fetched.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from common import build_source

from mha2mla import UserError

WORDS = "the law of love and verse keeps every package whole while wisdom must answer a quiet song".split()


def _paragraph_text(seed: int, paragraphs: int = 700) -> str:
    """Paragraphs of 6-14 lines of random words (about 120-420 characters each), a blank line between them."""
    rng = random.Random(seed)
    blocks = []
    for _ in range(paragraphs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(rng.randint(4, 8))]
        blocks.append(f"{rng.randint(0, 99999)} " + "\n".join(lines) + ".")
    return "\n\n".join(blocks) + "\n"


@pytest.fixture()
def unseen_cache(tmp_path, monkeypatch):
    """A private MHA2MLA_CACHE holding synthetic unseen-domain texts (and no in-domain ones)."""
    (tmp_path / "text").mkdir()
    for seed, name in enumerate(("fortunes", "debian_policy")):
        (tmp_path / "text" / f"{name}.txt").write_text(_paragraph_text(seed), encoding="utf-8")
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    return tmp_path


# ---------------------------------------------------------------- the continuation items


def test_continuation_items_are_seeded_and_each_answer_is_the_true_continuation():
    from mha2mla.evaluation.continuation_items import continuation_items, paragraphs

    text = _paragraph_text(3)
    items = continuation_items(text, num_items=40, seed=5)
    assert items == continuation_items(text, num_items=40, seed=5)
    assert items != continuation_items(text, num_items=40, seed=6)
    kept = set(paragraphs(text))
    assert all(len(item["choices"]) == len(set(item["choices"])) == 4 for item in items)
    for item in items:  # the context and its answer rebuild a paragraph of the text; no distractor does
        rebuilt = [f"{item['context']} {choice}" in kept for choice in item["choices"]]
        assert rebuilt == [i == item["answer"] for i in range(4)]
    assert {item["answer"] for item in items} == {0, 1, 2, 3}
    start = text.find("\n", int(len(text) * 2 / 3)) + 1
    assert all(text.find(item["context"]) >= start for item in items)  # from the last third only
    with pytest.raises(UserError, match="paragraphs"):
        continuation_items(text[: len(text) // 4], num_items=100)


# ---------------------------------------------------------------- tasks, defaults and labels


def test_default_tasks_include_the_unseen_ones_when_their_texts_are_cached(unseen_cache, monkeypatch, capsys):
    from mha2mla.evaluation.tasks import bundled_task_dir, check_tasks, parse_task_list, task_domain, task_manager

    assert parse_task_list(None) == ["fortunes_ppl", "debian_policy_ppl", "fortunes_mc", "debian_policy_mc",
                                     "mmlu_dev_mc", "mmlu_dev_cloze"]
    folder = bundled_task_dir()
    items = [json.loads(line) for line in (folder / "fortunes_mc.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(items) == 100 and all(set(item) == {"context", "choices", "answer"} for item in items)
    assert [task_domain(t) for t in ("kjv_ppl", "python_docs_ppl", "fortunes_ppl", "debian_policy_mc", "mmlu_dev_mc",
                                     "arc_easy", "text:notes.txt", "model")] == [
        "in-domain", "in-domain", "unseen", "unseen", "unseen", "unseen", "", ""]
    (unseen_cache / "text" / "fortunes.txt").unlink()
    assert "fortunes_mc" not in parse_task_list(None)
    assert not (bundled_task_dir() / "fortunes_mc.jsonl").exists()
    with pytest.raises(UserError, match="^task 'fortunes_mc' needs the fortune-mod quotations and verse text in "):
        check_tasks(["fortunes_mc"], task_manager(), offline=True)


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) as lm-eval's HF model scores it: the pair encoded whole, no special tokens, the
    continuation's tokens those after the context's own encoding."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))


def test_unseen_tasks_run_offline_and_score_the_items_as_written(unseen_cache, tmp_path):
    """lm-eval runs the perplexity and continuation tasks offline; its accuracy on the first items equals the
    argmax of each choice's log-likelihood after the context and a space, computed here by hand."""
    from mha2mla.evaluation import evaluate_model, load_model, task_manager

    loaded = load_model(build_source(tmp_path / "source", family="llama"), device="cpu")
    limit = 12
    scores = evaluate_model(loaded.model, loaded.tokenizer, ["fortunes_ppl", "fortunes_mc"], limit=limit,
                            task_manager=task_manager())
    assert scores["n_samples"] == {"fortunes_ppl": limit, "fortunes_mc": limit}
    assert scores["results"]["fortunes_ppl"]["bits_per_byte"] > 0
    items = [json.loads(line) for line in (unseen_cache / "eval_tasks" / "fortunes_mc.jsonl").open()][:limit]
    right, right_norm = 0, 0
    for item in items:
        scored = [_loglikelihood(loaded.model, loaded.tokenizer, item["context"], " " + c) for c in item["choices"]]
        right += max(range(4), key=lambda i: scored[i]) == item["answer"]
        right_norm += max(range(4), key=lambda i: scored[i] / len(item["choices"][i])) == item["answer"]
    assert scores["results"]["fortunes_mc"]["acc"] == pytest.approx(right / limit)
    assert scores["results"]["fortunes_mc"]["acc_norm"] == pytest.approx(right_norm / limit)


def test_report_labels_rows_and_groups_them_by_domain(tmp_path):
    from mha2mla.evaluation.report import write_report

    def result(name, role, scale):
        tasks = {"mmlu_dev_mc": {"acc": 0.3}, "fortunes_ppl": {"word_perplexity": 30.0 * scale, "bits_per_byte": 1.0},
                 "kjv_ppl": {"word_perplexity": 20.0 * scale, "bits_per_byte": 0.9},
                 "text:notes.txt": {"token_perplexity": 9.0 * scale}}
        return {"name": name, "path": f"/m/{name}", "role": role, "shown": list(tasks), "tasks": tasks,
                "measurements": {"kv_cache_values_per_token": 100, "dtype": "float32"}}

    report = write_report([result("source", "source", 1.0), result("healed", "model", 2.0)], {}, tmp_path)
    lines = report["markdown"].splitlines()
    assert lines[0] == "| domain | task | metric | source | converted | delta |"
    assert [line.split(" | ")[:2] for line in lines[2:8]] == [
        ["| in-domain", "kjv_ppl"], ["| in-domain", "kjv_ppl"], ["| unseen", "mmlu_dev_mc"],
        ["| unseen", "fortunes_ppl"], ["| unseen", "fortunes_ppl"], ["| ", "text:notes.txt"]]
    assert lines[5] == "| unseen | fortunes_ppl | word_perplexity | 30 | 60 | +30 (×2) |"
    rows = json.loads((tmp_path / "results.json").read_text())["table"]
    assert [(row["task"], row["domain"]) for row in rows if row["metric"] in ("acc", "word_perplexity")] == [
        ("kjv_ppl", "in-domain"), ("mmlu_dev_mc", "unseen"), ("fortunes_ppl", "unseen")]
    assert all(row["domain"] == "" for row in rows if row["task"] == "model")
