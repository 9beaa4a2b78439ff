"""Hydra config dataclasses (torchrl_dcp.configs): config round trip, validation, ConfigStore registration, and the
YAML example that trains torchrl's SACTrainer with our checkpointing and resumes it."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hydra", reason="hydra-core is not installed: pip install -e '.[hydra]' (CI installs it)")
pytest.importorskip("omegaconf", reason="omegaconf is not installed: pip install -e '.[hydra]' (CI installs it)")

from hydra.errors import InstantiationException  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import ValidationError  # noqa: E402

import torchrl_dcp as tdcp  # noqa: E402
from torchrl_dcp import configs  # noqa: E402
from torchrl_dcp.configs import CheckpointRotationConfig, DistributedCheckpointConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def checkpoint_options(ckpt: tdcp.DistributedCheckpoint) -> dict[str, Any]:
    return {
        "strict": ckpt.strict,
        "save_components": ckpt.save_components,
        "timeout": ckpt.timeout,
        "replica_check": ckpt.replica_check,
        "storage_options": ckpt.storage_options,
        "no_dist": ckpt.no_dist,
        "process_group": ckpt.process_group,
        "components": dict(ckpt.components),
    }


def rotation_options(rotation: tdcp.CheckpointRotation) -> dict[str, Any]:
    watcher = rotation._watcher
    return {
        "directory": rotation.directory,
        "location": type(rotation.location).__name__,
        "retention": rotation.retention,
        "schedule": rotation.schedule,
        "async_saves": rotation.async_saves,
        "signals": None if watcher is None else watcher.signals,
        "archive": rotation.archive,
        "incremental": rotation.incremental,
    }


def yaml_round_trip(cfg: Any) -> Any:
    """dataclass -> OmegaConf.structured -> YAML text -> loaded and merged into the schema -> instantiated."""
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    loaded = OmegaConf.merge(OmegaConf.structured(type(cfg)), OmegaConf.create(text))  # typed as the config
    assert OmegaConf.to_object(loaded) == cfg  # the same options back
    return instantiate(loaded)


CHECKPOINTS = [
    {},
    {"strict": "warn", "save_components": ["policy", "optimizer"], "timeout": 42.5, "replica_check": "full"},
    {"strict": "ignore", "replica_check": "off", "storage_options": {"anon": True, "client_kwargs": {"x": 1}}},
    {"no_dist": True},
]


@pytest.mark.parametrize("options", CHECKPOINTS, ids=[",".join(o) or "defaults" for o in CHECKPOINTS])
def test_config_round_trip_checkpoint(options: dict[str, Any]) -> None:
    built = yaml_round_trip(DistributedCheckpointConfig(**options))
    assert type(built) is tdcp.DistributedCheckpoint
    assert checkpoint_options(built) == checkpoint_options(tdcp.DistributedCheckpoint(**options))
    assert checkpoint_options(DistributedCheckpointConfig(**options).build()) == checkpoint_options(built)


ROTATIONS = [
    {},
    {"keep_last": 3, "every_steps": 500, "keep_every": 1000},
    {"keep_best": ["reward", "max", 2], "every_seconds": 12.5, "async_saves": True},
    {"keep_best": ("loss", "min"), "preemption_signals": ["SIGUSR1", "SIGUSR2"], "incremental": False},
    {"archive": True, "keep_last": 1},
]


@pytest.mark.parametrize("options", ROTATIONS, ids=[",".join(o) or "defaults" for o in ROTATIONS])
def test_config_round_trip_rotation(tmp_path: Path, options: dict[str, Any]) -> None:
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    built = yaml_round_trip(CheckpointRotationConfig(directory=str(tmp_path / "run"), **options))
    direct = tdcp.CheckpointRotation(tmp_path / "run", **options)
    try:
        assert type(built) is tdcp.CheckpointRotation
        assert rotation_options(built) == rotation_options(direct)
        assert built.keep_best == direct.keep_best
    finally:
        direct.close()
        built.close()
    assert {s: signal.getsignal(s) for s in previous} == previous  # close() restored the handlers


def test_config_round_trip_saves_and_resumes(tmp_path: Path) -> None:
    """The instantiated pair works together: a save by the YAML-built rotation resumes into a fresh checkpoint."""
    import torch

    cfg = OmegaConf.create(
        OmegaConf.to_yaml(OmegaConf.structured(CheckpointRotationConfig(str(tmp_path), keep_last=1)))
    )
    rotation, model = instantiate(cfg), torch.nn.Linear(2, 2)
    ckpt = instantiate(OmegaConf.structured(DistributedCheckpointConfig()))
    ckpt.register("model", model)
    rotation.save(ckpt, step=1)
    rotation.save(ckpt, step=2)
    fresh = torch.nn.Linear(2, 2)
    assert tdcp.resume(tdcp.DistributedCheckpoint(model=fresh), tmp_path).step == 2
    assert [e.step for e in rotation.entries()] == [2]
    assert torch.equal(fresh.weight, model.weight)


def test_a_yaml_rotation_with_a_local_tier_saves_to_it_and_resumes_from_it(tmp_path: Path) -> None:
    import torch

    local = {"path": str(tmp_path / "tier"), "every_steps": 2, "keep_last": 1}
    yaml = OmegaConf.to_yaml(OmegaConf.structured(CheckpointRotationConfig(str(tmp_path / "run"), local=local)))
    rotation, model = instantiate(OmegaConf.create(yaml)), torch.nn.Linear(2, 2)
    assert isinstance(rotation.local, tdcp.LocalTier) and rotation.local.keep_last == 1
    ckpt = tdcp.DistributedCheckpoint(model=model)
    for step in range(1, 6):
        rotation.maybe_save(ckpt, step)
    assert rotation.local.steps() == [4] and rotation.entries() == []
    fresh = torch.nn.Linear(2, 2)
    info = instantiate(OmegaConf.create(yaml)).resume(tdcp.DistributedCheckpoint(model=fresh))
    assert (info.step, info.tier) == (4, "local") and torch.equal(fresh.weight, model.weight)


BAD_CHECKPOINTS = [
    ({"strict": "loud"}, ValueError, "strict must be 'error', 'warn' or 'ignore'"),
    ({"replica_check": "all"}, ValueError, "replica_check must be one of"),
    ({"timeout": 0}, ValueError, "timeout must be a positive, finite number of seconds of at most 1e+08"),
    ({"timeout": float("inf")}, ValueError, "timeout must be a positive, finite number of seconds"),
    ({"timeout": 1e30}, ValueError, "timeout must be a positive, finite number of seconds"),
    ({"timeout": "long"}, TypeError, "timeout must be a number of seconds or None"),
    ({"save_components": "policy"}, TypeError, "save_components must be a list of component names"),
    ({"storage_options": ["anon"]}, TypeError, "storage_options must be a mapping"),
    ({"no_dist": 1}, TypeError, "no_dist must be True or False"),
]
BAD_ROTATIONS = [
    ({"keep_last": 0}, ValueError, "keep_last must be a positive integer or None, got 0"),
    ({"keep_every": -2}, ValueError, "keep_every must be a positive integer"),
    ({"keep_best": ["reward", "best"]}, ValueError, "keep_best mode must be 'max' or 'min'"),
    ({"keep_best": ["reward"]}, ValueError, "keep_best must be"),
    ({"every_steps": 0}, ValueError, "every_steps must be a positive integer"),
    ({"every_seconds": -1.0}, ValueError, "every_seconds must be a positive number of seconds"),
    ({"preemption_signals": ["SIGNOPE"]}, ValueError, "preemption_signals: 'SIGNOPE' is not a signal of this platform"),
    ({"preemption_signals": ["SIGKILL"]}, ValueError, "preemption_signals: SIGKILL cannot be caught"),
    ({"preemption_signals": "SIGTERM"}, TypeError, "preemption_signals must be a list of signal names"),
    ({"async_saves": "yes"}, TypeError, "async_saves must be True or False"),
    ({"directory": ""}, TypeError, "directory must be a non-empty path or URL"),
    ({"local": {"every_steps": 2}}, TypeError, "local must be a mapping of LocalTier's options with a path"),
    (
        {"local": {"path": "tier", "every_steps": 0}},
        ValueError,
        "LocalTier every_steps must be an integer of at least 1",
    ),
]


def test_numpy_integers_computed_by_training_code_are_taken_as_rotation_settings(tmp_path: Path) -> None:
    """``CheckpointRotation(every_steps=np.int64(3))`` was refused ("must be a positive integer"), where a NumPy
    step is taken; floats and bools still are refused."""
    import numpy as np

    rotation = tdcp.CheckpointRotation(
        tmp_path, every_steps=np.int64(3), keep_last=np.int32(2), keep_best=("r", "max", np.int64(2))
    )
    assert (rotation.schedule.every_steps, rotation.keep_last) == (3, 2) and type(rotation.keep_last) is int
    assert type(rotation.schedule.every_steps) is int and rotation.retention.keep_best == ("r", "max", 2)
    tier = tdcp.LocalTier(tmp_path / "tier", every_steps=np.int64(4), keep_last=np.uint8(1), replicas=np.int64(0))
    assert (tier.every_steps, tier.keep_last, tier.replicas) == (4, 1, 0) and type(tier.every_steps) is int
    for bad in (np.float64(3.0), np.bool_(True), 2.0):
        with pytest.raises(ValueError, match="every_steps must be a positive integer"):
            tdcp.CheckpointRotation(tmp_path, every_steps=bad)


@pytest.mark.parametrize("options, error, message", BAD_CHECKPOINTS, ids=[str(o) for o, _, _ in BAD_CHECKPOINTS])
def test_checkpoint_config_validation(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=f"^DistributedCheckpointConfig: {re.escape(message)}"):
        DistributedCheckpointConfig(**options)
    node = OmegaConf.create({"_target_": "torchrl_dcp.configs.distributed_checkpoint", **options})
    with pytest.raises(InstantiationException, match=re.escape(message)):  # a YAML value: checked the same way
        instantiate(node)


@pytest.mark.parametrize("options, error, message", BAD_ROTATIONS, ids=[str(o) for o, _, _ in BAD_ROTATIONS])
def test_rotation_config_validation(tmp_path: Path, options: dict[str, Any], error: type, message: str) -> None:
    options = {"directory": str(tmp_path), **options}
    with pytest.raises(error, match=f"^CheckpointRotationConfig: {re.escape(message)}"):
        CheckpointRotationConfig(**options)
    node = OmegaConf.create({"_target_": "torchrl_dcp.configs.checkpoint_rotation", **options})
    with pytest.raises(InstantiationException, match=re.escape(message)):
        instantiate(node)
    assert not any(tmp_path.iterdir())  # nothing built, nothing written


def test_rotation_config_needs_a_directory_and_typed_values() -> None:
    schema = OmegaConf.structured(CheckpointRotationConfig)
    assert OmegaConf.is_missing(schema, "directory")
    with pytest.raises(ValueError, match="CheckpointRotationConfig: directory is not set"):
        CheckpointRotationConfig().build()
    with pytest.raises(ValidationError, match="keep_last"):  # a wrong type: OmegaConf refuses the merge
        OmegaConf.merge(schema, OmegaConf.create("keep_last: two"))
    with pytest.raises(ValidationError, match="strict"):
        OmegaConf.merge(OmegaConf.structured(DistributedCheckpointConfig), {"strict": {"a": 1}})


def test_config_fields_are_the_constructors_options() -> None:
    """Every field is a keyword of the constructor with the constructor's default (nothing invented, nothing lost
    but what YAML cannot hold: live objects and the components the Trainer registers)."""
    import inspect

    for config, target, left_out in (
        (DistributedCheckpointConfig, tdcp.DistributedCheckpoint, {"process_group", "components"}),
        (CheckpointRotationConfig, tdcp.CheckpointRotation, set()),
    ):
        params = {n: p for n, p in inspect.signature(target).parameters.items() if n != "self"}
        names = {f.name for f in fields(config) if not f.name.startswith("_")}
        assert names == set(params) - left_out, config
        for f in fields(config):
            if f.name.startswith("_"):
                continue
            want = params[f.name].default
            got = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if want is inspect.Parameter.empty:
                assert got == "???", f.name  # required: OmegaConf's MISSING
            else:
                assert got == (list(want) if isinstance(want, tuple) else want), f.name


def test_configstore_registration() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    assert "torchrl_dcp.yaml" in cs.list(configs.GROUP_CHECKPOINT)
    assert "torchrl_dcp.yaml" in cs.list(configs.GROUP_ROTATION)
    node = cs.load(f"{configs.GROUP_ROTATION}/torchrl_dcp.yaml").node
    assert node._target_ == "torchrl_dcp.configs.checkpoint_rotation" and OmegaConf.is_missing(node, "directory")

    class Recorder:
        def __init__(self) -> None:
            self.stored: list[tuple[str, str, type]] = []

        def store(self, *, group: str, name: str, node: type) -> None:
            self.stored.append((group, name, node))

    recorder = Recorder()
    assert configs.register_configs(recorder) is recorder
    assert recorder.stored == [
        ("checkpoint", "torchrl_dcp", DistributedCheckpointConfig),
        ("checkpoint_rotation", "torchrl_dcp", CheckpointRotationConfig),
    ]
    # torchrl's trainer configs fill fields of these names: the groups follow torchrl's (group = field name)
    from torchrl.trainers.algorithms.configs.trainers import PPOTrainerConfig, SACTrainerConfig

    for trainer in (SACTrainerConfig, PPOTrainerConfig):
        assert {configs.GROUP_CHECKPOINT, configs.GROUP_ROTATION} <= {f.name for f in fields(trainer)}


def test_importing_torchrl_dcp_imports_no_hydra() -> None:
    code = (
        "import sys, torchrl_dcp as t; t.DistributedCheckpoint; t.CheckpointRotation; "
        "bad = [m for m in ('hydra', 'omegaconf', 'torchrl_dcp.configs') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_docs_block_runs(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "configs.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "instantiate" in b]
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------- the YAML example
def test_the_example_config_builds_a_trainer_bound_to_our_rotation(tmp_path: Path) -> None:
    from torchrl_dcp.examples.sac_trainer_config import compose

    cfg = compose(overrides=[f"trainer.checkpoint_rotation.directory={tmp_path}", "trainer.checkpoint.strict=warn"])
    assert cfg.trainer._target_.endswith("_make_sac_trainer")  # torchrl's SACTrainerConfig
    assert cfg.trainer.checkpoint._target_ == "torchrl_dcp.configs.distributed_checkpoint"
    trainer = instantiate(cfg.trainer)
    rotation = trainer.checkpoint_rotation
    try:
        assert type(trainer).__name__ == "SACTrainer"
        assert isinstance(trainer.checkpoint, tdcp.DistributedCheckpoint) and trainer.checkpoint.strict == "warn"
        assert isinstance(rotation, tdcp.CheckpointRotation) and rotation.directory == tmp_path
        assert (rotation.schedule.every_steps, rotation.keep_last) == (256, 2)
        assert rotation._watcher is not None and rotation._watcher.signals == (signal.SIGTERM,)
        assert getattr(trainer, "_tdcp_rotation", None) is rotation  # the Trainer bound it: its saves follow it
        assert {"policy", "loss_module", "optimizer", "replay_buffer", "collector", "rng"} <= set(
            trainer.checkpoint.components
        )
    finally:
        rotation.close()
        trainer.collector.shutdown()


def test_mapping_options_are_set_from_the_command_line(tmp_path: Path) -> None:
    """``local`` and ``storage_options`` (mappings, ``None`` by default) take a Hydra override as they take YAML (the
    override failed inside OmegaConf: a mapping merged into an ``Optional[Dict]`` that is ``None``); a mapping that
    is not LocalTier's options is still refused when instantiated."""
    from torchrl_dcp.examples.sac_trainer_config import compose

    local = tmp_path / "local"
    cfg = compose(
        overrides=[
            f"trainer.checkpoint_rotation.directory={tmp_path / 'run'}",
            f"trainer.checkpoint_rotation.local={{path:{local},every_steps:10}}",
            "trainer.checkpoint.storage_options={anon:true}",
        ]
    )
    rotation = instantiate(cfg.trainer.checkpoint_rotation)
    try:
        assert isinstance(rotation.local, tdcp.LocalTier) and rotation.local.every_steps == 10
    finally:
        rotation.close()
    assert instantiate(cfg.trainer.checkpoint).storage_options == {"anon": True}
    bad = compose(
        overrides=[f"trainer.checkpoint_rotation.directory={tmp_path}", "trainer.checkpoint_rotation.local={x:1}"]
    )
    with pytest.raises(Exception, match="local"):
        instantiate(bad.trainer.checkpoint_rotation)


