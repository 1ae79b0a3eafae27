"""Value Alignment Tax (VAT): how much an intervention that targets one Schwartz value moves the others.

Pipeline: load scenario-action items (``load_items``), judge each before and after an intervention on
a Likert scale read from next-token probabilities (``LikertJudge``), and score the shifts
(``compute_results``: gain, drifts, GND, VAT, coupling, nVAT, hubs, circumplex test). ``run_vat`` does
all of it resumably into a folder; ``compare`` puts several runs side by side. ``stats`` adds the
specificity S_T, scene-level intervals and tests and control adjustment; ``run_matrix`` aims one
intervention at each of the ten values; ``OracleBias`` gives known answers for validation. The
interventions are named through one registry (``aligntax.vat.methods``): the intervention registry's
methods and the value-targeted ones layered on it; ``aligntax.vat.train`` trains the LoRA adapters.
"""

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
from aligntax.vat.matrix import matrix_from_runs, run_matrix, write_matrix
from aligntax.vat.methods import (
    INTERVENTIONS,
    LoRAAdapter,
    OracleBias,
    ValueFewShot,
    ValuePersona,
    build_fewshot,
    build_intervention,
    compute_steering_vector,
    persona_text,
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
from aligntax.vat.stats import (
    adjacent_vs_opposite,
    analyse_matrix,
    control_adjusted,
    neutral_lift,
    scene_bootstrap,
    scene_level_tests,
    specificity,
    stratum_summary,
)
from aligntax.vat.sweep import SweepSpec, check_comparable, paired_compare, paired_difference, run_sweep
from aligntax.vat.train import train_dpo, train_lora_sft

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
    "JudgeConfig",
    "Judgment",
    "JudgmentCache",
    "LikertJudge",
    "LikertScale",
    "LoRAAdapter",
    "OracleBias",
    "VATConfig",
    "SweepSpec",
    "ValueFewShot",
    "ValueItem",
    "ValuePersona",
    "adjacent_vs_opposite",
    "analyse_matrix",
    "build_fewshot",
    "build_intervention",
    "check_comparable",
    "circular_distance",
    "compare",
    "compute_results",
    "compute_steering_vector",
    "control_adjusted",
    "distance_matrix",
    "likert_from_logits",
    "load_builtin",
    "load_item_file",
    "load_items",
    "load_value_action_lens",
    "load_vat_hub",
    "matrix_from_runs",
    "neutral_lift",
    "paired_compare",
    "paired_difference",
    "parse_human_action",
    "parse_likert_answer",
    "persona_text",
    "resolve_value",
    "run_matrix",
    "run_sweep",
    "run_vat",
    "sample_items",
    "scene_bootstrap",
    "scene_level_tests",
    "scale_token_ids",
    "specificity",
    "split_items",
    "stratum_summary",
    "train_dpo",
    "train_lora_sft",
    "write_matrix",
    "write_report",
]
