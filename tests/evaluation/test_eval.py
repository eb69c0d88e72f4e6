"""`mha2mla eval` on tiny random models: report files, equality with a direct lm-eval run, KV bytes, errors.

The held-out texts are replaced by small synthetic ones in a temporary MHA2MLA_CACHE, so nothing is fetched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import build_source, tiny_deepseek_config, tiny_tokenizer
from transformers import AutoModelForCausalLM

from mha2mla import UserError

LIMIT = 3
TASKS = ["kjv_ppl", "python_docs_ppl", "mmlu_dev_mc", "mmlu_dev_cloze"]


def _synthetic_text(seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    words = [
        "keys",
        "values",
        "latent",
        "cache",
        "head",
        "the",
        "and",
        "def",
        "return",
        "model",
        "of",
        "rope",
    ]
    lines = []
    for i in range(3000):
        picks = torch.randint(len(words), (8,), generator=generator).tolist()
        lines.append(f"{i}: " + " ".join(words[p] for p in picks) + ".")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def eval_cache(tmp_path_factory):
    """A private MHA2MLA_CACHE holding synthetic 'held-out' texts (the real ones need apt downloads)."""
    root = tmp_path_factory.mktemp("cache")
    (root / "text").mkdir()
    (root / "text" / "kjv.txt").write_text(_synthetic_text(1), encoding="utf-8")
    (root / "text" / "python_docs.txt").write_text(_synthetic_text(2), encoding="utf-8")
    patch = pytest.MonkeyPatch()
    patch.setenv("MHA2MLA_CACHE", str(root))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("HF_DATASETS_OFFLINE", "1")
    patch.setenv("HF_DATASETS_CACHE", str(root / "hf_datasets"))
    yield root
    patch.undo()


def _save_deepseek(path, dtype=torch.float32, seed=1, **config_kwargs):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(**config_kwargs), dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    source = build_source(root / "source", family="llama")
    converted = _save_deepseek(root / "converted")
    report = {
        "layers": [
            {
                "layer": i,
                "kv_lora_rank": 24,
                "rope_pairs": [0, 1, 2, 3],
                "k_rel_error": 0.1 * (i + 1),
                "v_rel_error": 0.05,
            }
            for i in range(2)
        ]
    }
    (converted / "conversion_report.json").write_text(json.dumps(report))
    return {"source": source, "converted": converted}


def _run_cli(args, monkeypatch):
    """Run ``mha2mla ...`` in-process through the real entry point; return its exit code."""
    from mha2mla.cli.main import main

    monkeypatch.setattr(sys, "argv", ["mha2mla", *args])
    try:
        main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


@pytest.fixture(scope="module")
def cli_report(eval_cache, models, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    patch = pytest.MonkeyPatch()
    code = _run_cli(
        [
            "eval",
            str(models["converted"]),
            "--baseline",
            str(models["source"]),
            "--limit",
            str(LIMIT),
            "--out",
            str(out),
            "--seed",
            "7",
        ],
        patch,
    )
    patch.undo()
    assert code == 0
    return out


def test_cli_writes_table_json_and_plots(cli_report, capsys):
    report = json.loads((cli_report / "results.json").read_text())
    assert [m["role"] for m in report["models"]] == ["source", "model"]
    assert report["settings"]["seed"] == 7 and report["settings"]["limit"] == LIMIT
    for model in report["models"]:
        assert model["shown"] == TASKS
        assert all(model["n_samples"][task] == LIMIT for task in TASKS)
        assert 0.0 <= model["tasks"]["mmlu_dev_mc"]["acc"] <= 1.0
        assert model["tasks"]["kjv_ppl"]["word_perplexity"] > 1.0
        assert model["measurements"]["parameters"] > model["measurements"]["attention_parameters"] > 0
        assert model["measurements"]["tokens_per_second"] > 0
    table = (cli_report / "results.md").read_text()
    assert table.startswith("| domain | task | metric | source | converted | delta |")
    source, converted = report["models"]
    row = next(r for r in report["table"] if r["task"] == "kjv_ppl" and r["metric"] == "word_perplexity")
    delta = converted["tasks"]["kjv_ppl"]["word_perplexity"] - source["tasks"]["kjv_ppl"]["word_perplexity"]
    assert row["deltas"][converted["name"]]["delta"] == pytest.approx(delta)
    assert converted["conversion_report"]["layers"][1]["k_rel_error"] == pytest.approx(0.2)
    for name in ("tasks.png", "conversion_error.png", "perplexity_vs_kv.png"):
        assert (cli_report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_numbers_equal_a_direct_lm_eval_run(cli_report, models):
    """The report's numbers are those of lm-eval's own `hf` model loading the same folder with the attention
    `mha2mla eval` loads converted models with (mha2mla/kernels/sdpa.py: the same attention as plain sdpa, whose
    float rounding differs)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mha2mla.evaluation.harness import summarize
    from mha2mla.evaluation.tasks import bundled_task_dir
    from mha2mla.kernels.sdpa import register_padded_sdpa

    report = json.loads((cli_report / "results.json").read_text())
    ours = next(m for m in report["models"] if m["role"] == "model")["tasks"]
    direct = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(models["converted"]), "device": "cpu", "attn_implementation": register_padded_sdpa()},
        tasks=["kjv_ppl", "mmlu_dev_cloze"],
        limit=LIMIT,
        task_manager=TaskManager(include_path=str(bundled_task_dir())),
        log_samples=False,
        bootstrap_iters=0,
    )
    theirs = summarize(direct)["results"]
    for task, metric in [
        ("kjv_ppl", "word_perplexity"),
        ("kjv_ppl", "bits_per_byte"),
        ("mmlu_dev_cloze", "acc"),
        ("mmlu_dev_cloze", "acc_norm"),
    ]:
        assert ours[task][metric] == pytest.approx(theirs[task][metric], rel=1e-9), (task, metric)


