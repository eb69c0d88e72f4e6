"""Every shipped recipe parses (unknown keys are rejected) and starts with the command that runs it."""

from pathlib import Path

import pytest

from mha2mla.convert.options import build_options, load_recipe

RECIPES = sorted(p for p in (Path(__file__).parent.parent / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_is_valid(path):
    recipe = load_recipe(path)
    assert recipe.source
    build_options(recipe)
    assert path.read_text().startswith(f"# mha2mla convert --recipe recipes/{path.parent.name}/{path.name}")


def test_recipes_exist_for_each_family():
    names = {p.name for p in RECIPES}
    assert {"llama-2-7b-kv12.5.yaml", "llama-3-8b-kv25.yaml", "qwen2.5-7b-kv50.yaml", "mistral-7b-kv25.yaml"} <= names
    assert any(name.startswith("135m-") for name in names)
