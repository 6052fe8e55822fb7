"""recovery: resume training from a lowdiff checkpoint directory, or export a step."""
from .export import export
from .resume import Resumed, resume

__all__ = ["Resumed", "export", "resume"]