def test_kv_bytes_per_token_of_the_report(cli_report):
    report = json.loads((cli_report / "results.json").read_text())
    source, converted = report["models"]
    assert (
        source["measurements"]["kv_cache_bytes_per_token"] == 2 * 2 * 16 * 2 * 4
    )  # K+V, G=2, d=16, 2 layers, fp32
    assert (
        converted["measurements"]["kv_cache_bytes_per_token"] == (24 + 8) * 2 * 4
    )  # (r + d_r) * layers * fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_of_deepseek_equals_latent_plus_rope(dtype):
    from mha2mla.evaluation import kv_cache_size

    config = tiny_deepseek_config(kv_lora_rank=20, qk_rope_head_dim=6, num_layers=3)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    measured = kv_cache_size(model, torch.randint(0, 300, (2, 11)))
    element = torch.tensor([], dtype=dtype).element_size()
    assert measured["kv_cache_bytes_per_token"] == (20 + 6) * 3 * element
    assert measured["kv_cache_values_per_token"] == (20 + 6) * 3


def test_evaluate_model_on_a_model_in_memory(eval_cache, models):
    from mha2mla.evaluation import evaluate_model, load_model, task_manager

    loaded = load_model(models["source"], device="cpu")
    manager = task_manager()

    def perplexity():
        result = evaluate_model(loaded.model, loaded.tokenizer, ["kjv_ppl"], limit=1, task_manager=manager)
        assert result["n_samples"] == {"kjv_ppl": 1}
        return result["results"]["kjv_ppl"]["word_perplexity"]

    first = perplexity()
    with torch.no_grad():  # the object in memory is what gets evaluated: change it, the score changes
        loaded.model.lm_head.weight.mul_(0.5)
    changed = perplexity()
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(2.0)
    assert changed != pytest.approx(first, rel=1e-3)
    assert perplexity() == pytest.approx(first, rel=1e-12)


def test_bundled_mmlu_items_are_well_formed_and_reproducible():
    from mha2mla.evaluation.tasks import MMLU_DEV_FILE

    shipped = [json.loads(line) for line in MMLU_DEV_FILE.read_text(encoding="utf-8").splitlines()]
    assert len(shipped) > 250
    assert all(
        len(item["choices"]) == 4 and item["answer"] in range(4) and item["question"] for item in shipped
    )
    # scripts/mmlu_items.py (an entry point nothing imports) rebuilds the file from lm-eval's copy, byte for byte
    script = Path(__file__).resolve().parents[2] / "scripts" / "mmlu_items.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"matches lm-eval's {len(shipped)} items" in result.stdout


