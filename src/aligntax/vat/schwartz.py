"""Schwartz's theory of basic human values: the value circle, its groups, distances and names.

- The 10 basic values (Schwartz 1992) in circular order, ``VALUES``.
- The four higher-order groups and the two bipolar conflicts (Openness vs Conservation,
  Self-enhancement vs Self-transcendence).
- Adjacent and opposite pairs, and a circular distance between values.
- The 19 refined values (Schwartz et al. 2012) with their mapping to the 10, named as in the Touche
  ValueEval taxonomy (``schwartz_taxonomy/*.json`` in the shared data).
- The 56 Schwartz Value Survey (SVS) items with the item-to-value mapping used by ValueActionLens.
- Case-, hyphen- and space-insensitive name resolution with aliases (``resolve_value``).

Circular-distance convention
----------------------------
Conformity and Tradition share one wedge of the circle (Tradition lies further from the centre). The
default convention ``"wedge"`` therefore places the 10 values on **9 angular positions**:
Self-Direction 0, Stimulation 1, Hedonism 2, Achievement 3, Power 4, Security 5,
Conformity 6, Tradition 6, Benevolence 7, Universalism 8. The distance between two values is the number
of steps the short way round (0..4); Conformity-Tradition is 0. The alternative ``"ten"`` places the 10
values on 10 equally spaced positions in the listed order (distance 0..5, Conformity-Tradition 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from aligntax.errors import DataError


class UnknownValueError(DataError, KeyError):
    """A name that is not a Schwartz value, refined value or SVS item."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# ----------------------------------------------------------------- the 10 basic values
VALUES: tuple[str, ...] = (
    "Self-Direction",
    "Stimulation",
    "Hedonism",
    "Achievement",
    "Power",
    "Security",
    "Conformity",
    "Tradition",
    "Benevolence",
    "Universalism",
)
CODES: dict[str, str] = {
    "Self-Direction": "SD",
    "Stimulation": "ST",
    "Hedonism": "HE",
    "Achievement": "AC",
    "Power": "PO",
    "Security": "SE",
    "Conformity": "CO",
    "Tradition": "TR",
    "Benevolence": "BE",
    "Universalism": "UN",
}

# Defining motivational goals (Schwartz 1992, 2012), used for persona prompts and reports.
DEFINITIONS: dict[str, str] = {
    "Self-Direction": "independent thought and action: choosing, creating and exploring",
    "Stimulation": "excitement, novelty and challenge in life",
    "Hedonism": "pleasure and sensuous gratification for oneself",
    "Achievement": "personal success through demonstrating competence according to social standards",
    "Power": "social status and prestige, and control or dominance over people and resources",
    "Security": "safety, harmony and stability of society, of relationships and of oneself",
    "Conformity": (
        "restraint of actions, inclinations and impulses likely to upset or harm others and "
        "to violate social expectations or norms"
    ),
    "Tradition": (
        "respect, commitment and acceptance of the customs and ideas that one's culture or religion provides"
    ),
    "Benevolence": (
        "preserving and enhancing the welfare of the people one is in frequent personal contact with"
    ),
    "Universalism": (
        "understanding, appreciation, tolerance and protection for the welfare of all people and for nature"
    ),
}

# ----------------------------------------------------------------- higher-order groups
HIGHER_ORDER: dict[str, tuple[str, ...]] = {
    "Openness to change": ("Self-Direction", "Stimulation", "Hedonism"),
    "Self-enhancement": ("Achievement", "Power", "Hedonism"),
    "Conservation": ("Security", "Conformity", "Tradition"),
    "Self-transcendence": ("Benevolence", "Universalism"),
}
# Hedonism sits on the border of Openness to change and Self-enhancement; its primary group here is
# Openness to change (as in the 4-group scoring of the PVQ).
PRIMARY_GROUP: dict[str, str] = {
    "Self-Direction": "Openness to change",
    "Stimulation": "Openness to change",
    "Hedonism": "Openness to change",
    "Achievement": "Self-enhancement",
    "Power": "Self-enhancement",
    "Security": "Conservation",
    "Conformity": "Conservation",
    "Tradition": "Conservation",
    "Benevolence": "Self-transcendence",
    "Universalism": "Self-transcendence",
}
BIPOLAR: tuple[tuple[str, str], ...] = (
    ("Openness to change", "Conservation"),
    ("Self-enhancement", "Self-transcendence"),
)

# ----------------------------------------------------------------- circle geometry
_WEDGE_POSITION: dict[str, int] = {
    "Self-Direction": 0,
    "Stimulation": 1,
    "Hedonism": 2,
    "Achievement": 3,
    "Power": 4,
    "Security": 5,
    "Conformity": 6,
    "Tradition": 6,
    "Benevolence": 7,
    "Universalism": 8,
}
CONVENTIONS = ("wedge", "ten")


