"""The config files people already fine-tune with (TRL, axolotl, LLaMA-Factory, TrainingArguments):
read for their recipe (`autotune search --from FILE`: read.py) and written back with the winner's
levers (`autotune best --update FILE`: write_back.py, through yaml_edit.py, which keeps comments)."""

from autotune.recipe_files.read import TOOLS, RecipeFile, read_recipe_file

__all__ = ["TOOLS", "RecipeFile", "read_recipe_file"]
