"""Hydra config dataclasses for :class:`~torchrl_dcp.DistributedCheckpoint` and :class:`~torchrl_dcp.CheckpointRotation`.

They plug into torchrl's config system (``torchrl.trainers.algorithms.configs``): importing this module stores
them in Hydra's ``ConfigStore`` under the groups named after the torchrl trainer configs' fields they fill,
``checkpoint`` and ``checkpoint_rotation`` (option ``torchrl_dcp``), as torchrl stores its own ``collector``,
``replay_buffer`` or ``logger`` configs. A trainer YAML then picks them in its defaults list::

    defaults:
      - trainer: sac
      - checkpoint@trainer.checkpoint: torchrl_dcp
      - checkpoint_rotation@trainer.checkpoint_rotation: torchrl_dcp
      - _self_
    trainer:
      checkpoint_rotation: {directory: ckpts/run, every_steps: 10000, keep_last: 2, preemption_signals: [SIGTERM]}

``hydra.utils.instantiate(cfg.trainer)`` builds both objects first and torchrl's trainer factory passes them to
the Trainer as ``checkpoint=`` and ``checkpoint_rotation=``, which bind as in ``docs/components/trainer.md``.
Each field is an option of the constructor, with its default; ``__post_init__`` checks the values with the
library's own checks and names the config in the error, and a YAML value is checked the same way at
instantiation (``_target_`` is a factory here that builds the config first). Needs ``pip install
'torchrl_dcp[hydra]'`` (hydra-core, omegaconf); ``import torchrl_dcp`` never imports this module. See
docs/configs.md and ``torchrl_dcp/examples/configs/sac_trainer.yaml``.

Example:
    >>> from omegaconf import OmegaConf
    >>> from hydra.utils import instantiate
    >>> import tempfile
    >>> cfg = OmegaConf.structured(CheckpointRotationConfig(directory=tempfile.mkdtemp(), every_steps=100, keep_last=2))
    >>> rotation = instantiate(OmegaConf.create(OmegaConf.to_yaml(cfg)))
    >>> type(rotation).__name__, rotation.keep_last, rotation.schedule.every_steps
    ('CheckpointRotation', 2, 100)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, get_args

try:
    from hydra.core.config_store import ConfigStore
    from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
except ImportError as err:  # pragma: no cover - exercised where hydra is missing
    raise ImportError("torchrl_dcp.configs needs hydra-core and omegaconf: pip install 'torchrl_dcp[hydra]'") from err

__all__ = [
    "GROUP_CHECKPOINT",
    "GROUP_ROTATION",
    "OPTION",
    "CheckpointRotationConfig",
    "DistributedCheckpointConfig",
    "checkpoint_rotation",
    "distributed_checkpoint",
    "register_configs",
]

#: the ConfigStore groups: the names of the torchrl trainer configs' fields these configs fill
GROUP_CHECKPOINT = "checkpoint"
GROUP_ROTATION = "checkpoint_rotation"
#: the option name of both configs in their group (``checkpoint@trainer.checkpoint: torchrl_dcp``)
OPTION = "torchrl_dcp"


class _Options:
    """What both configs share: the constructor's options as plain Python values, checked, named in errors."""

    def options(self) -> dict[str, Any]:
        """The constructor's keyword arguments (plain lists and dicts; no ``_target_``)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}  # type: ignore[arg-type]

    def _check(self, check: Any, *args: Any) -> Any:
        try:
            return check(*args)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{type(self).__name__}: {err}") from None


@dataclass
class DistributedCheckpointConfig(_Options):
    """:class:`~torchrl_dcp.DistributedCheckpoint`'s plain options (the Trainer registers the components).

    ``timeout`` is in seconds. ``process_group`` is not a config value (a live object): a job that checkpoints
    among a subgroup builds the checkpoint in Python. See :class:`~torchrl_dcp.DistributedCheckpoint`.

    Example:
        >>> DistributedCheckpointConfig(strict="warn").build().strict
        'warn'
    """

    strict: str = "error"
    save_components: list[str] | None = None
    timeout: float | None = None
    replica_check: str = "sample"
    storage_options: Any = None  # fsspec options, or None (Any: as `local` of CheckpointRotationConfig says)
    no_dist: bool = False
    _target_: str = "torchrl_dcp.configs.distributed_checkpoint"

    def __post_init__(self) -> None:
        from torchrl_dcp.load_engine import Strictness
        from torchrl_dcp.replicas import check_mode

        name = type(self).__name__
        if self.strict not in get_args(Strictness):
            raise ValueError(f"{name}: strict must be 'error', 'warn' or 'ignore', got {self.strict!r}")
        self._check(check_mode, self.replica_check)
        timeout = self.timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"{name}: timeout must be a number of seconds or None, got {timeout!r}")
        if timeout is not None:
            from torchrl_dcp.arguments import check_timeout

            self._check(check_timeout, timeout)  # (the constructor's own check: finite, positive, in range)
        if isinstance(self.save_components, (tuple, set, frozenset)):
            self.save_components = sorted(self.save_components)  # (what YAML gives back)
        components = _plain(self.save_components)
        if components is not None and (
            not isinstance(components, list) or not all(isinstance(c, str) and c for c in components)
        ):
            raise TypeError(f"{name}: save_components must be a list of component names or None")
        if self.storage_options is not None and not isinstance(_plain(self.storage_options), dict):
            raise TypeError(f"{name}: storage_options must be a mapping of fsspec options or None")
        if not isinstance(self.no_dist, bool):
            raise TypeError(f"{name}: no_dist must be True or False, got {self.no_dist!r}")

    def build(self) -> Any:
        """The :class:`~torchrl_dcp.DistributedCheckpoint` these options describe (no component registered)."""
        from torchrl_dcp.checkpoint import DistributedCheckpoint

        return DistributedCheckpoint(**self.options())


@dataclass
class CheckpointRotationConfig(_Options):
    """:class:`~torchrl_dcp.CheckpointRotation`'s options: where, when to save, what to keep, how.

    The policies of docs/job_loop.md: ``every_steps`` / ``every_seconds`` (when :meth:`maybe_save`, and a bound
    Trainer, save), ``keep_last`` / ``keep_every`` / ``keep_best`` (``[metadata_key, max | min]`` or
    ``[key, mode, count]``), ``async_saves``, ``preemption_signals`` (names: ``[SIGTERM, SIGUSR1]``), ``archive``,
    ``incremental``, ``storage_options`` (fsspec options when ``directory`` is a URL), ``local`` (a node-local
    tier: :class:`~torchrl_dcp.LocalTier`'s keywords, ``{path: /dev/shm/run, every_steps: 100}``; docs/recovery.md).
    ``directory`` has no default (``???``: the YAML or a command-line override sets it).

    Example:
        >>> CheckpointRotationConfig(directory="ckpts", keep_last=0)
        Traceback (most recent call last):
        ...
        ValueError: CheckpointRotationConfig: keep_last must be a positive integer or None, got 0
    """

    directory: str = MISSING
    keep_last: int | None = None
    keep_best: list[Any] | None = None
    keep_every: int | None = None
    every_steps: int | None = None
    every_seconds: float | None = None
    async_saves: bool = False
    preemption_signals: list[str] = field(default_factory=list)
    archive: bool = False
    incremental: bool = True
    storage_options: Any = None  # fsspec options, or None (Any: as `local` of CheckpointRotationConfig says)
    local: Any = None  # LocalTier's options, or None. Any: OmegaConf 2.3 fails to merge a command-line
    # mapping into an Optional[Dict] field that is None ('NoneType' object has no attribute 'get'); checked below
    _target_: str = "torchrl_dcp.configs.checkpoint_rotation"

    def __post_init__(self) -> None:
        from torchrl_dcp.preemption import check_signals
        from torchrl_dcp.save_policy import Retention, SaveSchedule, parse_keep_best

        name = type(self).__name__
        if isinstance(self.keep_best, tuple):
            self.keep_best = list(self.keep_best)  # (what YAML gives back)
        if isinstance(self.preemption_signals, tuple):
            self.preemption_signals = list(self.preemption_signals)
        if self.directory is not MISSING and (not isinstance(self.directory, str) or not self.directory):
            raise TypeError(f"{name}: directory must be a non-empty path or URL, got {self.directory!r}")
        self._check(lambda: Retention(self.keep_last, self.keep_every, parse_keep_best(_plain(self.keep_best))))
        self._check(SaveSchedule, self.every_steps, self.every_seconds)
        for flag in ("async_saves", "archive", "incremental"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{name}: {flag} must be True or False, got {getattr(self, flag)!r}")
        signals = _plain(self.preemption_signals)
        if not isinstance(signals, list) or not all(isinstance(s, str) for s in signals):
            raise TypeError(f"{name}: preemption_signals must be a list of signal names (SIGTERM), got {signals!r}")
        self._check(check_signals, signals)
        if self.storage_options is not None and not isinstance(_plain(self.storage_options), dict):
            raise TypeError(f"{name}: storage_options must be a mapping of fsspec options or None")
        if self.local is not None:
            self._check(_local_tier, _plain(self.local))

    def build(self) -> Any:
        """The :class:`~torchrl_dcp.CheckpointRotation` these options describe (signal handlers installed)."""
        from torchrl_dcp.rotation import CheckpointRotation

        if self.directory is MISSING or self.directory == "???":
            raise ValueError(f"{type(self).__name__}: directory is not set (where the step-<N> entries go)")
        options = self.options()
        if options["local"] is not None:
            options["local"] = _local_tier(options["local"])
        return CheckpointRotation(options.pop("directory"), **options)


def _local_tier(options: Any) -> Any:
    """The :class:`~torchrl_dcp.LocalTier` of a config's ``local`` mapping (its keywords; ``path`` required)."""
    from torchrl_dcp.local_tier import LocalTier

    if not isinstance(options, dict) or "path" not in options:
        raise TypeError(f"local must be a mapping of LocalTier's options with a path, got {options!r}")
    options = dict(options)
    return LocalTier(options.pop("path"), **options)


def distributed_checkpoint(**options: Any) -> Any:
    """``_target_`` of :class:`DistributedCheckpointConfig`: check the options as the config does, then build."""
    return DistributedCheckpointConfig(**{k: _plain(v) for k, v in options.items()}).build()


def checkpoint_rotation(**options: Any) -> Any:
    """``_target_`` of :class:`CheckpointRotationConfig`: check the options as the config does, then build."""
    return CheckpointRotationConfig(**{k: _plain(v) for k, v in options.items()}).build()


def register_configs(cs: Any = None) -> Any:
    """Store both configs in ``cs`` (default: Hydra's ``ConfigStore.instance()``) as torchrl stores its own:
    ``checkpoint/torchrl_dcp`` and ``checkpoint_rotation/torchrl_dcp``. Idempotent; run at import. Returns ``cs``.

    Example:
        >>> cs = register_configs()
        >>> "torchrl_dcp.yaml" in cs.list("checkpoint_rotation")
        True
    """
    cs = ConfigStore.instance() if cs is None else cs
    cs.store(group=GROUP_CHECKPOINT, name=OPTION, node=DistributedCheckpointConfig)
    cs.store(group=GROUP_ROTATION, name=OPTION, node=CheckpointRotationConfig)
    return cs


def _plain(value: Any) -> Any:
    """A DictConfig / ListConfig (what Hydra passes to a ``_target_``) as plain dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


register_configs()