def _fake_result(name, role, kv, ppl, acc):
    return {
        "name": name,
        "path": f"/models/{name}",
        "role": role,
        "shown": ["kjv_ppl", "mmlu_dev_mc"],
        "tasks": {
            "kjv_ppl": {"word_perplexity": ppl, "bits_per_byte": 1.0},
            "mmlu_dev_mc": {"acc": acc, "acc_stderr": 0.1},
        },
        "measurements": {
            "kv_cache_values_per_token": kv,
            "kv_cache_bytes_per_token": 2 * kv,
            "dtype": "bfloat16",
        },
    }


def test_table_and_plots_for_several_models(tmp_path):
    from mha2mla.evaluation.report import write_report

    results = [
        _fake_result("source", "source", 1000, 20.0, 0.30),
        _fake_result("converted", "model", 125, 40.0, 0.25),
        _fake_result("recovered", "model", 125, 25.0, 0.28),
    ]
    report = write_report(results, {"seed": 1}, tmp_path)
    lines = report["markdown"].splitlines()
    assert lines[0] == "| domain | task | metric | source | converted | Δ converted | recovered | Δ recovered |"
    assert lines[2] == "| in-domain | kjv_ppl | word_perplexity | 20 | 40 | +20 (×2) | 25 | +5 (×1.25) |"
    assert lines[4] == "| unseen | mmlu_dev_mc | acc | 0.3 | 0.25 | -0.05 | 0.28 | -0.02 |"
    assert set(report["plots"]) == {"tasks", "perplexity_vs_kv"}  # no conversion report given
    assert json.loads((tmp_path / "results.json").read_text())["settings"] == {"seed": 1}