def circle_position(value: str, convention: str = "wedge") -> tuple[int, int]:
    """(position, number of positions) of a value on the circle under a convention."""
    v = resolve_value(value)
    if convention == "wedge":
        return _WEDGE_POSITION[v], 9
    if convention == "ten":
        return VALUES.index(v), 10
    raise ValueError(f"Unknown circle convention '{convention}'; use one of {CONVENTIONS}")


def circular_distance(a: str, b: str, convention: str = "wedge") -> int:
    """Steps between two values the short way round the circle (see the module doc for conventions)."""
    pa, n = circle_position(a, convention)
    pb, _ = circle_position(b, convention)
    k = abs(pa - pb) % n
    return min(k, n - k)


def distance_matrix(convention: str = "wedge", order: tuple[str, ...] = VALUES) -> np.ndarray:
    """Circular distance between every pair of values, in ``order`` (default: circle order)."""
    return np.array([[circular_distance(a, b, convention) for b in order] for a in order], dtype=float)


def circle_angles(convention: str = "wedge") -> dict[str, float]:
    """Angle in radians of each value for plots. Under ``wedge``, Conformity and Tradition are split
    slightly apart inside their shared wedge so both stay visible."""
    out = {}
    for v in VALUES:
        p, n = circle_position(v, convention)
        offset = 0.0
        if convention == "wedge" and v in ("Conformity", "Tradition"):
            offset = -0.22 if v == "Conformity" else 0.22
        out[v] = 2 * np.pi * (p + offset) / n
    return out


def _pairs(pred) -> tuple[tuple[str, str], ...]:
    return tuple((a, b) for i, a in enumerate(VALUES) for b in VALUES[i + 1 :] if pred(a, b))


# Adjacent (compatible) pairs: neighbours on the circle, i.e. distance <= 1 under the wedge convention.
# This includes Conformity-Tradition (same wedge), and Security and Benevolence with both of them.
def _wedge_distance(a: str, b: str) -> int:
    k = abs(_WEDGE_POSITION[a] - _WEDGE_POSITION[b]) % 9
    return min(k, 9 - k)


ADJACENT_PAIRS: tuple[tuple[str, str], ...] = _pairs(lambda a, b: _wedge_distance(a, b) <= 1)

# Opposite (conflicting) pairs, as stated by the theory: Openness to change vs Conservation
# (Self-Direction, Stimulation, Hedonism vs Security, Conformity, Tradition; Hedonism vs Conformity and
# Tradition) and Self-enhancement vs Self-transcendence (Achievement, Power vs Benevolence, Universalism).
OPPOSITE_PAIRS: tuple[tuple[str, str], ...] = (
    ("Self-Direction", "Security"),
    ("Self-Direction", "Conformity"),
    ("Self-Direction", "Tradition"),
    ("Stimulation", "Security"),
    ("Stimulation", "Conformity"),
    ("Stimulation", "Tradition"),
    ("Hedonism", "Conformity"),
    ("Hedonism", "Tradition"),
    ("Achievement", "Benevolence"),
    ("Achievement", "Universalism"),
    ("Power", "Benevolence"),
    ("Power", "Universalism"),
)


def are_adjacent(a: str, b: str) -> bool:
    a, b = resolve_value(a), resolve_value(b)
    return a != b and circular_distance(a, b) <= 1


def are_opposite(a: str, b: str) -> bool:
    a, b = resolve_value(a), resolve_value(b)
    return (a, b) in OPPOSITE_PAIRS or (b, a) in OPPOSITE_PAIRS


def opposites(value: str) -> tuple[str, ...]:
    v = resolve_value(value)
    return tuple(b if a == v else a for a, b in OPPOSITE_PAIRS if v in (a, b))


def neighbours(value: str) -> tuple[str, ...]:
    v = resolve_value(value)
    return tuple(b if a == v else a for a, b in ADJACENT_PAIRS if v in (a, b))


# ----------------------------------------------------------------- the 19 refined values
@dataclass(frozen=True)
class RefinedValue:
    key: str  # as in the Touche ValueEval taxonomy, e.g. "self-direction-thought"
    name: str  # e.g. "Self-direction: thought"
    basic: str  # one of the 10 basic values
    groups: tuple[str, ...]  # higher-order group(s)
    goal: str