def test_the_example_config_refuses_bad_overrides(tmp_path: Path) -> None:
    """Our nodes are typed by the dataclasses: a wrong type or an unknown key is refused when the config is
    composed, a bad value when it is instantiated (before the Trainer is built)."""
    from hydra.errors import ConfigCompositionException

    from torchrl_dcp.examples.sac_trainer_config import compose

    for override in ("trainer.checkpoint_rotation.keep_last=two", "trainer.checkpoint_rotation.keep_lst=2"):
        with pytest.raises(ConfigCompositionException):
            compose(overrides=[override])
    cfg = compose(
        overrides=[f"trainer.checkpoint_rotation.directory={tmp_path}", "trainer.checkpoint_rotation.keep_last=0"]
    )
    with pytest.raises(InstantiationException, match="CheckpointRotationConfig: keep_last must be a positive integer"):
        instantiate(cfg.trainer.checkpoint_rotation)


def _run_example(cwd: Path, *overrides: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_dcp.examples.sac_trainer_config", "frames_per_batch=32",
         "trainer.checkpoint_rotation.every_steps=64", *overrides],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_the_yaml_example_trains_and_resumes_exactly(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _run_example(tmp_path / "a", "trainer.total_frames=64")
    assert "starting fresh" in first and "frames=64 " in first and "saved=[64]" in first
    resumed = _run_example(tmp_path / "a", "trainer.total_frames=128")
    assert "resumed from frame 64" in resumed and "saved=[64, 128]" in resumed  # every_steps counts from the resume
    straight = _run_example(tmp_path / "b", "trainer.total_frames=128")
    learner = re.compile(r"learner=(\w+)")
    assert learner.search(resumed).group(1) == learner.search(straight).group(1)  # as if it never stopped
    assert (tmp_path / "a" / "ckpts" / "sac_trainer_config" / "step-000000000128" / "manifest.json").is_file()