def test_missing_or_malformed_conversion_report_is_skipped(tmp_path):
    from mha2mla.evaluation.plots import plot_conversion_error
    from mha2mla.evaluation.run import read_conversion_report

    assert read_conversion_report(tmp_path) is None
    (tmp_path / "conversion_report.json").write_text("{not json")
    assert read_conversion_report(tmp_path) is None
    (tmp_path / "conversion_report.json").write_text(json.dumps({"layers": "nope"}))
    assert read_conversion_report(tmp_path) is None
    assert plot_conversion_error([{"name": "m"}], tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- errors: one sentence, exit code 2


def _error_of(args, monkeypatch, capsys):
    capsys.readouterr()  # drop earlier output (progress bars of fixtures)
    code = _run_cli(["eval", *args], monkeypatch)
    err = capsys.readouterr().err.strip()
    return code, err


def test_folder_that_is_not_a_causal_lm(eval_cache, tmp_path, monkeypatch, capsys):
    from transformers import BertConfig, BertForMaskedLM, ViTConfig

    bert = tmp_path / "bert"
    BertForMaskedLM(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(bert)
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path / "vit")
    for folder, what in ((bert, "BertForMaskedLM"), (tmp_path / "vit", "'vit'")):
        code, err = _error_of([str(folder), "--tasks", "mmlu_dev_mc"], monkeypatch, capsys)
        assert code == 2
        assert "not a causal language model" in err and what in err
        assert "\n" not in err and "Traceback" not in err


def test_folder_without_config_and_missing_path(eval_cache, tmp_path, monkeypatch, capsys):
    code, err = _error_of([str(tmp_path), "--tasks", "mmlu_dev_mc"], monkeypatch, capsys)
    assert code == 2 and "no config.json" in err
    code, err = _error_of([str(tmp_path / "absent"), "--tasks", "mmlu_dev_mc"], monkeypatch, capsys)
    assert code == 2 and "does not exist" in err


def test_unknown_task_name(eval_cache, models, tmp_path, monkeypatch, capsys):
    code, err = _error_of([str(models["source"]), "--tasks", "kjv_pl"], monkeypatch, capsys)
    assert code == 2
    assert err == "error: unknown task 'kjv_pl'; did you mean kjv_ppl?"


def test_hub_task_when_offline(eval_cache, models, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = _error_of([str(models["source"]), "--tasks", "kjv_ppl,arc_easy"], monkeypatch, capsys)
    assert code == 2
    assert "'arc_easy'" in err and "offline" in err and "\n" not in err


def test_offline_detection(monkeypatch):
    from mha2mla.evaluation import check_tasks, is_offline

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert is_offline()

    from types import SimpleNamespace

    manager = SimpleNamespace(all_tasks=["arc_easy", "kjv_ppl"])
    check_tasks(["arc_easy"], manager, offline=False)  # online: a hub task is fine
    check_tasks(["kjv_ppl"], manager, offline=True)  # offline: bundled tasks are fine
    with pytest.raises(UserError, match="offline"):
        check_tasks(["arc_easy"], manager, offline=True)


# ---------------------------------------------------------------- perplexity primitive, --text, missing assets


def test_batch_nll_is_the_summed_cross_entropy_of_the_selected_targets():
    from mha2mla.evaluation import batch_nll, window_perplexity

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(), dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        logits = model(ids).logits.float()
    per_target = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(2, 8)
    nll, count = batch_nll(model, {"input_ids": ids})
    assert count == 16 and nll == pytest.approx(float(per_target.sum()), rel=1e-5)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3:], mask[1, :2] = True, True
    nll, count = batch_nll(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, mask)
    assert count == 7 and nll == pytest.approx(float(per_target[mask].sum()), rel=1e-5)
    ppl = window_perplexity(model, ids.flatten().tolist(), window=9, batch_size=1)
    assert ppl == pytest.approx(float(per_target.mean().exp()), rel=1e-5)


def test_text_file_perplexity_needs_no_fetched_asset(models, tmp_path, monkeypatch):
    """`eval --text FILE` alone: token perplexity of the file through batch_nll, no lm-eval task, empty cache."""
    from mha2mla.data.held_out import text_token_ids
    from mha2mla.evaluation import load_model, window_perplexity

    cache = tmp_path / "cache"
    monkeypatch.setenv("MHA2MLA_CACHE", str(cache))
    text = tmp_path / "notes.txt"
    text.write_text(_synthetic_text(3)[:20000], encoding="utf-8")
    out = tmp_path / "report"
    args = ["eval", str(models["converted"]), "-b", str(models["source"]), "--text", str(text), "--text-tokens", "600"]
    assert _run_cli([*args, "--out", str(out)], monkeypatch) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["settings"]["tasks"] == [] and report["settings"]["include_path"] is None
    assert report["settings"]["text"] == str(text.resolve()) and report["settings"]["text_tokens"] == 600
    for model in report["models"]:
        assert model["shown"] == ["text:notes.txt"] and model["n_samples"] == {"text:notes.txt": 512}
        loaded = load_model(model["path"], device="cpu")
        expected = window_perplexity(loaded.model, text_token_ids(loaded.tokenizer, text, 600), 512)
        assert model["tasks"]["text:notes.txt"]["token_perplexity"] == pytest.approx(expected, rel=1e-6)
    assert "| text:notes.txt | token_perplexity |" in (out / "results.md").read_text()
    assert (out / "perplexity_vs_kv.png").exists()
    assert not (cache / "text").exists() and not (cache / "eval_tasks").exists()


def test_short_text_is_one_window_and_a_missing_text_is_one_sentence(models, tmp_path, monkeypatch, capsys):
    from mha2mla.evaluation import load_model, text_perplexity

    loaded = load_model(models["source"], device="cpu")
    short = tmp_path / "short.txt"
    short.write_text("keys and values of the latent cache.", encoding="utf-8")
    scored = text_perplexity(loaded.model, loaded.tokenizer, short)
    assert 1 < scored["tokens"] < 512 and scored["token_perplexity"] > 1.0
    code, err = _error_of([str(models["source"]), "--text", str(tmp_path / "absent.txt")], monkeypatch, capsys)
    assert code == 2 and "absent.txt does not exist" in err and "\n" not in err


def test_without_cached_texts_the_defaults_are_the_mmlu_tasks(models, tmp_path, monkeypatch, capsys):
    """A machine where `make assets` never ran: perplexity tasks are left out of the defaults, naming one is an
    error that says how to get its text, and the default model is an error that says how to fetch it."""
    from mha2mla.evaluation.tasks import bundled_task_dir, parse_task_list

    cache = tmp_path / "cache"
    monkeypatch.setenv("MHA2MLA_CACHE", str(cache))
    (cache / "text").mkdir(parents=True)
    (cache / "text" / "kjv.txt").write_text(_synthetic_text(1), encoding="utf-8")
    assert parse_task_list(None) == ["kjv_ppl", "mmlu_dev_mc", "mmlu_dev_cloze"]
    assert (bundled_task_dir() / "kjv_ppl.yaml").is_file()
    (cache / "text" / "kjv.txt").unlink()
    assert parse_task_list(None) == ["mmlu_dev_mc", "mmlu_dev_cloze"]
    folder = bundled_task_dir()
    assert not (folder / "kjv_ppl.yaml").exists() and not (folder / "kjv_ppl.jsonl").exists()
    assert (folder / "mmlu_dev_mc.yaml").is_file()
    code, err = _error_of([str(models["source"]), "--tasks", "mmlu_dev_mc,kjv_ppl"], monkeypatch, capsys)
    assert code == 2 and "\n" not in err
    assert err.startswith("error: task 'kjv_ppl' needs the King James Bible text in ")
    assert "make assets" in err and "--text FILE" in err
    code, err = _error_of(["--tasks", "mmlu_dev_mc"], monkeypatch, capsys)
    assert code == 2 and "\n" not in err
    assert "the default model SmolLM2-135M-Instruct.Q4_1.gguf is not in" in err and "make assets" in err


# ---------------------------------------------------------------- --recipe


def test_recipe_eval_section_with_flags_winning(models, tmp_path, monkeypatch):
    import yaml

    text = tmp_path / "t.txt"
    text.write_text(_synthetic_text(4)[:8000], encoding="utf-8")
    out = tmp_path / "from-recipe"
    recipe = tmp_path / "r.yaml"
    section = {"text": str(text), "text_tokens": 300, "seed": 3, "out": str(out), "dtype": "float32"}
    recipe.write_text(yaml.safe_dump({"eval": section}))
    assert _run_cli(["eval", str(models["source"]), "--recipe", str(recipe), "--text-tokens", "200"], monkeypatch) == 0
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["seed"] == 3 and settings["dtype"] == "float32" and settings["tasks"] == []
    assert settings["text_tokens"] == 200 and settings["text"] == str(text.resolve())


@pytest.mark.parametrize(
    "section, message",
    [
        ({"taks": ["kjv_ppl"]}, "recipe {recipe} has an unknown eval setting 'taks' (did you mean 'tasks'?); fix or remove it."),
        ({"limit": -1}, "invalid `limit` under `eval:` in {recipe}: input should be greater than 0."),
        ({"dtype": "fp8"}, "`dtype` under `eval:` in {recipe} must be one of 'auto', 'float32', 'bfloat16' or 'float16', not 'fp8'."),
    ],
)
def test_invalid_recipe_eval_section_is_one_sentence(section, message, models, tmp_path, monkeypatch, capsys):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"eval": section}))
    code, err = _error_of([str(models["source"]), "--recipe", str(recipe)], monkeypatch, capsys)
    assert code == 2
    assert err == "error: " + message.format(recipe=recipe)


def test_every_recipe_eval_section_is_valid(eval_cache):
    """The shipped recipes' eval: sections validate and name tasks lm-eval knows (with the bundled ones)."""
    from pathlib import Path

    import yaml

    from mha2mla.evaluation import task_manager
    from mha2mla.evaluation.tasks import BUNDLED_TASKS, parse_task_list
    from mha2mla.recipes import build_settings

    recipes = sorted(Path(__file__).resolve().parents[2].glob("recipes/*/*.yaml"))
    with_eval = [path for path in recipes if "eval" in (yaml.safe_load(path.read_text()) or {})]
    assert any("smollm2" in str(path) for path in with_eval)
    known = set(task_manager().all_tasks) | set(BUNDLED_TASKS)  # bundled ones register once their texts are cached
    for path in with_eval:
        settings = build_settings("eval", path, {})
        assert settings.tasks, path
        assert set(parse_task_list(settings.tasks)) <= known, path
