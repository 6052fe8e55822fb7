"""The option objects of ``lowdiff.wrap``: when to checkpoint (a schedule: ``Fixed``, ``Auto`` or
``Replica``), the loop and durability knobs (``Options``), and how they and a retention policy and
storage tiers resolve into one WrapConfig; also the one translation of wrap's deprecated keywords.

Each object is a frozen dataclass whose constructor refuses what cannot work, naming the field and
the value, so an impossible combination cannot be built:

* ``Fixed(full_every, batch_steps, differentials=True|False)``: nothing is chosen at run time.
* ``Auto(...)``: the controller chooses what is "auto" (``full_every``, ``batch_steps``, and with
  ``differentials="auto"`` whether to record differentials at all) from measured costs, the
  failure rate, the recovery budget and the batch memory bound. At least one of the three is
  "auto" (otherwise it is a ``Fixed``).
* ``Replica(full_every, batch_steps, inflight_steps)``: replica mode (LowDiff+,
  lowdiff.persist.replica). Its replica is persisted every ``full_every`` steps, a fixed int;
  differentials are always on (the persisted replica and the differentials after it are the state).

What depends on the run and on other arguments is checked by ``wrap``: "auto" and
``differentials=False`` under torch.distributed, ``Replica`` with a compressor other than Dense.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Literal

from lowdiff.store.retention import KeepLast, Policy, check_policy
from lowdiff.tiers.policy import Tiers
from lowdiff.train.config import WrapConfig

DEFAULT_FULL_EVERY = 100
DEFAULT_BATCH_STEPS = 10


def _refuse(owner: object, name: str, value: object, must: str) -> ValueError:
    return ValueError(f"{type(owner).__name__}({name}={value!r}): {name} must be {must}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_counts(owner: object, *names: str, auto: bool = False) -> None:
    for name in names:
        value = getattr(owner, name)
        if not (_is_count(value) or (auto and value == "auto")):
            raise _refuse(owner, name, value, "an int >= 1" + (" or 'auto'" if auto else ""))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Judged:
    """What the controller judges a schedule by (keywords of every schedule): the failure rate,
    the recovery budget ``max_recovery_s`` (load + replay at resume; None: no bound) and
    ``batch_memory_bytes`` (records held before they are durable). ``Auto``'s choices respect
    them; for fixed settings, ``opt.stats()`` reports the expected waste at that failure rate and
    names a bound the settings break."""

    failure_rate_per_hour: float = 0.1
    max_recovery_s: float | None = None
    batch_memory_bytes: int = 256 * 2**20

    def __repr__(self) -> str:
        """How a user writes it: the schedule's own fields, then the judged ones not at their default
        (the deprecation warnings quote it as the new spelling)."""
        judged = {f.name for f in dataclasses.fields(_Judged)}
        own = [f for f in dataclasses.fields(self) if f.name not in judged]
        shown = own + [f for f in dataclasses.fields(self) if f.name in judged and getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def _check_judged(self) -> None:
        if not _is_number(self.failure_rate_per_hour) or not self.failure_rate_per_hour > 0:
            raise _refuse(self, "failure_rate_per_hour", self.failure_rate_per_hour, "a number > 0")
        if self.max_recovery_s is not None and (not _is_number(self.max_recovery_s) or not self.max_recovery_s > 0):
            raise _refuse(self, "max_recovery_s", self.max_recovery_s, "a number > 0 or None")
        if not _is_count(self.batch_memory_bytes):
            raise _refuse(self, "batch_memory_bytes", self.batch_memory_bytes, "an int > 0")


@dataclasses.dataclass(frozen=True, repr=False)
class Fixed(_Judged):
    """A fixed schedule: a full checkpoint every ``full_every`` steps, differentials written in
    batches of ``batch_steps`` steps. ``differentials=False``: full checkpoints only (and one at
    ``flush()`` and ``close()``); a crash loses the steps since the last one."""

    full_every: int = DEFAULT_FULL_EVERY
    batch_steps: int = DEFAULT_BATCH_STEPS
    differentials: bool = True

    def __post_init__(self):
        _check_counts(self, "full_every", "batch_steps")
        self._check_judged()
        if not isinstance(self.differentials, bool):
            raise _refuse(self, "differentials", self.differentials,
                          "True or False (lowdiff.Auto(differentials='auto') lets the controller choose)")


@dataclasses.dataclass(frozen=True, repr=False)
class Auto(_Judged):
    """An automatic schedule (docs/controller.md): the controller chooses each field given as
    "auto" from costs measured while training, for ``failure_rate_per_hour``, within
    ``max_recovery_s`` (load + replay at resume; None: no bound) and ``batch_memory_bytes``
    (records not yet durable); an int pins that field. ``differentials``: True records every step
    (a crash loses at most about two batches); False takes full checkpoints only; "auto" lets the
    controller switch them off while recording costs more than it saves, and on again — the
    consent to lose up to ``full_every`` steps meanwhile."""

    full_every: int | Literal["auto"] = "auto"
    batch_steps: int | Literal["auto"] = "auto"
    differentials: bool | Literal["auto"] = True

    def __post_init__(self):
        _check_counts(self, "full_every", "batch_steps", auto=True)
        if not (isinstance(self.differentials, bool) or self.differentials == "auto"):
            raise _refuse(self, "differentials", self.differentials, "True, False or 'auto'")
        if "auto" not in (self.full_every, self.batch_steps, self.differentials):
            raise ValueError(f"Auto(full_every={self.full_every!r}, batch_steps={self.batch_steps!r}, "
                             f"differentials={self.differentials!r}) chooses nothing: give 'auto' for one of "
                             f"them, or use lowdiff.Fixed(...)")
        self._check_judged()


@dataclasses.dataclass(frozen=True, repr=False)
class Replica(_Judged):
    """Replica mode (LowDiff+, lowdiff.persist.replica): a CPU replica applies every step in the
    background and is persisted as a full checkpoint every ``full_every`` steps (or as soon as the
    previous write ended; 1: as often as the disk allows); differentials, in batches of
    ``batch_steps``, cover only the steps since the newest persisted replica. At most
    ``inflight_steps`` captured steps wait to be applied before ``step()`` waits. Needs
    ``compressor=lowdiff.Dense()`` (the default): the replica applies the dense gradient.
    ``allow_inexact_gpu``: the replica lives on the CPU; of a model on a GPU it may round
    differently from the training (CPU and CUDA optimizer kernels are not bit-identical), so
    wrap() refuses that unless this is True (then a resume from a persisted replica is close to,
    not equal to, the uninterrupted run)."""

    full_every: int = DEFAULT_FULL_EVERY
    batch_steps: int = DEFAULT_BATCH_STEPS
    inflight_steps: int = 2
    allow_inexact_gpu: bool = False

    def __post_init__(self):
        if self.full_every == "auto":
            raise ValueError("Replica(full_every='auto'): full_every='auto' is not supported in replica mode: give "
                             "how many steps apart the replica is persisted (1: as often as the disk allows)")
        _check_counts(self, "full_every", "batch_steps", "inflight_steps")
        if not isinstance(self.allow_inexact_gpu, bool):
            raise _refuse(self, "allow_inexact_gpu", self.allow_inexact_gpu, "True or False")
        self._check_judged()


Schedule = Fixed | Auto | Replica


@dataclasses.dataclass(frozen=True)
class Options:
    """The loop and durability knobs. ``boundary``: where an iteration ends — "step", the end of
    ``opt.step()``; "manual", ``opt.boundary()``, called by the loop after its work between steps.
    ``max_pending_batches``: batches recorded but not yet durable before ``step()`` blocks (a
    SIGKILL loses at most about that many). ``overwrite``: start recording over a directory that
    holds later steps without resuming from it. ``full_copy``: where a full checkpoint's state is
    copied into staging — "background" (the default), on the persist thread while the next forward
    and backward run (``step()`` waits only for what is left of it); "in_step", inside ``step()``
    before it returns. On our 2-core machine "in_step" cost more both ways (docs/measurements.md):
    it is there to measure the two on your machine.
    ``stripe_dirs``: directories on other local drives (one each) that every full checkpoint's
    payload is striped over, together with the checkpoint directory, written and read on every
    drive at once, and that differential batches go to in turn (docs/guide.md, "Several local
    drives"); under torch.distributed (the same list on every rank of a node), each rank's directory
    goes on one of the drives instead (docs/guide.md, "Several drives under DDP and FSDP2"); empty:
    one directory."""

    boundary: Literal["step", "manual"] = "step"
    max_pending_batches: int = 2
    overwrite: bool = False
    full_copy: Literal["background", "in_step"] = "background"
    stripe_dirs: tuple[str, ...] = ()

    def __post_init__(self):
        if self.boundary not in ("step", "manual"):
            raise _refuse(self, "boundary", self.boundary,
                          "'step' (the end of opt.step()) or 'manual' (opt.boundary())")
        _check_counts(self, "max_pending_batches")
        if not isinstance(self.overwrite, bool):
            raise _refuse(self, "overwrite", self.overwrite, "True or False")
        if self.full_copy not in ("background", "in_step"):
            raise _refuse(self, "full_copy", self.full_copy,
                          "'background' (the persist thread, beside the next iteration) or 'in_step' (inside step())")
        if isinstance(self.stripe_dirs, (str, bytes)) or not all(
                isinstance(d, (str, os.PathLike)) for d in self.stripe_dirs):
            raise _refuse(self, "stripe_dirs", self.stripe_dirs, "a tuple of directories (one per drive)")
        object.__setattr__(self, "stripe_dirs", tuple(os.fspath(d) for d in self.stripe_dirs))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def wrap_config(full_every: int | str | None, batch_steps: int | str | None, schedule: Schedule | None,
                retention: Policy | None, tiers: Tiers | None, options: Options | None) -> WrapConfig:
    """The WrapConfig of wrap's option arguments. ``full_every``/``batch_steps`` are the short
    spelling of a schedule (either may be "auto"); with ``schedule`` they are refused."""
    if schedule is None:
        schedule = schedule_of(full_every, batch_steps)
    elif full_every is not None or batch_steps is not None:
        given = ", ".join(f"{n}={v!r}" for n, v in (("full_every", full_every), ("batch_steps", batch_steps))
                          if v is not None)
        raise ValueError(f"{given} and schedule={schedule!r}: give the intervals in the schedule, not both")
    if not isinstance(schedule, (Fixed, Auto, Replica)):
        raise TypeError(f"schedule must be lowdiff.Fixed(...), lowdiff.Auto(...) or lowdiff.Replica(...), "
                        f"got {schedule!r}")
    if retention is not None:
        check_policy("retention", retention)
    if tiers is not None and not isinstance(tiers, Tiers):
        raise TypeError(f"tiers must be lowdiff.Tiers(...), got {type(tiers).__name__}")
    if tiers is not None and tiers.local is not None and retention is not None and tiers.local != retention:
        raise ValueError(f"retention={retention!r} and tiers=Tiers(local={tiers.local!r}) both name the policy of "
                         f"the local directory: give it once")
    options = Options() if options is None else options
    if not isinstance(options, Options):
        raise TypeError(f"options must be lowdiff.Options(...), got {options!r}")
    fields: dict[str, Any] = {"full_every": schedule.full_every, "batch_steps": schedule.batch_steps}
    if isinstance(schedule, Replica):
        fields.update(replica=True, replica_inflight_steps=schedule.inflight_steps,
                      replica_inexact_gpu=schedule.allow_inexact_gpu)
    else:
        fields["differentials"] = schedule.differentials
    fields.update(failure_rate_per_hour=schedule.failure_rate_per_hour, max_recovery_s=schedule.max_recovery_s,
                  batch_memory_bytes=schedule.batch_memory_bytes)
    return WrapConfig(**fields, retention=KeepLast(2) if retention is None else retention, tiers=tiers,
                      boundary=options.boundary, max_pending_batches=options.max_pending_batches,
                      overwrite=options.overwrite, full_copy=options.full_copy, stripe_dirs=options.stripe_dirs)


def schedule_of(full_every: int | str | None, batch_steps: int | str | None) -> Fixed | Auto:
    """The schedule ``full_every=..., batch_steps=...`` spell (the short spelling; None: the default)."""
    full = DEFAULT_FULL_EVERY if full_every is None else full_every
    batch = DEFAULT_BATCH_STEPS if batch_steps is None else batch_steps
    if "auto" in (full, batch):
        return Auto(full_every=full, batch_steps=batch)   # type: ignore[arg-type]
    for name, value in (("full_every", full), ("batch_steps", batch)):
        if not _is_count(value):
            raise ValueError(f"{name}={value!r} must be a positive int or 'auto'")
    return Fixed(full_every=full, batch_steps=batch)   # type: ignore[arg-type]


# wrap's keywords before the option objects, each with the object that now carries it.
_SCHEDULE_KEYWORDS = ("differentials", "failure_rate_per_hour", "max_recovery_s", "batch_memory_bytes",
                      "replica", "replica_inflight_steps")
_LIMITS = ("failure_rate_per_hour", "max_recovery_s", "batch_memory_bytes")
_OPTIONS_KEYWORDS = ("boundary", "max_pending_batches", "overwrite")
DEPRECATED = (*_SCHEDULE_KEYWORDS, *_OPTIONS_KEYWORDS, "keep_full", "shared_dir", "engine")


def translate_deprecated(old: dict[str, Any], new: dict[str, Any], stacklevel: int) -> Any:
    """The one translation of wrap's deprecated keywords (``old``) into its option objects: updates
    ``new`` (wrap's ``full_every``, ``batch_steps``, ``schedule``, ``retention``, ``tiers``,
    ``options``) and returns the fastio engine of ``engine=`` (None when not given). Each keyword
    given warns (DeprecationWarning) with its new spelling, pointing at the user's line:
    ``stacklevel`` frames above this function (wrap passes 2). An old keyword given together with
    the object that replaces it is refused."""
    unknown = sorted(set(old) - set(DEPRECATED))
    if unknown:
        raise TypeError(f"wrap() got an unexpected keyword argument {unknown[0]!r}")

    def warn(name: str, spelling: str) -> None:
        # (+2: this function and translate_deprecated.)
        warnings.warn(f"wrap({name}=...) is deprecated; write wrap(..., {spelling})", DeprecationWarning,
                      stacklevel=stacklevel + 2)

    def refuse_both(name: str, keyword: str) -> None:
        if new[keyword] is not None:
            raise ValueError(f"wrap({name}=...) and {keyword}={new[keyword]!r}: give {keyword}= alone")

    engine = old.get("engine")
    if "engine" in old:
        warn("engine", "FASTIO_BACKEND set in the environment (fastio's process-wide engine)")
    if "keep_full" in old:
        refuse_both("keep_full", "retention")
        new["retention"] = KeepLast(old["keep_full"])
        warn("keep_full", f"retention=lowdiff.KeepLast({old['keep_full']!r})")
    if "shared_dir" in old:
        shared_dir, tiers = old["shared_dir"], new["tiers"]
        if tiers is None:
            new["tiers"] = Tiers(shared_dir) if shared_dir is not None else None
        elif shared_dir is not None and Tiers(shared_dir).shared_dir != tiers.shared_dir:
            raise ValueError(f"shared_dir={shared_dir!r} differs from tiers.shared_dir={tiers.shared_dir!r}")
        warn("shared_dir", f"tiers=lowdiff.Tiers({shared_dir!r})")
    given = {name: old[name] for name in _OPTIONS_KEYWORDS if name in old}
    if given:
        refuse_both(next(iter(given)), "options")
        new["options"] = Options(**given)
        for name in given:
            warn(name, f"options=lowdiff.Options({name}={old[name]!r})")
    given = {name: old[name] for name in _SCHEDULE_KEYWORDS if name in old}
    if given:
        refuse_both(next(iter(given)), "schedule")
        schedule = _old_schedule(new.pop("full_every"), new.pop("batch_steps"), given)
        new.update(schedule=schedule, full_every=None, batch_steps=None)
        for name in given:
            warn(name, f"schedule=lowdiff.{schedule!r}")
    return engine


def _old_schedule(full_every: Any, batch_steps: Any, old: dict[str, Any]) -> Schedule:
    """The schedule wrap's old schedule keywords (``old``) and ``full_every``/``batch_steps`` spell."""
    full = DEFAULT_FULL_EVERY if full_every is None else full_every
    batch = DEFAULT_BATCH_STEPS if batch_steps is None else batch_steps
    differentials = old.get("differentials", True)
    limits = {name: old[name] for name in _LIMITS if name in old}
    if old.get("replica", False):
        if differentials is not True:
            raise ValueError(f"differentials={differentials!r} is not supported with replica=True (replica mode "
                             f"writes the differentials a persisted replica does not cover, and only those)")
        return Replica(full_every=full, batch_steps=batch, inflight_steps=old.get("replica_inflight_steps", 2),
                       **limits)
    if "auto" in (full, batch, differentials):
        return Auto(full_every=full, batch_steps=batch, differentials=differentials, **limits)
    return Fixed(full_every=full, batch_steps=batch, differentials=differentials, **limits)