_OC, _SEN, _CON, _STR = "Openness to change", "Self-enhancement", "Conservation", "Self-transcendence"
REFINED_VALUES: tuple[RefinedValue, ...] = (
    RefinedValue(
        "self-direction-thought",
        "Self-direction: thought",
        "Self-Direction",
        (_OC,),
        "Freedom to cultivate one's own ideas and abilities.",
    ),
    RefinedValue(
        "self-direction-action",
        "Self-direction: action",
        "Self-Direction",
        (_OC,),
        "Freedom to determine one's own actions.",
    ),
    RefinedValue("stimulation", "Stimulation", "Stimulation", (_OC,), "Excitement, novelty, and change."),
    RefinedValue("hedonism", "Hedonism", "Hedonism", (_OC, _SEN), "Pleasure and sensuous gratification."),
    RefinedValue(
        "achievement", "Achievement", "Achievement", (_SEN,), "Success according to social standards."
    ),
    RefinedValue(
        "power-dominance",
        "Power: dominance",
        "Power",
        (_SEN,),
        "Power through exercising control over people.",
    ),
    RefinedValue(
        "power-resources",
        "Power: resources",
        "Power",
        (_SEN,),
        "Power through control of material and social resources.",
    ),
    RefinedValue(
        "face",
        "Face",
        "Power",
        (_SEN, _CON),
        "Security and power through maintaining one's public image and avoiding humiliation.",
    ),
    RefinedValue(
        "security-personal",
        "Security: personal",
        "Security",
        (_CON,),
        "Safety in one's immediate environment.",
    ),
    RefinedValue(
        "security-societal",
        "Security: societal",
        "Security",
        (_CON,),
        "Safety and stability in the wider society.",
    ),
    RefinedValue(
        "tradition",
        "Tradition",
        "Tradition",
        (_CON,),
        "Maintaining and preserving cultural, family, or religious traditions.",
    ),
    RefinedValue(
        "conformity-rules",
        "Conformity: rules",
        "Conformity",
        (_CON,),
        "Compliance with rules, laws, and formal obligations.",
    ),
    RefinedValue(
        "conformity-interpersonal",
        "Conformity: interpersonal",
        "Conformity",
        (_CON,),
        "Avoidance of upsetting or harming other people.",
    ),
    RefinedValue(
        "humility",
        "Humility",
        "Tradition",
        (_CON, _STR),
        "Recognizing one's insignificance in the larger scheme of things.",
    ),
    RefinedValue(
        "benevolence-caring",
        "Benevolence: caring",
        "Benevolence",
        (_STR,),
        "Devotion to the welfare of in-group members.",
    ),
    RefinedValue(
        "benevolence-dependability",
        "Benevolence: dependability",
        "Benevolence",
        (_STR,),
        "Being a reliable and trustworthy member of the in-group.",
    ),
    RefinedValue(
        "universalism-concern",
        "Universalism: concern",
        "Universalism",
        (_STR,),
        "Commitment to equality, justice, and protection for all people.",
    ),
    RefinedValue(
        "universalism-nature",
        "Universalism: nature",
        "Universalism",
        (_STR,),
        "Preservation of the natural environment.",
    ),
    RefinedValue(
        "universalism-tolerance",
        "Universalism: tolerance",
        "Universalism",
        (_STR,),
        "Acceptance and understanding of those who are different from oneself.",
    ),
)
# Face -> Power and Humility -> Tradition follow the SVS items they grew out of ("Preserving my Public
# Image" is a Power item and "Humble" a Tradition item in the 56-item mapping below). The Touche
# taxonomy's extra category "Universalism: objectivity" is not one of Schwartz's 19 and is not listed;
# ``resolve_value`` still maps it to Universalism.
REFINED_TO_BASIC: dict[str, str] = {r.name: r.basic for r in REFINED_VALUES}

# ----------------------------------------------------------------- the 56 SVS items
SVS_ITEMS: dict[str, tuple[str, ...]] = {
    "Power": ("Social Power", "Authority", "Wealth", "Preserving my Public Image", "Social Recognition"),
    "Achievement": ("Successful", "Capable", "Ambitious", "Influential", "Intelligent", "Self-Respect"),
    "Hedonism": ("Pleasure", "Enjoying Life"),
    "Stimulation": ("Daring", "A Varied Life", "An Exciting Life"),
    "Self-Direction": ("Creativity", "Curious", "Freedom", "Choosing Own Goals", "Independent"),
    "Universalism": (
        "Protecting the Environment",
        "A World of Beauty",
        "Broad-Minded",
        "Social Justice",
        "Wisdom",
        "Equality",
        "A World at Peace",
        "Inner Harmony",
        "Unity With Nature",
    ),
    "Benevolence": (
        "Helpful",
        "Honest",
        "Forgiving",
        "Loyal",
        "Responsible",
        "True Friendship",
        "A Spiritual Life",
        "Mature Love",
        "Meaning in Life",
    ),
    "Tradition": (
        "Devout",
        "Accepting my Portion in Life",
        "Humble",
        "Moderate",
        "Respect for Tradition",
        "Detachment",
    ),
    "Conformity": ("Politeness", "Honoring of Parents and Elders", "Obedient", "Self-Discipline"),
    "Security": (
        "Clean",
        "National Security",
        "Social Order",
        "Family Security",
        "Reciprocation of Favors",
        "Healthy",
        "Sense of Belonging",
    ),
}
SVS_TO_BASIC: dict[str, str] = {item: v for v, items in SVS_ITEMS.items() for item in items}
assert len(SVS_TO_BASIC) == 56

