"""Value Alignment Tax (VAT): how much an intervention that targets one Schwartz value moves the others.

Pipeline: load scenario-action items (``load_items``), judge each before and after an intervention on
a Likert scale read from next-token probabilities (``LikertJudge``), and score the shifts
(``compute_results``: gain, drifts, GND, VAT, coupling, nVAT, hubs, circumplex test). ``run_vat`` does
all of it resumably into a folder; ``compare`` puts several runs side by side.
"""

from aligntax.vat.interventions import (
    INTERVENTIONS,
    ActivationAddition,
    LoRAAdapter,
    ValueFewShot,
    ValuePersona,
    build_fewshot,
    build_intervention,
    compute_steering_vector,
    persona_text,
    train_dpo,
    train_lora_sft,
)
from aligntax.vat.items import (
    VAT_HUB_ID,
    ValueItem,
    load_builtin,
    load_item_file,
    load_items,
    load_value_action_lens,
    load_vat_hub,
    parse_human_action,
    sample_items,
    split_items,
)
from aligntax.vat.judge import (
    TEMPLATES,
    JudgeConfig,
    Judgment,
    JudgmentCache,
    LikertJudge,
    LikertScale,
    likert_from_logits,
    parse_likert_answer,
    scale_token_ids,
)
from aligntax.vat.report import compare, write_report
from aligntax.vat.runner import VATConfig, compute_results, run_vat
from aligntax.vat.schwartz import (
    ADJACENT_PAIRS,
    HIGHER_ORDER,
    OPPOSITE_PAIRS,
    REFINED_VALUES,
    SVS_ITEMS,
    SVS_TO_BASIC,
    VALUES,
    circular_distance,
    distance_matrix,
    resolve_value,
)

__all__ = [
    "ADJACENT_PAIRS",
    "HIGHER_ORDER",
    "INTERVENTIONS",
    "OPPOSITE_PAIRS",
    "REFINED_VALUES",
    "SVS_ITEMS",
    "SVS_TO_BASIC",
    "TEMPLATES",
    "VALUES",
    "VAT_HUB_ID",
    "ActivationAddition",
    "JudgeConfig",
    "Judgment",
    "JudgmentCache",
    "LikertJudge",
    "LikertScale",
    "LoRAAdapter",
    "VATConfig",
    "ValueFewShot",
    "ValueItem",
    "ValuePersona",
    "build_fewshot",
    "build_intervention",
    "circular_distance",
    "compare",
    "compute_results",
    "compute_steering_vector",
    "distance_matrix",
    "likert_from_logits",
    "load_builtin",
    "load_item_file",
    "load_items",
    "load_value_action_lens",
    "load_vat_hub",
    "parse_human_action",
    "parse_likert_answer",
    "persona_text",
    "resolve_value",
    "run_vat",
    "sample_items",
    "scale_token_ids",
    "split_items",
    "train_dpo",
    "train_lora_sft",
    "write_report",
]
