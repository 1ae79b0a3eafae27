"""Benchmark prompt sets as :class:`PromptItem` lists.

``load_prompts(spec)`` takes a file path, a named dataset (``list_datasets()``) or a Hub id
(``hf:ORG/NAME[:split]``); the ``load_*`` functions read one native format each.
"""

from aligntax.data.api import load_prompt_sets, load_prompts
from aligntax.data.base import LABELS, Label, PromptItem, normalize_label
from aligntax.data.formats import (
    FORMATS,
    Format,
    default_source,
    detect_format,
    load_advbench,
    load_file,
    load_generic,
    load_harmbench,
    load_instruction_json,
    load_jailbreakbench,
    load_maliciousinstruct,
    load_oktest,
    load_orbench,
    load_orbench_toxic,
    load_strongreject,
    load_xstest,
)
from aligntax.data.hub import load_hub, parse_hub_id
from aligntax.data.registry import DATASETS, DatasetSpec, data_dir, dataset_path, list_datasets, load_named

__all__ = [
    "DATASETS",
    "FORMATS",
    "LABELS",
    "DatasetSpec",
    "Format",
    "Label",
    "PromptItem",
    "data_dir",
    "dataset_path",
    "default_source",
    "detect_format",
    "list_datasets",
    "load_advbench",
    "load_file",
    "load_generic",
    "load_harmbench",
    "load_hub",
    "load_instruction_json",
    "load_jailbreakbench",
    "load_maliciousinstruct",
    "load_named",
    "load_oktest",
    "load_orbench",
    "load_orbench_toxic",
    "load_prompt_sets",
    "load_prompts",
    "load_strongreject",
    "load_xstest",
    "normalize_label",
    "parse_hub_id",
]