# ----------------------------------------------------------------- names
_ALIASES: dict[str, str] = {
    "selfdirection": "Self-Direction",
    "self direction": "Self-Direction",
    "autonomy": "Self-Direction",
    "stimulation": "Stimulation",
    "novelty": "Stimulation",
    "excitement": "Stimulation",
    "hedonism": "Hedonism",
    "hedonistic": "Hedonism",
    "achievement": "Achievement",
    "success": "Achievement",
    "power": "Power",
    "security": "Security",
    "safety": "Security",
    "conformity": "Conformity",
    "tradition": "Tradition",
    "traditional": "Tradition",
    "benevolence": "Benevolence",
    "benevolent": "Benevolence",
    "universalism": "Universalism",
    "universal": "Universalism",
    "universalism objectivity": "Universalism",
    "humility": "Tradition",
    "face": "Power",
}


def normalize_name(name: str) -> str:
    """Lower case, with hyphens, underscores, colons, slashes and repeated spaces folded to one space."""
    s = str(name).strip().lower().replace("\u2013", "-").replace("\u2014", "-").replace("\u2019", "'")
    s = re.sub(r"[-_:/.]+", " ", s)
    return re.sub(r"\s+", " ", s).strip()


def _build_lookup() -> dict[str, str]:
    table: dict[str, str] = {}
    for v in VALUES:
        table[normalize_name(v)] = v
        table[normalize_name(CODES[v])] = v
    for alias, v in _ALIASES.items():
        table[normalize_name(alias)] = v
    for r in REFINED_VALUES:
        table[normalize_name(r.name)] = r.basic
        table[normalize_name(r.key)] = r.basic
    for item, v in SVS_TO_BASIC.items():
        table.setdefault(normalize_name(item), v)
    # "the ..."/"my ..." variants of SVS items are common in other copies of the survey
    for item, v in SVS_TO_BASIC.items():
        n = normalize_name(item)
        table.setdefault(n.replace(" my ", " one's "), v)
        table.setdefault(n.replace("my ", ""), v)
    return table


_LOOKUP = _build_lookup()
_SVS_LOOKUP = {normalize_name(i): i for i in SVS_TO_BASIC}


def resolve_value(name: str) -> str:
    """The basic value (one of ``VALUES``) that a name denotes: a basic value (any case, hyphens or
    spaces, or its two-letter code), a refined value (``"Power: dominance"``), or an SVS item
    (``"Social Power"``). Raises ``UnknownValueError`` otherwise."""
    key = normalize_name(name)
    if key in _LOOKUP:
        return _LOOKUP[key]
    compact = key.replace(" ", "")
    for k, v in _LOOKUP.items():
        if k.replace(" ", "") == compact:
            return v
    raise UnknownValueError(
        f"Unknown value name '{name}'. Use one of the 10 basic values ({', '.join(VALUES)}), "
        "a refined value such as 'Power: dominance', or one of the 56 SVS items such as 'Social Power'."
    )


def is_value_name(name: str) -> bool:
    try:
        resolve_value(name)
    except UnknownValueError:
        return False
    return True


def resolve_svs_item(name: str) -> str | None:
    """The canonical SVS item name for a name, or None if it is not one of the 56 items."""
    return _SVS_LOOKUP.get(normalize_name(name))


def value_index(name: str) -> int:
    return VALUES.index(resolve_value(name))


def circle_text(convention: str = "wedge") -> str:
    """A plain-text description of the circle, for ``aligntax vat values``."""
    lines = []
    for v in VALUES:
        pos, n = circle_position(v, convention)
        items = ", ".join(SVS_ITEMS[v])
        refined = ", ".join(r.name for r in REFINED_VALUES if r.basic == v)
        lines.append(
            f"{pos:>2}/{n} {v:<15} [{CODES[v]}] {PRIMARY_GROUP[v]:<19} | refined: {refined} | SVS: {items}"
        )
    lines.append("Opposites: " + "; ".join(f"{a}-{b}" for a, b in OPPOSITE_PAIRS))
    lines.append(
        "Circular distance convention: "
        + (
            "'wedge' (9 positions; Conformity and Tradition share a wedge, distance 0)"
            if convention == "wedge"
            else "'ten' (10 equal positions in circle order)"
        )
    )
    return "\n".join(lines)
