"""docs/recipes.md holds exactly the table fp4jax.ops.recipe_table generates from the presets, and the
generator describes a preset from its Recipe (a changed operand changes its row)."""

import dataclasses
import os

import pytest

from fp4jax.ops import recipe_table
from fp4jax.ops.recipes import NVFP4_SR, PRESETS

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "recipes.md")


def _docs_table() -> str:
    text = open(DOC, encoding="utf-8").read()
    begin, end = text.index(recipe_table.TABLE_BEGIN), text.index(recipe_table.TABLE_END)
    return text[begin + len(recipe_table.TABLE_BEGIN) : end].strip()


def test_the_docs_table_is_the_generated_one():
    assert _docs_table() == recipe_table.markdown_table(), (
        "docs/recipes.md is stale: paste `python -m fp4jax.ops.recipe_table`'s output between its markers"
    )


def test_every_preset_has_one_row_and_a_source():
    rows = recipe_table.markdown_table().splitlines()[2:]
    assert [row.split("|")[1].strip().strip("`") for row in rows] == list(PRESETS)
    assert set(recipe_table.SOURCES) == set(PRESETS)


def test_a_row_follows_its_recipe():
    nvidia = PRESETS["nvfp4_nvidia"]
    changed = dataclasses.replace(nvidia, fprop=dataclasses.replace(nvidia.fprop, lhs=NVFP4_SR))
    before = recipe_table.markdown_table({"nvfp4_nvidia": nvidia})
    after = recipe_table.markdown_table({"nvfp4_nvidia": changed})
    assert "| SR / RNE 16x16 | SR / RNE 16x16 |" in after and "| RNE / RNE 16x16 | SR / RNE 16x16 |" in before
    row = recipe_table.markdown_table({"nvfp4_nvidia_12b": PRESETS["nvfp4_nvidia_12b"]}).splitlines()[2]
    assert "| first 2, last 8 |" in row


def test_a_preset_without_a_source_is_refused():
    with pytest.raises(KeyError, match="has no entry in recipe_table.SOURCES"):
        recipe_table.markdown_table({"unlisted": PRESETS["bf16"]})
