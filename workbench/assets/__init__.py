"""Built-in offline assets: a tiny Llama model with a locally trained tokenizer, and a teaching
dataset a tiny model visibly learns in a minute or two on two CPU cores."""

from workbench.assets.teaching import builtin_dataset_path
from workbench.assets.tiny_model import TINY_LLAMA_CONFIG, builtin_model_path

__all__ = ["TINY_LLAMA_CONFIG", "builtin_dataset_path", "builtin_model_path"]
