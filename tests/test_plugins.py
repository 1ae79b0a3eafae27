"""An outside package registers an intervention method through the ``aligntax.interventions`` entry-point
group, without editing aligntax: a tiny package installed in a temporary folder (its module and a
``.dist-info`` with its entry point, as pip writes them) on the path of a fresh interpreter. Its method is
listed after the built-in ones, builds from keyword options, and its options reach the command line; a
broken plugin is left out with a warning naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGIN = """
from dataclasses import dataclass

from aligntax.interventions.options import option, register
from aligntax.interventions.prompting import SystemPrompt


@dataclass
class ShoutOptions:
    text: str | None = option("the system prompt, shouted", cli=False)
    volume: float | None = option(
        "how loud (unused)", flag="--shout-volume", parse="float", check="nonnegative"
    )


@register("shout", ShoutOptions, "the system prompt in capitals (an outside package's method)")
def build(lm, o):
    return SystemPrompt((o.text or "answer helpfully").upper(), name="shout")
"""


def install(root: Path, dist: str, module: str, source: str, entry: str) -> None:
    """What ``pip install --target root`` leaves for a one-module package with one entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[aligntax.interventions]\n{entry} = {module}\n")
    (info / "RECORD").write_text("")


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="200", NO_COLOR="1")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_an_installed_package_registers_a_method(tmp_path):
    install(tmp_path, "aligntax-shout", "aligntax_shout", PLUGIN, "shout")
    code = textwrap.dedent(
        """
        from aligntax.interventions.registry import INTERVENTIONS, PLUGINS, make_intervention
        print(INTERVENTIONS[-1], PLUGINS)
        iv = make_intervention("shout", None, text="be brief")
        print(iv.prepare_messages([{"role": "user", "content": "hi"}])[0]["content"])
        """
    )
    res = run(tmp_path, "-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["shout ('shout',)", "BE BRIEF"]
    help_text = run(tmp_path, "-m", "aligntax", "generate", "--help")
    assert help_text.returncode == 0 and "--shout-volume" in help_text.stdout, help_text.stderr
    bad = run(tmp_path, "-m", "aligntax", "generate", "hi", "--intervention", "shout", "--shout-volume", "-1")
    assert bad.returncode == 2 and "--shout-volume takes a finite number >= 0" in bad.stderr, bad.stderr


def test_a_broken_plugin_is_left_out_with_a_warning(tmp_path):
    install(tmp_path, "aligntax-shout", "aligntax_shout", PLUGIN, "shout")
    install(tmp_path, "aligntax-broken", "aligntax_broken", "raise ImportError('no such thing')\n", "broken")
    res = run(tmp_path, "-c", "from aligntax.interventions.registry import PLUGINS; print(PLUGINS)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "('shout',)"
    assert (
        "intervention plugin 'broken' (aligntax_broken) was not loaded: ImportError: no such thing"
        in res.stderr
    )
