"""The documents of the ``lapse_tiny_*`` tasks, for their YAMLs' ``custom_dataset``.

lm-eval resolves ``dataset_kwargs: data_files:`` from the working directory but a
``!function`` from the YAML's folder: loading the JSONL here, by a path relative to this
file, makes the task folder work from anywhere and without downloads. Copy this file
beside your own YAMLs to do the same.
"""

from pathlib import Path

from lapse.eval.lm_eval import jsonl_dataset


def load(**metadata):
    """``{"test": Dataset}``; lm-eval passes the task's metadata, which is not needed."""
    return jsonl_dataset(Path(__file__).with_name("lapse_tiny.jsonl"), split="test")
