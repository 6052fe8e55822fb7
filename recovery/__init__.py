"""recovery: resume training from a lowdiff checkpoint directory, or export a step."""
from .export import export
from .resume import resume

__all__ = ["export", "resume"]
