"""Defaults shared by every generating command (``aligntax eval``, ``generate``, ``knowns`` and the
demo), kept in one place and free of heavy imports so the command line can show them in ``--help``.

- ``DEFAULT_MAX_NEW_TOKENS = 48``: the answer length the refusal judge was validated at on XSTest's
  human labels (docs/judges.md); longer answers cost time without changing most verdicts.
- ``DEFAULT_TEMPERATURE = 0.0``: greedy decoding, which gives the same answers on every run (a
  temperature above 0 samples at that temperature).
"""

DEFAULT_MAX_NEW_TOKENS = 48
DEFAULT_TEMPERATURE = 0.0
