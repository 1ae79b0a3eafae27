"""Where each benchmark file of the data folder comes from: a repository, a pinned commit and a sha256.

Pure data (no downloading; :mod:`aligntax.data.fetch` does that). Keys are paths relative to a data
root, as :class:`aligntax.data.catalog.DatasetSpec.path` names them. Every pin below was checked
against the file the benchmarks in this project were run on: the commit holds a byte-identical copy
(same git blob), and ``sha256`` is that file's hash. Where the project's copy comes from a
repository that redistributes the benchmark (``via``), the note names the original authors' source.

A file made for this project from an upstream file (a split of it) is listed in :data:`DERIVED`: the
upstream file it is made from (:data:`SOURCES`, fetched like the others), the recipe that makes it
(:mod:`aligntax.data.derive`) and the sha256 of the result, checked after it is made.
:data:`NO_UPSTREAM` lists files with no public source at all (none at present): copy such a file into a
data root (``ALIGNTAX_DATA``) yourself.
"""

from __future__ import annotations

from dataclasses import dataclass

HOSTS = ("github", "hf")


@dataclass(frozen=True)
class UpstreamFile:
    host: str  # "github" (raw files of a repository) or "hf" (a Hugging Face Hub dataset repository)
    repo: str  # owner/name
    revision: str  # a commit id, never a branch: the file cannot change under the pin
    path: str  # path of the file inside the repository
    sha256: str
    note: str = ""


# (repository, commit): the newest commit of each repository whose file matches the pinned sha256
_REFUSAL_DIRECTION = ("andyrdt/refusal_direction", "9d852fae1a9121c78b29142de733cb1340770cc3")
_FALSE_REFUSAL = ("mainlp/False-Refusal-Mitigation", "916dcac6fb1c5fcccc9581471370645763c65ce6")
_XSTEST = ("paul-rottger/exaggerated-safety", "d7bb5bd738c1fcbc36edd83d5e7d1b71a3e2d84d")
_OKTEST = ("InvokerStark/OverKill", "9551a7ff7b2cb18d178e64fb5cc95e4684311b3b")
_MALICIOUS = ("Princeton-SysML/Jailbreak_LLM", "1e490531c0ef4bc13430178bf1fbc8f813e34b1a")
# the ELS paper's repository (Energy-Driven Alignment: Reducing False Refusals in LLMs): its processed prompt sets
_ELS_PAPER = ("ericjiang18/LLM_Safety_EBM_Steering", "32439a2185ab6a394246387c0d0498ea7746943b")
# the last commit holding PHTest/ (later commits moved the dataset to the Hub, furonghuang-lab/PHTest)
_PHTEST = ("umd-huang-lab/FalseRefusal", "b40367125ba1255cdd30137d2726d3c775164f39")
_JBB_ARTIFACTS = ("JailbreakBench/artifacts", "909e68c01d94222b8ad2e397a017e2e12e2adb73")
_GSM8K = ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c")


def _gh(where: tuple[str, str], path: str, sha256: str, note: str = "") -> UpstreamFile:
    return UpstreamFile("github", where[0], where[1], path, sha256, note)


_XS_COMPLETIONS = {
    "gpt4": "71af323af8ecdec0efae23992317721441d2cfedddedeef3248f842f4e15c9ca",
    "llama2new": "6365cc55ce0a593c7ab8785853d02784be027d97199d4077912b4313cd010099",
    "llama2orig": "cbc52550e8ba8197a3e3d97a5af078d27bae4766737cd62df80270126a87ffc6",
    "mistralguard": "0ac03817b65e019a8f5b4b3eed805086f9f7fafe538ac9ebd156f80210af6903",
    "mistralinstruct": "6a146b65a5b96ec8249729bc2db459697175125998d7cbbcc88f7688ecf31dad",
}
XSTEST_LABELED_DIR = "refusal/xstest/model_completions_human_labeled"
JBB_ARTIFACTS_DIR = "refusal/jailbreak/jbb_artifacts"
# attack -> (the artifact file of the data folder: the attack run against one target model, sha256)
JBB_ATTACKS = {
    "PAIR": (
        "PAIR/black_box/vicuna-13b-v1.5.json",
        "18b101386419a98fbdf45cb987069f83af3a40d5e0f7f0d32c4e9dc5ecc049b4",
    ),
    "JBC": (
        "JBC/manual/vicuna-13b-v1.5.json",
        "1d5df5aa451c3d1bb8a4c048a7b2e1e6132e72f2970cb9d94ffc77f44e0edb39",
    ),
    "prompt_with_random_search": (
        "prompt_with_random_search/black_box/vicuna-13b-v1.5.json",
        "9d87a56659f617438feb5770bb2c8e4c2dbbd1bd62964f2c1a8775988017ac5d",
    ),
    "GCG": (
        "GCG/transfer/gpt-3.5-turbo-1106.json",
        "ff185b1dc73732d830e96efdb3f4a92294ee72e9c88a1800b1d11d4ecb3d4cdf",
    ),
    "DSN": (
        "DSN/white_box/vicuna-13b-v1.5.json",
        "ea0a5f7331baf595fb6e6925423f43367cbce8da9273ce93c6a03e2201e3373d",
    ),
}
GSM8K_DIR = "capability/gsm8k"

