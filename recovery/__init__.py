"""recovery: resume training from a lowdiff checkpoint directory, or export a step."""
from recovery.export import export
from recovery.resume import Resumed, resume
from recovery.verify import VerifyReport, verify

__all__ = ["Resumed", "VerifyReport", "export", "resume", "verify"]
