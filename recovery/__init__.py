"""recovery: resume training from a lowdiff checkpoint directory, or export a step."""
from .export import export
from .resume import Resumed, resume
from .verify import VerifyReport, verify

__all__ = ["Resumed", "VerifyReport", "export", "resume", "verify"]
