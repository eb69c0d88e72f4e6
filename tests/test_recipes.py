"""Recipes and the config models: every shipped recipe parses, each section builds its command's model, unknown
keys and contradictions are one sentence, and every command's options and help come from its model's fields."""

import inspect
import re
from pathlib import Path

import pytest
from common import run_cli

from mha2mla.cli import convert, generate, recover
from mha2mla.cli import eval as eval_cli
from mha2mla.cli.settings import help_text, model_field
from mha2mla.convert.config import KV_BUDGET, ConvertConfig
from mha2mla.recipes import SECTIONS, build_settings, load_recipe
from mha2mla.train.config import RecoverConfig

ROOT = Path(__file__).parent.parent
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")
COMMANDS = {"convert": (convert.FLAGS, convert.convert_command), "recover": (recover.FLAGS, recover.recover_command),
            "eval": (eval_cli.FLAGS, eval_cli.eval_command), "generate": (generate.FLAGS, generate.generate)}
# what a section lacks that the command line gives: recover's MODEL, generate's --prompt
REQUIRED = {"recover": {"model": "m", "out": "o"}, "generate": {"prompt": ["hi"]}}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_is_valid(path):
    recipe = load_recipe(path)
    assert recipe.source
    for section in SECTIONS:
        if getattr(recipe, section) or section == "convert":
            build_settings(section, path, REQUIRED.get(section, {}))
    assert path.read_text().startswith(f"# mha2mla convert --recipe recipes/{path.parent.name}/{path.name}")


def test_recipes_exist_for_each_family():
    names = {p.name for p in RECIPES}
    assert {"llama-2-7b-kv12.5.yaml", "llama-3-8b-kv25.yaml", "qwen2.5-7b-kv50.yaml", "mistral-7b-kv25.yaml"} <= names
    assert any(name.startswith("135m-") for name in names)


@pytest.mark.parametrize(
    "text, message",
    [
        ("convert:\n  kv_lora_rnk: 17\n", "has an unknown convert setting 'kv_lora_rnk' (did you mean 'kv_lora_rank'?)"),
        ("recover:\n  lora:\n    rnak: 4\n", "has an unknown recover setting 'lora.rnak' (did you mean 'rank'?)"),
        ("eval:\n  taks: [a]\n", "has an unknown eval setting 'taks' (did you mean 'tasks'?)"),
        ("convrt:\n  profile: exact\n", "has an unknown top-level setting 'convrt' (did you mean 'convert'?)"),
        ("convert: [1]\n", "`convert:` must hold settings"),
        ("convert: {\n", "is not valid YAML"),
        ("source: 42\n", "`source:` must be text naming the model (a hub id, a folder or a .gguf file), not the number 42"),
        ("source: [src]\n", "`source:` must be text naming the model (a hub id, a folder or a .gguf file), not a list"),
        ("1: 2\nconvert: {}\n", "has an unknown top-level setting 1;"),
        ("", "is empty; give `source:` and a section per command"),
        ("a: &a [*a]\n", "expands to more than 100,000 values"),
    ],
)
def test_a_bad_recipe_is_one_sentence(tmp_path, text, message):
    from mha2mla import UserError

    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as error:
        load_recipe(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_size_given_replaces_the_recipe_s_other_sizes(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("convert:\n  kv_lora_rank: 17\n  rope_dim: 8\n")
    assert build_settings("convert", path, {"kv_budget": 0.5}).kv_lora_rank is None
    path.write_text("convert:\n  kv_budget: 0.5\n")
    options = build_settings("convert", path, {"kv_lora_rank": 17, "rope_dim": 8})
    assert options.kv_budget is None and options.kv_lora_rank == 17


def test_the_default_budget_has_one_home():
    assert ConvertConfig().budget == KV_BUDGET and ConvertConfig(kv_budget=0.5).budget == 0.5
    assert ConvertConfig(calib_samples=3).calib_samples_for(8192) == 3
    assert ConvertConfig().calib_samples_for(64) > ConvertConfig().calib_samples_for(8192)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_options_and_help_come_from_the_model(command):
    """Each generated option's help is its field's description and default, so a changed default shows."""
    flags, callback = COMMANDS[command]
    parameters = {p.name: p for p in inspect.signature(callback).parameters.values()}
    for key in flags.settings:
        option = parameters[flags.parameter(key)].default
        field = model_field(SECTIONS[command], key)
        assert option.help == help_text(field, "repeatable" in option.help), key
        if not field.is_required() and isinstance(field.default, int | float) and not isinstance(field.default, bool):
            assert f"default {field.default}." in option.help, key


def test_no_help_text_copies_a_default_by_hand():
    """A literal `default <number>` or `(default)` in the CLI's source would be a second home of a default."""
    for path in (ROOT / "mha2mla" / "cli").glob("*.py"):
        assert not re.search(r"default:? \d|\(default\)|, the default\)", path.read_text()), path


def test_recover_lists_each_setting_once():
    source = (ROOT / "mha2mla" / "cli" / "recover.py").read_text()
    assert source.count('"seq_len"') == 1 and "lora_rank" not in source and "typer.Option(None, \"--lr\"" not in source
    assert set(recover.FLAGS.settings) | {"model", "lora", "max_grad_norm"} | {
        f"lora.{name}" for name in ("rank", "alpha", "dropout", "targets", "train_norms")} >= set(RecoverConfig.model_fields)


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "m", "-p", "hi", "--temperature", "-0.5"], "error: invalid --temperature: input should be greater than "
                                                                 "or equal to 0."),
        (["generate", "m"], "error: give --prompt (or `prompt:` under `generate:` in a --recipe)."),
        (["generate", "m", "-p", "hi", "--top-p", "0"], "error: invalid --top-p: input should be greater than 0."),
    ],
)
def test_generate_refuses_contradictions(args, message, capsys):
    code, stdout, err = run_cli(args, capsys)
    assert code == 2 and err.strip() == message and stdout == ""


def test_recipe_paths_name_the_cache_and_work_from_any_folder(tmp_path, monkeypatch):
    """`$MHA2MLA_CACHE` in a recipe is the cache folder whether the variable is set or not, so a shipped recipe's
    source resolves the same from the checkout's root and from anywhere else."""
    from mha2mla.io.cache import cache_dir

    recipe = ROOT / "recipes" / "smollm2" / "135m-kv12.5-healed.yaml"
    monkeypatch.delenv("MHA2MLA_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    loaded = load_recipe(recipe)
    assert loaded.source == str(cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert loaded.recover["data"].startswith(str(cache_dir()))
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "elsewhere"))
    assert load_recipe(recipe).source == str(tmp_path / "elsewhere" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