UPSTREAM: dict[str, UpstreamFile] = {
    # OR-Bench (Cui et al. 2024; github justincui03/or-bench, Hub bench-llm/or-bench), with the train/val/test
    # split of Wang et al. 2024, as redistributed by the authors of the split
    "refusal/orbench/or-bench-hard-1k.csv": _gh(
        _FALSE_REFUSAL,
        "dataset/raw/or-bench-hard-1k.csv",
        "a6e2f1166416efe5901f3bb05c47dc92ab3aca3acfe143693d38b8057d841e6d",
        "via mainlp/False-Refusal-Mitigation; original: Hub bench-llm/or-bench",
    ),
    **{
        f"refusal/orbench/or_bench_hard_{split}.json": _gh(
            _FALSE_REFUSAL, f"dataset/splits/or_bench_hard_{split}.json", sha
        )
        for split, sha in [
            ("train", "ff77215ebce83c5fe344c30de7b718f7294defa981ec50924635a3ee4ebf0f5a"),
            ("val", "d97030008c36c605ad4a33f679b1c3d6ea1966a6a296e1ef81b649f2f24871b5"),
            ("test", "a5a66718b1f5279b7a96a17d6ad0320f82150cdae03a94a46c60cf90aff0ba12"),
        ]
    },
    # XSTest v2 (Röttger et al. 2024), its license and the human-labelled completions the judges are validated on
    "refusal/xstest/xstest_prompts.csv": _gh(
        _XSTEST, "xstest_prompts.csv", "11783fb294ed017473ee53c207d71f2161c7672c8d0b037501e78387f801cb5a"
    ),
    "refusal/xstest/LICENSE_CC-BY-4.0.txt": _gh(
        _XSTEST, "LICENSE", "9e5f1b3c610b9c2da5c313bf81d577a7d1acec686bdb0384edefa6df0f90cd94"
    ),
    **{
        f"{XSTEST_LABELED_DIR}/xstest_v2_completions_{m}.csv": _gh(
            _XSTEST, f"model_completions/xstest_v2_completions_{m}.csv", sha
        )
        for m, sha in _XS_COMPLETIONS.items()
    },
    "refusal/oktest/OKTest.csv": _gh(
        _OKTEST, "data/OKTest.csv", "1be3e8d3fe6b45a170653da63c8cf70dbf97508a48735e65db0713a44e158860"
    ),
    "refusal/harmful/MaliciousInstruct.txt": _gh(
        _MALICIOUS,
        "data/MaliciousInstruct.txt",
        "a64d69dd1004aac4a23aaff3748fb8f17161893f74db36f45b8bc849eb1bcce5",
    ),
    # the raw benchmark copies and the harmful/harmless splits of Arditi et al. 2024
    "refusal/harmful/advbench_harmful_behaviors.csv": _gh(
        _REFUSAL_DIRECTION,
        "dataset/raw/advbench.csv",
        "6cd1a5c63c07610d7eb67307772ee5606017ee950b5770ab288a2c487489d3e1",
        "via andyrdt/refusal_direction; original: llm-attacks/llm-attacks data/advbench/harmful_behaviors.csv",
    ),
    "refusal/harmful/jailbreakbench_behaviors.csv": _gh(
        _REFUSAL_DIRECTION,
        "dataset/raw/jailbreakbench.csv",
        "45e9a8923b28f547bb372fbaa9af7df8b38c818a80ae50c3bab97704197ff516",
        "via andyrdt/refusal_direction; original: Hub JailbreakBench/JBB-Behaviors",
    ),
    "refusal/harmful/harmbench_behaviors_text_test.csv": _gh(
        _REFUSAL_DIRECTION,
        "dataset/raw/harmbench_test.csv",
        "75d257b3e7428c52eb7b0154318f455af3e01b09a3794b5e2f3d36054f3c0e29",
        "via andyrdt/refusal_direction; original: centerforaisafety/HarmBench",
    ),
    "refusal/harmful/harmbench_behaviors_text_val.csv": _gh(
        _REFUSAL_DIRECTION,
        "dataset/raw/harmbench_val.csv",
        "7bfaaa5e2b9b95002c89e2d33c019f58e9e8496e2fc65d368f1eeb8179e69534",
        "via andyrdt/refusal_direction; original: centerforaisafety/HarmBench",
    ),
    "refusal/harmful/strongreject_dataset.csv": _gh(
        _REFUSAL_DIRECTION,
        "dataset/raw/strongreject.csv",
        "4dd70357e4ff8b5d0ba5ebafecab5d6dd5633ce8046e3dd1c8bd93e64de44381",
        "via andyrdt/refusal_direction; original: alexandrasouly/strongreject",
    ),
    **{
        f"refusal/{kind}/{kind}_{split}.json": _gh(
            _REFUSAL_DIRECTION, f"dataset/splits/{kind}_{split}.json", sha
        )
        for kind, split, sha in [
            ("harmful", "train", "8f5c0eac0efd2a7f99084bbe8d0de2c465e31b1997184783c917969d9de9ece1"),
            ("harmful", "val", "305f1d1e6dfa6c50a32d24a18ef815f42b5441eb83e6d7767d242107162fd9f4"),
            ("harmful", "test", "5e12ae102c3791dee083a69ab6269a78e033411c629bc3f66f75d2fde196d9ef"),
            ("harmless", "train", "86623b1f8a25aa35df153fc97a556dbcebb6a7c881538ae43ee479ca17f2e002"),
            ("harmless", "val", "772010758e7d771ef4c7e5e4acdfd7598dcece1a6f383f20d382f640913a2a4d"),
        ]
    },
    # the ELS paper's processed sets: OR-Bench toxic prompts (2,303 of the 22,911 of OR-Bench's toxic-all
    # release, Hub bench-llms/or-bench-toxic-all, which the same repository holds converted as
    # or-bench-toxic-all.json), WildGuardTest adversarial harmful prompts, and DAN-style prompts
    "refusal/orbench/or-bench-toxic-harmful.json": _gh(
        _ELS_PAPER,
        "dataset/processed/or-bench-toxic-harmful.json",
        "ecd41e86fd599c7713ad4acf6052c5068e08069ca3deb372980c4973162d03a0",
        "via the ELS paper's repository; original: OR-Bench toxic prompts (Hub bench-llms/or-bench-toxic-all)",
    ),
    "refusal/jailbreak/wildguard_test_adv.json": _gh(
        _ELS_PAPER,
        "dataset/processed/wildguard_test_adv.json",
        "f7f02ea17b641339384b2ef564e9c8751cb455d44c6fc7978cf6929d493e4bff",
        "via the ELS paper's repository; original: WildGuardTest (Hub allenai/wildguardmix, gated)",
    ),
    "refusal/jailbreak/DAN_safe.json": _gh(
        _ELS_PAPER,
        "dataset/processed/DAN_safe.json",
        "79be96099b20493977ff5bc7c6fa2c544395b51fe458c36dbc81eb29d792e52f",
        "via the ELS paper's repository; original: in-the-wild jailbreak prompts (verazuo/jailbreak_llms)",
    ),
    "refusal/jailbreak/DAN_unsafe.json": _gh(
        _ELS_PAPER,
        "dataset/processed/DAN_unsafe.json",
        "2b3f63d828a51ad1e3269aaf55fa397c419f8e7c0f4d16f4af634bdd8c81a0b8",
        "via the ELS paper's repository; original: in-the-wild jailbreak prompts (verazuo/jailbreak_llms)",
    ),
    # JailbreakBench attack artifacts (Chao et al. 2024): each attack's jailbreak prompts for the 100 behaviours
    **{
        f"{JBB_ARTIFACTS_DIR}/{path}": _gh(_JBB_ARTIFACTS, f"attack-artifacts/{path}", sha)
        for path, sha in JBB_ATTACKS.values()
    },
    f"{JBB_ARTIFACTS_DIR}/LICENSE": _gh(
        _JBB_ARTIFACTS, "LICENSE", "09017abee723a7b715866bbcd1bd2569e0a5fa7e996dd1d9d1ec4b36fb5ca51c"
    ),
    # GSM8K (Cobbe et al. 2021) grade-school maths word problems, and its MIT license
    f"{GSM8K_DIR}/train.jsonl": _gh(
        _GSM8K,
        "grade_school_math/data/train.jsonl",
        "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    ),
    f"{GSM8K_DIR}/test.jsonl": _gh(
        _GSM8K,
        "grade_school_math/data/test.jsonl",
        "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    ),
    f"{GSM8K_DIR}/LICENSE": _gh(
        _GSM8K, "LICENSE", "86bbb73e855821d7c401912fd4bf82e34313e6e3b6fd6f909f2b6cc9e209a53b"
    ),
}

# Upstream files fetched only as the input of a derived file (not themselves a dataset of the data folder).
PHTEST_CSV = "refusal/phtest/dataset_v0.1.csv"
SOURCES: dict[str, UpstreamFile] = {
    # PHTest (An et al., COLM 2024): 3,260 pseudo-harmful prompts, 2,069 labelled harmless, 1,191 controversial
    PHTEST_CSV: _gh(
        _PHTEST,
        "PHTest/dataset_v0.1.csv",
        "175cfb357a3d65ebf11419c6a258c5083f6fd5cb0e44c4c2ce29f4553b4f1d84",
        "no license file: benchmark use only",
    ),
}


@dataclass(frozen=True)
class DerivedFile:
    sources: tuple[str, ...]  # keys of SOURCES (or UPSTREAM) it is made from
    recipe: str  # a key of aligntax.data.derive.RECIPES
    sha256: str  # of the file the recipe writes
    note: str = ""


DERIVED: dict[str, DerivedFile] = {
    # random disjoint splits of 1,500 of PHTest's 2,069 harmless prompts (the rest held out for evaluation
    # outside the project), selected by the ids in aligntax/resources/data/phtest_splits.json
    "refusal/phtest/phtest_harmless_train.json": DerivedFile(
        (PHTEST_CSV,),
        "phtest-harmless-train",
        "0a422acc40fc795b471c5219dfa23805b62dcf8aa07966b8a9fb449d5525b715",
        "1,200 harmless PHTest prompts by pinned id",
    ),
    "refusal/phtest/phtest_harmless_val.json": DerivedFile(
        (PHTEST_CSV,),
        "phtest-harmless-val",
        "f47639bb54971ddedb3b2d93459b4ad3ea129c3828e3b937c55aa9d9532b15f7",
        "300 harmless PHTest prompts by pinned id, disjoint from the train split",
    ),
    "refusal/phtest/phtest_controversial.json": DerivedFile(
        (PHTEST_CSV,),
        "phtest-controversial",
        "487f57234e0620322da7ca1bc6a33ad704f09a9a59b1f84eea99576b0e0550da",
        "the 1,191 prompts PHTest labels controversial, in file order",
    ),
}

# Files fetched with another one: a dataset's license beside it.
COMPANIONS: dict[str, tuple[str, ...]] = {
    "refusal/xstest/xstest_prompts.csv": ("refusal/xstest/LICENSE_CC-BY-4.0.txt",),
    **{f"{GSM8K_DIR}/{split}.jsonl": (f"{GSM8K_DIR}/LICENSE",) for split in ("train", "test")},
    **{f"{JBB_ARTIFACTS_DIR}/{path}": (f"{JBB_ARTIFACTS_DIR}/LICENSE",) for path, _ in JBB_ATTACKS.values()},
}

# Fetch targets that are not named datasets: the XSTest human-labelled completions (judge validation).
FILE_GROUPS: dict[str, tuple[str, ...]] = {
    "xstest-labeled": tuple(f"{XSTEST_LABELED_DIR}/xstest_v2_completions_{m}.csv" for m in _XS_COMPLETIONS),
    "jbb-artifacts": (
        *(f"{JBB_ARTIFACTS_DIR}/{path}" for path, _ in JBB_ATTACKS.values()),
        f"{JBB_ARTIFACTS_DIR}/LICENSE",
    ),
    "gsm8k": (f"{GSM8K_DIR}/train.jsonl", f"{GSM8K_DIR}/test.jsonl", f"{GSM8K_DIR}/LICENSE"),
    "phtest-controversial": ("refusal/phtest/phtest_controversial.json",),
}

# path -> (why it cannot be fetched, the sha256 of the copy the project's results were made with)
NO_UPSTREAM: dict[str, tuple[str, str]] = {}
