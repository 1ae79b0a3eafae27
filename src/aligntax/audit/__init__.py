"""``aligntax audit``: the alignment-tax report card of a change to a model (an intervention, an adapter or
another checkpoint) against the model itself, over declared panels, with paired statistics, the Holm
correction, each row's detectable change and a policy's verdict (docs/audit.md)."""

from aligntax.audit.runner import AuditConfig, plan_audit, rescore, run_audit
from aligntax.audit.spec import load_panels, load_policy

__all__ = ["AuditConfig", "load_panels", "load_policy", "plan_audit", "rescore", "run_audit"]
