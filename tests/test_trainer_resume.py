"""torchrl trainers that register components after ``Trainer.__init__`` resume them all.

IQL and CQL (torchrl 0.14) set their replay buffer and target updater after ``Trainer.__init__`` registered the
trainer's components, so only the first save registers them; a fresh process that resumes has not saved yet.
``DistributedCheckpoint.load`` runs the bound Trainer's own registration first, so the buffer and the target updater
come back (they used to be skipped: training went on from an empty buffer).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import CQLLoss, IQLLoss, SoftUpdate

import torchrl_dcp as tdcp
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.audit import state_differences, state_snapshot
from torchrl_dcp.examples.sac import make_env


def make_loss(kind: str) -> tuple[Any, Any, Any]:
    """The env, the actor and an IQL or CQL loss over a small actor and Q network (its value estimator not built yet)."""
    torch.manual_seed(0)
    env = make_env(0, torch.device("cpu"))
    net = torch.nn.Sequential(MLP(in_features=2, out_features=2, num_cells=[16]), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=env.action_spec,
        distribution_class=TanhNormal,
    )
    q = ValueOperator(MLP(in_features=3, out_features=1, num_cells=[16]), in_keys=["observation", "action"])
    if kind == "iql":
        value = ValueOperator(MLP(in_features=2, out_features=1, num_cells=[16]), ["observation"])
        return env, actor, IQLLoss(actor, q, value)
    return env, actor, CQLLoss(actor, q)


def build(
    kind: str, directory: Path, *, torchrl_checkpoint: bool = False, **rotation: Any
) -> tuple[Any, ReplayBuffer, Any]:
    """A small IQL/CQL trainer saving through our checkpoint (or, ``torchrl_checkpoint``, through torchrl's own)."""
    from torchrl.checkpoint import Checkpoint, CheckpointRotation
    from torchrl.trainers.algorithms import CQLTrainer, IQLTrainer

    env, actor, loss = make_loss(kind)
    loss.make_value_estimator()  # built lazily at the first call otherwise: a fresh loss would lack its gamma
    buffer = ReplayBuffer(storage=LazyTensorStorage(256), batch_size=8)
    trainer_type = IQLTrainer if kind == "iql" else CQLTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental/prototype feature"
        trainer = trainer_type(
            collector=Collector(env, actor, frames_per_batch=16, total_frames=-1),
            total_frames=64,
            frame_skip=1,
            optim_steps_per_batch=1,
            loss_module=loss,
            optimizer=torch.optim.Adam(loss.parameters(), lr=1e-3),
            replay_buffer=buffer,
            target_net_updater=SoftUpdate(loss, eps=0.9),
            progress_bar=False,
            enable_logging=False,
            save_trainer_interval=63,
            checkpoint=Checkpoint() if torchrl_checkpoint else tdcp.DistributedCheckpoint(),
            checkpoint_rotation=CheckpointRotation(directory, keep_last=1)
            if torchrl_checkpoint
            else tdcp.CheckpointRotation(directory, **(rotation or {"keep_last": 1})),
        )
    return trainer, buffer, loss


@pytest.mark.parametrize("kind", ["iql", "cql"])
def test_components_a_trainer_registers_after_init_are_resumed(tmp_path: Path, kind: str) -> None:
    trainer, buffer, loss = build(kind, tmp_path)
    trainer.train()  # 64 frames; the scheduled save at 64 is the last thing it does
    assert len(buffer) == 64
    fresh, fresh_buffer, fresh_loss = build(kind, tmp_path)
    assert "replay_buffer" not in fresh.checkpoint.components  # registered lazily by torchrl
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.UnrestoredComponentWarning)
        info = tdcp.resume(fresh.checkpoint, tmp_path)
    assert info is not None and info.step == 64 and not info.result.unrequested
    assert len(fresh_buffer) == 64
    rows, fresh_rows = buffer[:64], fresh_buffer[:64]
    assert all(torch.equal(rows[k], fresh_rows[k]) for k in rows.keys(True, True))
    for (name, a), (_, b) in zip(loss.state_dict().items(), fresh_loss.state_dict().items()):
        assert torch.equal(a, b), name
    assert fresh.collected_frames == trainer.collected_frames


def test_a_loss_whose_value_estimator_is_not_built_yet_is_told_to_build_it(tmp_path: Path) -> None:
    """A saved loss holds ``_value_estimator.*`` buffers that a fresh loss builds only at its first call: the error
    says to call ``make_value_estimator()``, not to drop keys with ``strict=False``."""
    _, _, loss = build("iql", tmp_path)
    path = tdcp.DistributedCheckpoint(loss=loss).save(tmp_path / "c")
    _, _, fresh = make_loss("iql")
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"make_value_estimator\(\)"):
        tdcp.DistributedCheckpoint(loss=fresh).load(path)
    fresh.make_value_estimator()
    tdcp.DistributedCheckpoint(loss=fresh).load(path)


def test_trainer_load_from_file_reads_our_checkpoints(tmp_path: Path) -> None:
    """torchrl's Trainer.load_from_file sent our directories to torch.load (IsADirectoryError); with our checkpoint
    attached it loads them (directory and archive) and returns the Trainer."""
    trainer, _, loss = build("iql", tmp_path / "run")
    trainer.train()
    path = tdcp.CheckpointRotation(tmp_path / "run").entries()[-1].path
    saved = state_snapshot(loss, "loss")
    archive = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    for source in (path, archive):
        fresh, fresh_buffer, fresh_loss = build("iql", tmp_path / "other")
        assert fresh.load_from_file(source) is fresh
        assert state_differences(saved, state_snapshot(fresh_loss, "loss")) == []
        assert len(fresh_buffer) == 64  # registered lazily by torchrl, loaded too


@pytest.mark.parametrize("kind", ["iql", "cql"])
def test_trainer_load_from_file_imports_what_torchrls_trainer_saved(tmp_path: Path, kind: str) -> None:
    """A Trainer that saved with torchrl.checkpoint (its own rotation) resumes in a Trainer bound to our checkpoint:
    ``load_from_file`` imports it read-only, and the Trainer holds what torchrl's own load gives, then trains on
    identically; its next save is ours."""
    trainer, _, _ = build(kind, tmp_path / "theirs", torchrl_checkpoint=True)
    trainer.train()
    path = trainer.checkpoint_rotation.latest()
    assert path is not None and (path / "manifest.json").is_file()
    by_torchrl, _, _ = build(kind, tmp_path / "by-torchrl", torchrl_checkpoint=True)
    by_torchrl.load_from_file(path)
    ours, ours_buffer, _ = build(kind, tmp_path / "ours")
    assert ours.load_from_file(path) is ours
    assert len(ours_buffer) == 64 and ours.collected_frames == by_torchrl.collected_frames == 64
    names = ["loss_module", "optimizer", "replay_buffer", "target_updater", "collector"]
    audit = {n: state_snapshot(getattr(by_torchrl, a), n) for n, a in zip(names, _ATTRS)}
    assert [str(d) for n, a in zip(names, _ATTRS) for d in state_differences(audit[n], state_snapshot(getattr(ours, a), n))] == []  # fmt: skip
    for t in (by_torchrl, ours):  # training goes on alike
        t.total_frames = 96
        torch.manual_seed(11)
        t.train()
    assert all(torch.equal(a, b) for a, b in zip(by_torchrl.loss_module.parameters(), ours.loss_module.parameters()))
    assert tdcp.CheckpointRotation(tmp_path / "ours").entries()[-1].step == 96


_ATTRS = ["loss_module", "optimizer", "replay_buffer", "target_net_updater", "collector"]


@pytest.mark.parametrize(
    "component,key,forged",
    [
        ("trainer_state", "collected_frames", -5),
        ("trainer_state", "collected_frames", 1.5),
        ("trainer_state", "_optim_count", "x"),
        ("trainer_module.count_frames_log", "frame_count", -1),
    ],
)
def test_a_forged_counter_in_a_torchrl_trainer_checkpoint_is_refused_as_in_ours(
    tmp_path: Path, component: str, key: str, forged: Any
) -> None:
    """Probe t4: our format refuses a Trainer counter that is no count (``TrainerStateAdapter.validate``, the hooks'
    likewise); the same value in a ``torchrl.checkpoint`` checkpoint (JSON, no checksums) was imported silently."""
    import json

    from torchrl.trainers import CountFramesLog

    def with_counter(directory: Path, **kw: Any) -> Any:
        trainer = build("iql", directory, **kw)[0]
        CountFramesLog(frame_skip=1).register(trainer)
        return trainer

    theirs = with_counter(tmp_path / "theirs", torchrl_checkpoint=True)
    theirs.train()
    path = tmp_path / "forged"
    shutil.copytree(theirs.checkpoint_rotation.latest(), path)
    (state_file,) = path.glob(f"components/*-{component}/state.json")
    state = json.loads(state_file.read_text())
    (entry,) = [v for k, v in state["items"] if k["value"] == key]
    entry["value"] = forged
    state_file.write_text(json.dumps(state))
    ours = with_counter(tmp_path / "ours")
    with pytest.raises(tdcp.IncompatibleComponentError, match=f"{component}.*{key}"):
        ours.load_from_file(path)
    assert ours.collected_frames == 0 and ours._optim_count == 0  # nothing restored


def test_a_failed_import_of_a_torchrl_trainer_checkpoint_rolls_back_its_logging_schedule(tmp_path: Path) -> None:
    """Probe t4: torchrl's ``trainer_state`` holds the Trainer's ``_last_log``; our rollback snapshot keeps it in
    ``trainer_rank_state`` (never part of an import), so a failed import left the checkpoint's ``_last_log``."""
    import json

    theirs = build("iql", tmp_path / "theirs", torchrl_checkpoint=True)[0]
    theirs.train()
    path = tmp_path / "saved"
    shutil.copytree(theirs.checkpoint_rotation.latest(), path)
    (state_file,) = path.glob("components/*-trainer_state/state.json")
    state = json.loads(state_file.read_text())
    logged = {"kind": "dict", "items": [[{"kind": "value", "value": "loss"}, {"kind": "value", "value": 32}]]}
    state["items"] = [  # torchrl's trainer logged at frame 32, and a restore that fails: _optim_count taken out
        [k, logged if k["value"] == "_last_log" else v] for k, v in state["items"] if k["value"] != "_optim_count"
    ]
    state_file.write_text(json.dumps(state))
    ours = build("iql", tmp_path / "ours")[0]
    ours._last_log = {"mine": 1}
    with pytest.raises(tdcp.CheckpointError, match="rolled back"):
        ours.load_from_file(path)
    assert ours._last_log == {"mine": 1} and ours.collected_frames == 0


def test_load_from_file_of_a_torchrl_checkpoint_names_what_it_leaves_as_it_is(tmp_path: Path) -> None:
    """torchrl's checkpoint holds no state for the hooks we register ourselves (a ``RewardNormalizer`` registered
    through ``register_op`` only): the import left it fresh without a word, and training went on differently."""
    from torchrl.trainers import RewardNormalizer

    def with_normalizer(kind: str, directory: Path, **kw: Any) -> tuple[Any, RewardNormalizer]:
        trainer = build(kind, directory, **kw)[0]
        hook = RewardNormalizer(decay=0.9)
        trainer.register_op("batch_process", hook.update_reward_stats)
        trainer.register_op("process_optim_batch", hook.normalize_reward)
        return trainer, hook

    theirs, _ = with_normalizer("iql", tmp_path / "theirs", torchrl_checkpoint=True)
    theirs.train()
    ours, hook = with_normalizer("iql", tmp_path / "ours")
    with pytest.warns(tdcp.InexactResumeWarning, match=r"holds no state for .*trainer_op.RewardNormalizer.*keep their"):
        ours.load_from_file(theirs.checkpoint_rotation.latest())
    assert hook.state_dict()["_reward_stats"].get("count") is None  # (what the warning says: kept as it was)


def test_trainer_load_from_file_says_what_is_wrong_with_a_damaged_checkpoint(tmp_path: Path) -> None:
    trainer, _, _ = build("iql", tmp_path / "run")
    trainer.train()
    path = tdcp.CheckpointRotation(tmp_path / "run").entries()[-1].path
    (path / "manifest.json").write_text("{")  # damaged: our error names it, not torch.load's IsADirectoryError
    with pytest.raises(tdcp.CheckpointError, match="manifest"):
        build("iql", tmp_path / "other")[0].load_from_file(path)


def test_resume_of_a_trainer_counts_its_save_policy_from_the_resumed_step(tmp_path: Path) -> None:
    """``tdcp.resume(trainer.checkpoint, dir)`` resumes the Trainer's own rotation: with ``every_steps=32`` a run
    resumed at 64 frames saves at 96 and 128, not also at 80 (a separate rotation's count started from 0)."""

    first, _, _ = build("iql", tmp_path / "run", every_steps=32)
    first.train()
    assert [e.step for e in tdcp.CheckpointRotation(tmp_path / "run").entries()] == [32, 64]
    again, _, _ = build("iql", tmp_path / "run", every_steps=32)
    info = tdcp.resume(again.checkpoint, tmp_path / "run")
    assert info is not None and info.step == 64
    again.total_frames = 128
    again.train()
    assert [e.step for e in tdcp.CheckpointRotation(tmp_path / "run").entries()] == [32, 64, 96, 128]


def test_a_trainer_resumed_from_its_last_checkpoint_trains_no_further(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job requeued after its final save (preempted in its last iteration): torchrl's loop compares the frames
    only after a batch, so the resumed Trainer collected and trained one more batch and saved past total_frames,
    unlike the run that never stopped. It trains nothing and says so; a raised total_frames trains on."""
    first, _, loss = build("iql", tmp_path / "run", every_steps=32)
    first.train()
    again, _, fresh_loss = build("iql", tmp_path / "run", every_steps=32)
    info = tdcp.resume(again.checkpoint, tmp_path / "run")
    assert info is not None and info.step == first.total_frames == again.collected_frames
    with caplog.at_level("WARNING", logger="torchrl_dcp"):
        again.train()
    assert "nothing left to train" in caplog.text
    assert again.collected_frames == first.total_frames
    assert [e.step for e in tdcp.CheckpointRotation(tmp_path / "run").entries()] == [32, 64]
    for (name, a), (_, b) in zip(loss.state_dict().items(), fresh_loss.state_dict().items()):
        assert torch.equal(a, b), name
    again.total_frames = 96
    again.train()
    assert again.collected_frames == 96


def test_load_from_file_counts_the_save_policy_from_the_loaded_step(tmp_path: Path) -> None:
    """``trainer.load_from_file(step 64)`` instead of ``tdcp.resume``: the rotation's ``every_steps=48`` counted
    from 0 and saved again at 80 (not a new multiple of 48); it counts from the loaded step, as after a resume."""
    first, _, _ = build("iql", tmp_path / "run", every_steps=32)
    first.train()
    again, _, _ = build("iql", tmp_path / "next", every_steps=48)
    again.load_from_file(tmp_path / "run" / "step-000000000064")
    again.total_frames = 112
    again.train()
    assert [e.step for e in tdcp.CheckpointRotation(tmp_path / "next").entries()] == [96, 112]  # (112: the last)


def test_load_from_file_of_a_torchrl_trainers_checkpoint_counts_the_save_policy_from_its_frames(
    tmp_path: Path,
) -> None:
    """A torchrl Trainer's checkpoint records ``collected_frames``, no step: the import left the step unknown, so
    ``every_steps=48`` counted from 0 and saved at 80, one iteration after the import. It counts from the frames
    the import restored (64), as for a checkpoint of ours."""
    theirs, _, _ = build("iql", tmp_path / "theirs", torchrl_checkpoint=True)
    theirs.train()
    again, _, _ = build("iql", tmp_path / "next", every_steps=48)
    again.load_from_file(theirs.checkpoint_rotation.latest())
    again.total_frames = 112
    again.train()
    assert [e.step for e in tdcp.CheckpointRotation(tmp_path / "next").entries()] == [96, 112]


def test_a_trainer_saves_to_the_local_tier_on_its_schedule_and_resumes_from_it(tmp_path: Path) -> None:
    """A rotation's LocalTier saves at its own schedule inside ``Trainer.train()`` (every 16 frames here, the shared
    tier every 32), and the Trainer's resume takes the local tier's newest step when the shared tier is gone."""
    local = tdcp.LocalTier(tmp_path / "local", every_steps=16, keep_last=2)
    first, buffer, loss = build("iql", tmp_path / "run", every_steps=32, local=local)
    first.total_frames = 80
    first.train()
    assert local.steps() == [64, 80]
    assert [e.step for e in tdcp.CheckpointRotation(tmp_path / "run").entries()] == [32, 64, 80]
    shutil.rmtree(tmp_path / "run")  # the shared tier is lost: the node's own tier holds the newest step
    again, fresh_buffer, fresh_loss = build(
        "iql", tmp_path / "run", every_steps=32, local=tdcp.LocalTier(tmp_path / "local", every_steps=16)
    )
    info = tdcp.resume(again.checkpoint, tmp_path / "run")
    assert info is not None and (info.step, info.tier) == (80, "local")
    assert len(fresh_buffer) == len(buffer) == 80
    rows, fresh_rows = buffer[:80], fresh_buffer[:80]
    assert all(torch.equal(rows[k], fresh_rows[k]) for k in rows.keys(True, True))
    for (name, a), (_, b) in zip(loss.state_dict().items(), fresh_loss.state_dict().items()):
        assert torch.equal(a, b), name
    assert again.collected_frames == first.collected_frames


# ---------------------------------------------------------------------- what torchrl's hooks keep outside components
def _sac_trainer(ckpt_dir: Path, frames: int, hooks: Any = None) -> Any:
    from tests_distributed.trainer_zoo import build_trainer

    trainer = build_trainer("SACTrainer", 0, ckpt_dir, total_frames=frames, save_every=32)
    return trainer, (hooks(trainer) if hooks is not None else None)


def test_a_hook_only_register_op_reaches_is_saved_and_resumed(tmp_path: Path) -> None:
    """A ``RewardNormalizer`` registered as torchrl's docstring shows (two ``register_op`` calls, no
    ``register_module``) was in no component: its statistics restarted at a resume, silently."""
    from torchrl.trainers import RewardNormalizer

    def normalizer(trainer):
        hook = RewardNormalizer(decay=0.9)
        trainer.register_op("batch_process", hook.update_reward_stats)
        trainer.register_op("process_optim_batch", hook.normalize_reward)
        return hook

    trainer, saved = _sac_trainer(tmp_path, 32, normalizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    assert "trainer_op.RewardNormalizer" in trainer.checkpoint.components
    assert "trainer_op.ReplayBufferTrainer" not in trainer.checkpoint.components  # its buffer is a component
    trainer2, restored = _sac_trainer(tmp_path, 64, normalizer)
    info = tdcp.resume(trainer2.checkpoint, tmp_path)
    assert info is not None and "trainer_op.RewardNormalizer" in info.result.loaded
    assert set(restored._reward_stats) == set(saved._reward_stats)
    for key, value in saved._reward_stats.items():
        assert torch.equal(torch.as_tensor(restored._reward_stats[key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("wrapped", ["TargetNetUpdaterHook", "bound scheduler step", "partial of SWA's update"])
def test_the_state_an_op_wraps_is_saved_and_resumed(tmp_path: Path, wrapped: str) -> None:
    """What an op holds without a ``state_dict`` of the hook's own: torchrl's ``TargetNetUpdaterHook`` (registered as
    its docstring shows) keeps its state in the target updater it wraps (``HardUpdate``'s counter), an LR scheduler's
    bound ``step`` in the scheduler. Both restarted at a resume, silently: the targets were copied at other steps."""
    from torchrl.objectives import HardUpdate
    from torchrl.trainers import TargetNetUpdaterHook

    def hooks(trainer):
        if wrapped == "TargetNetUpdaterHook":
            holder = HardUpdate(trainer.loss_module, value_network_update_interval=1000)  # (counts every step)
            trainer.register_op("post_optim", TargetNetUpdaterHook(holder))
            return holder, lambda h: h.counter
        if wrapped == "partial of SWA's update":  # (the op takes no argument: the model's is bound)
            holder = torch.optim.swa_utils.AveragedModel(trainer.loss_module.actor_network)
            trainer.register_op(
                "post_optim", functools.partial(holder.update_parameters, trainer.loss_module.actor_network)
            )
            return holder, lambda h: int(h.n_averaged)
        holder = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=5, gamma=0.5)
        trainer.register_op("post_optim", holder.step)
        return holder, lambda h: (h.last_epoch, h.get_last_lr())

    trainer, (saved, position) = _sac_trainer(tmp_path, 32, hooks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    name = f"trainer_op.{type(saved).__name__}"
    assert name in trainer.checkpoint.components
    trainer2, (restored, _) = _sac_trainer(tmp_path, 64, hooks)
    assert position(restored) != position(saved)  # (a fresh one: the resume has something to restore)
    info = tdcp.resume(trainer2.checkpoint, tmp_path)
    assert info is not None and name in info.result.loaded
    assert position(restored) == position(saved)


def test_an_op_added_between_two_saves_never_takes_another_ones_state(tmp_path: Path) -> None:
    """A second scheduler's op added after the first save (its op list sorted before the first one's) took the
    first's name at the next save, so it was never saved, and a fresh process registering both gave it the first
    one's state. The names are those of every op found now, in every process alike."""
    added: list[Any] = []

    def first(trainer):
        a = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=3)
        trainer.register_op("post_steps", a.step)
        return a

    trainer, a = _sac_trainer(tmp_path, 64, first)

    def add_second() -> None:  # (once the first save, at 32 frames, is behind)
        if trainer.collected_frames > 32 and not added:
            added.append(torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=7))
            trainer.register_op("post_optim", added[0].step)

    trainer.register_op("post_steps", add_second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    (b,) = added
    trainer2, a2 = _sac_trainer(tmp_path, 64, first)
    b2 = torch.optim.lr_scheduler.StepLR(trainer2.optimizer, step_size=7)
    trainer2.register_op("post_optim", b2.step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tdcp.resume(trainer2.checkpoint, tmp_path).step == 64
    assert (a2.last_epoch, b2.last_epoch) == (a.last_epoch, b.last_epoch) and a.last_epoch != b.last_epoch


def test_a_loggers_op_is_no_component(tmp_path: Path) -> None:
    """An op bound to a logger (registered on rank 0 alone, as jobs log) became a component of rank 0 only, and every
    save of a 2-rank job was refused ("components only on rank 0"). Only the training's state is taken from ops."""
    from torchrl.record.loggers import CSVLogger

    def logged(trainer):
        logger = CSVLogger("run", log_dir=str(tmp_path / "logs"))
        trainer.register_op("post_steps", logger.log_hparams, cfg={"a": 1})
        return logger

    trainer, _ = _sac_trainer(tmp_path, 32, logged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    assert not [n for n in trainer.checkpoint.components if "Logger" in n]


def test_early_stopping_resumes_with_the_last_value_of_its_metric(tmp_path: Path) -> None:
    """``EarlyStopping`` reads the last value logged under its metric (``Trainer._log_dict``, each rank's own
    history, not saved); validation logs it every few iterations only, so a resume in between found none and
    ``train()`` stopped with torchrl's error. The hook's state carries that value."""
    from torchrl.trainers import EarlyStopping

    def stopper(trainer):
        hook = EarlyStopping(monitor="r_evaluation", patience=10**9, wait_for=0)
        hook.register(trainer)
        return hook

    trainer, _ = _sac_trainer(tmp_path, 32, stopper)
    trainer._log(r_evaluation=torch.tensor(-3.5), loss=1.0)
    trainer._log(r_evaluation=torch.tensor(-2.5))
    trainer.checkpoint.save(tmp_path / "c", step=1)
    trainer2, _ = _sac_trainer(tmp_path / "other", 32, stopper)
    trainer2.checkpoint.load(tmp_path / "c")
    assert list(trainer2._log_dict) == ["r_evaluation"]
    assert torch.equal(trainer2._log_dict["r_evaluation"][-1], torch.tensor(-2.5))


def test_a_logger_of_another_run_is_said_to_keep_its_run(tmp_path: Path) -> None:
    from torchrl.record.loggers import CSVLogger

    saved = CSVLogger(exp_name="run_a", log_dir=str(tmp_path / "logs"))
    tdcp.DistributedCheckpoint(logger=saved).save(tmp_path / "c")
    other = CSVLogger(exp_name="run_b", log_dir=str(tmp_path / "logs2"))
    with pytest.warns(tdcp.TorchrlDcpWarning, match="'run_a'.*'run_b'.*exp_name and log_dir"):
        tdcp.DistributedCheckpoint(logger=other).load(tmp_path / "c")
    same = CSVLogger(exp_name="run_a", log_dir=str(tmp_path / "logs"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.TorchrlDcpWarning)
        tdcp.DistributedCheckpoint(logger=same).load(tmp_path / "c")


@pytest.mark.parametrize("value", ["abc", "7.5", True, None, [1.0], "tensor1000", "other-metric"])
def test_a_forged_monitored_value_is_refused_at_load(tmp_path: Path, value: Any) -> None:
    """The saved last value of ``EarlyStopping``'s metric went into the Trainer's log unchecked: a string, a 1,000-
    element tensor or another metric's name failed later inside ``train()`` with torchrl's errors, naming nothing."""
    from torchrl.trainers import EarlyStopping

    from torchrl_dcp.adapters import AdapterContext
    from torchrl_dcp.adapters.trainer import MONITORED_KEY, TrainerHookAdapter

    trainer, _ = _sac_trainer(tmp_path, 32)
    hook = EarlyStopping(monitor="r_evaluation", patience=10**9, wait_for=0)
    hook.register(trainer)
    trainer._log(r_evaluation=torch.tensor(-2.5))
    adapter, ctx = TrainerHookAdapter(), AdapterContext("trainer_module.early_stopping")
    state = dict(adapter.state(hook, ctx))
    saved = {"monitor": "r_evaluation", "value": torch.zeros(1000) if value == "tensor1000" else value}
    if value == "other-metric":
        saved = {"monitor": "other", "value": 1.0}
    state[MONITORED_KEY] = saved
    with pytest.raises(tdcp.IncompatibleComponentError, match="monitored metric"):
        adapter.restore(hook, state, ctx)


def test_an_env_generator_the_checkpoint_lacks_is_warned_about() -> None:
    """A checkpoint without one of the env's generators (damaged, or an env built with more) left it drawing on from
    where it was, silently, where the other direction (a saved generator the env lacks) is refused."""
    from torchrl.envs import PendulumEnv

    from torchrl_dcp.adapters.env import restore_env_generators

    with pytest.warns(tdcp.InexactResumeWarning, match="generator"):
        restore_env_generators(PendulumEnv(), {}, "env")


def _op_buffer_trainer(ckpt_dir: Path, frames: int) -> tuple[Any, Any]:
    """A Trainer whose prioritized buffer is reached only through ``register_op`` (torchrl's docstring's three
    calls): its ``ReplayBufferTrainer`` is the hook component."""
    from torchrl.collectors import Collector
    from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
    from torchrl.trainers import ReplayBufferTrainer, Trainer

    from torchrl_dcp.examples.sac import make_env, make_learner

    torch.manual_seed(0)
    env = make_env(1000, torch.device("cpu"), max_steps=30)
    actor, loss = make_learner(env, torch.device("cpu"), 16)
    optimizer = torch.optim.Adam(loss.parameters(), lr=3e-3)
    collector = Collector(env, actor, frames_per_batch=32, total_frames=-1, auto_register_policy_transforms=False)
    buffer = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(256), batch_size=16)
    trainer = Trainer(
        collector=collector,
        total_frames=frames,
        frame_skip=1,
        optim_steps_per_batch=1,
        loss_module=loss,
        optimizer=optimizer,
        progress_bar=False,
        checkpoint=tdcp.DistributedCheckpoint(),
        checkpoint_rotation=tdcp.CheckpointRotation(ckpt_dir, every_steps=32),
    )
    rbt = ReplayBufferTrainer(buffer, batch_size=None, flatten_tensordicts=True)
    trainer.register_op("batch_process", rbt.extend)
    trainer.register_op("process_optim_batch", rbt.sample)
    trainer.register_op("post_loss", rbt.update_priority)
    return trainer, buffer


def test_a_prioritized_buffer_only_register_op_reaches_is_saved_and_resumed(tmp_path: Path) -> None:
    """torchrl's ``state_dict`` of the hook holds the sampler's C++ sum trees, which are never pickled: every save
    failed. The hook's buffer now goes through the replay-buffer adapter (trees as tensors)."""
    trainer, buffer = _op_buffer_trainer(tmp_path, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    assert "trainer_op.ReplayBufferTrainer" in trainer.checkpoint.components
    trainer2, restored = _op_buffer_trainer(tmp_path, 64)
    info = tdcp.resume(trainer2.checkpoint, tmp_path)
    assert info is not None and "trainer_op.ReplayBufferTrainer" in info.result.loaded
    assert len(restored) == len(buffer) == 64
    capacity = torch.arange(256)
    assert torch.equal(restored._sampler._sum_tree[capacity], buffer._sampler._sum_tree[capacity])
    assert torch.equal(restored._storage._storage[:64]["observation"], buffer._storage._storage[:64]["observation"])
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    buffer.set_rng(g1)
    restored.set_rng(g2)
    assert torch.equal(buffer.sample()["index"], restored.sample()["index"])


class _SeenRewards:
    """A user's hook whose state is empty until it has seen a batch (a dict it fills as it goes)."""

    def __new__(cls, scale: float) -> Any:
        from torchrl.trainers import TrainerHookBase

        class SeenRewards(TrainerHookBase):
            def __init__(self, scale: float) -> None:
                self.scale = scale
                self.seen: dict[str, float] = {}

            def __call__(self, batch: Any) -> Any:
                self.seen["sum"] = self.seen.get("sum", 0.0) + self.scale * float(batch["next", "reward"].sum())
                return batch

            def state_dict(self) -> dict[str, Any]:
                return dict(self.seen)

            def load_state_dict(self, state_dict: dict[str, Any]) -> None:
                self.seen = dict(state_dict)

            def register(self, trainer: Any, name: str = "seen") -> None:
                trainer.register_op("batch_process", self)

        SeenRewards.__module__ = __name__  # (a user's module, not torchrl's)
        SeenRewards.__qualname__ = "SeenRewards"
        return SeenRewards(scale)


def test_a_users_hook_whose_state_starts_empty_is_resumed_in_its_own_slot(tmp_path: Path) -> None:
    """A user's hook with an empty state in a fresh process was not found at the resume: its saved state was
    skipped (silently), and a second hook of its class took the first one's name and so its state. A hook outside
    torchrl with a ``state_dict`` of its own is found whatever its state holds."""

    def two_hooks(trainer):
        hooks = [_SeenRewards(1.0), _SeenRewards(-2.0)]
        for hook in hooks:
            hook.register(trainer)
        return hooks

    trainer, saved = _sac_trainer(tmp_path, 32, two_hooks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    assert saved[0].seen and saved[1].seen and saved[0].seen != saved[1].seen
    trainer2, restored = _sac_trainer(tmp_path, 64, two_hooks)
    assert not restored[0].seen and not restored[1].seen
    info = tdcp.resume(trainer2.checkpoint, tmp_path)
    assert info is not None and {"trainer_op.SeenRewards", "trainer_op.SeenRewards.2"} <= set(info.result.loaded)
    assert [h.seen for h in restored] == [h.seen for h in saved]


def test_a_users_hook_holding_state_without_a_state_dict_is_refused_by_name_as_register_module_refuses_it(
    tmp_path: Path,
) -> None:
    """A ``TrainerHookBase`` of the user's that counts but inherits torchrl's abstract ``state_dict``
    (``NotImplementedError``), given to ``register_op``: the op scan took it for a hook keeping no state and skipped
    it, so its count restarted at a resume, silently (``register_module`` refused the same hook by name)."""
    from torchrl.trainers import TrainerHookBase

    class EveryBatch(TrainerHookBase):
        def __init__(self) -> None:
            self.count = 0

        def __call__(self, batch: Any) -> Any:
            self.count += 1
            return batch

        def register(self, trainer: Any, name: str = "every_batch") -> None:
            trainer.register_op("batch_process", self)

    class Stateless(TrainerHookBase):  # holds nothing: still no component (nothing to lose)
        def __call__(self, batch: Any) -> Any:
            return batch

        def register(self, trainer: Any, name: str = "stateless") -> None:
            trainer.register_op("batch_process", self)

    def hooks(trainer: Any) -> None:
        EveryBatch().register(trainer)
        Stateless().register(trainer)

    trainer, _ = _sac_trainer(tmp_path, 32, hooks)
    assert "trainer_op.Stateless" not in trainer.checkpoint.components
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tdcp.EncodingError, match=r"'trainer_op.EveryBatch'.*state_dict is not implemented"):
            trainer.train()


class _CountingOp:
    """A user's op that is no ``TrainerHookBase``: a callable object with a ``state_dict`` of its own."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return args[0] if args else None

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls = state_dict["calls"]


def test_a_users_stateful_callable_op_is_saved_and_ops_of_the_job_reshard(tmp_path: Path) -> None:
    """A callable object of the user's with a ``state_dict`` (no TrainerHookBase) given to ``register_op`` was never
    saved: its count restarted at a resume, silently. And what ``register_op`` reaches of the job's state (an LR
    scheduler's ``step``) was saved with the generic adapter, which cannot reshard: a resume on another number of
    ranks was refused, where docs/components/trainer.md says ``trainer_op.*`` reshards."""

    def ops(trainer):
        counting = _CountingOp()
        trainer.register_op("post_optim", counting)
        scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=3, gamma=0.5)
        trainer.register_op("post_optim", scheduler.step)
        return counting, scheduler

    trainer, (counting, scheduler) = _sac_trainer(tmp_path, 32, ops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.checkpoint_rotation.close()
    assert counting.calls > 0
    components = trainer.checkpoint.components
    assert {"trainer_op._CountingOp", "trainer_op.StepLR"} <= set(components)
    assert trainer.checkpoint._adapter("trainer_op.StepLR").can_reshard
    trainer2, (counting2, scheduler2) = _sac_trainer(tmp_path, 64, ops)
    info = tdcp.resume(trainer2.checkpoint, tmp_path)
    assert info is not None and {"trainer_op._CountingOp", "trainer_op.StepLR"} <= set(info.result.loaded)
    assert counting2.calls == counting.calls and scheduler2.state_dict() == scheduler.state_dict()


def test_keep_best_on_a_trainer_that_records_no_such_metric_is_refused_when_it_binds(tmp_path: Path) -> None:
    """keep_best=("reward", "max") on a Trainer built without ``checkpoint_metadata``: training ran until the first
    scheduled save, which then failed ("keep_best needs a finite number in metadata['reward'], got None") without a
    word of the Trainer's ``checkpoint_metadata``. Refused when the Trainer binds, saying what to pass."""
    from tests_distributed.trainer_zoo import BUILDERS, trainer_classes

    def build(**extra: Any) -> Any:
        args = {"total_frames": 32, "save_every": 16, "ckpt_dir": str(tmp_path)}
        kwargs = BUILDERS["SACTrainer"]("SACTrainer", 0, args)
        kwargs["checkpoint_rotation"] = tdcp.CheckpointRotation(tmp_path, every_steps=16, keep_best=("reward", "max"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return trainer_classes()["SACTrainer"](**kwargs, **extra)

    with pytest.raises(ValueError, match=r"metadata\['reward'\].*checkpoint_metadata=lambda trainer"):
        build()
    assert build(checkpoint_metadata=lambda trainer: {"reward": 1.0}) is not None


# ---------------------------------------------------------------------- each rank's logging: schedule and logger
def _logging_trainer(ckpt_dir: Path, logger: Any = None) -> Any:
    from tests_distributed.trainer_zoo import build_trainer

    trainer = build_trainer("SACTrainer", 0, ckpt_dir, total_frames=64, save_every=1000, logger=logger)
    trainer._log_interval = 10
    trainer.register_op("post_steps_log", lambda batch: {"eval": 1.0})
    return trainer


def test_a_trainers_logging_schedule_and_missing_logger_are_saved_per_rank_and_resumed(tmp_path: Path) -> None:
    """``_last_log`` (when each key is logged next) is each rank's own: saved in the per-rank ``trainer_rank_state``, not in
    the replicated ``trainer_state`` (a key logged on rank 0 only failed every save's replica check); a rank without
    a logger saves a ``NoLogger`` as ``logger`` (every rank saves the same components)."""
    trainer = _logging_trainer(tmp_path / "run")
    trainer.train()
    assert trainer._last_log.get("eval", 0) > 0 and "_last_log" in vars(trainer)
    saved = trainer.checkpoint_rotation.latest()  # (train()'s final save)
    manifest = tdcp.read_manifest(saved)
    placements = {n: c["placement"] for n, c in manifest["components"].items()}
    assert placements["trainer_rank_state"] == placements["logger"] == "per_rank"
    assert placements["trainer_state"] == "replicated"
    fresh = _logging_trainer(tmp_path / "run2")
    assert fresh._last_log == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        fresh.checkpoint.load(saved)
    assert fresh._last_log == trainer._last_log and fresh._last_log is not trainer._last_log


def test_a_checkpoint_whose_trainer_state_holds_the_logging_schedule_loads_it_without_a_warning(
    tmp_path: Path,
) -> None:
    """Checkpoints saved before ``trainer_rank_state`` (and torchrl's) hold ``_last_log`` in ``trainer_state``: restored
    from there, nothing said to be kept."""
    trainer = _logging_trainer(tmp_path / "run")
    trainer.train()
    old = tdcp.DistributedCheckpoint()
    old.register("trainer_state", trainer._checkpoint_state, adapter=StateDictAdapter())  # (the old payload)
    old.unregister("trainer_rank_state")
    old.unregister("logger")
    old.save(tmp_path / "c")
    saved = tdcp.read_manifest(tmp_path / "c")["components"]
    assert set(saved) == {"trainer_state", "rng"} and "'eval'" in str(saved["trainer_state"]["state"])
    fresh = _logging_trainer(tmp_path / "run2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        fresh.checkpoint.load(
            tmp_path / "c", components=["trainer_state", "trainer_rank_state", "logger"], strict="warn"
        )
    assert fresh._last_log == trainer._last_log


def test_a_logger_loading_what_a_rank_without_one_saved_is_said_to_start_afresh(tmp_path: Path) -> None:
    from torchrl.record.loggers import CSVLogger

    trainer = _logging_trainer(tmp_path / "run")
    trainer.checkpoint.save(tmp_path / "c")
    logger = CSVLogger("run", log_dir=str(tmp_path / "logs"))
    with_logger = _logging_trainer(tmp_path / "run2", logger=logger)
    assert with_logger.checkpoint._components["logger"].value is logger
    with pytest.warns(tdcp.InexactResumeWarning, match="no logger when the checkpoint was saved"):
        with_logger.checkpoint.load(tmp_path / "c")
    with_logger.checkpoint.save(tmp_path / "c2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _logging_trainer(tmp_path / "run3").checkpoint.load(tmp_path / "c2")  # (a rank without one: nothing to say)


@pytest.mark.parametrize("forged", [{"eval": -1}, {"eval": "7"}, {"eval": 1.5}, [1]])
def test_a_forged_logging_schedule_is_refused_before_anything_changes(tmp_path: Path, forged: Any) -> None:
    trainer = _logging_trainer(tmp_path / "run")
    trainer.train()
    from torchrl_dcp.adapters.trainer import TrainerHookAdapter

    class Forged:
        def state_dict(self) -> dict[str, Any]:
            return {"last_log": forged}

        def load_state_dict(self, state: Any) -> None: ...

    forged_ckpt = tdcp.DistributedCheckpoint()
    forged_ckpt.register("trainer_rank_state", Forged(), placement="per_rank", adapter=TrainerHookAdapter())
    forged_ckpt.save(tmp_path / "c")
    fresh = _logging_trainer(tmp_path / "run2")
    before = dict(fresh._last_log)
    with pytest.raises(tdcp.CheckpointError, match="trainer_rank_state.*(logging schedule|mapping in the live)"):
        fresh.checkpoint.load(tmp_path / "c", components=["trainer_rank_state"])
    assert fresh._last_log == before


def test_a_trainer_resumed_from_the_save_its_early_stop_made_trains_no_further(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Trainer stopped early (``request_stop``, what ``EarlyStopping`` calls) saves once more and leaves ``train()``;
    the job requeued resumed from that save and trained another batch, where the run that never stopped had ended.
    ``_stop_training`` and its reason are saved: it trains nothing and says so (clearing the flag trains on)."""
    first, _ = _sac_trainer(tmp_path / "run", 64)
    first.register_op("post_steps", lambda: first.request_stop("plateau") if first.collected_frames >= 32 else None)
    first.train()
    assert first.collected_frames == 32
    again, _ = _sac_trainer(tmp_path / "run", 64)
    info = tdcp.resume(again.checkpoint, tmp_path / "run")
    assert info is not None and info.step == 32 and again._stop_training is True and again._stop_reason == "plateau"
    with caplog.at_level("WARNING", logger="torchrl_dcp"):
        again.train()
    assert "stopped early" in caplog.text and "plateau" in caplog.text and again.collected_frames == 32
    again._stop_training = False
    again.train()
    assert again.collected_frames == 64


@pytest.mark.parametrize("forged", [1, "yes", None])
def test_a_forged_stop_request_is_refused(tmp_path: Path, forged: Any) -> None:
    from tests import forging

    trainer, _ = _sac_trainer(tmp_path / "run", 32)
    trainer.checkpoint.save(tmp_path / "c", step=1)

    def forge(m: dict[str, Any]) -> None:
        items = m["components"]["trainer_state"]["state"]["items"]
        lazy = next(v for k, v in items if k == "_tdcp_lazy_attributes")
        lazy["items"] = [[k, forged if k == "_stop_training" else v] for k, v in lazy["items"]]

    forging.edit(tmp_path / "c", forge)
    fresh, _ = _sac_trainer(tmp_path / "run2", 32)
    with pytest.raises(tdcp.CheckpointError, match="stop request|_stop_training. is a str"):
        fresh.checkpoint.load(tmp_path / "c")


def test_trainer_load_from_file_passes_the_load_options_on(tmp_path: Path) -> None:
    """``load_from_file(path, world_size_change=..., components=[...])`` dropped every option but ``strict`` and
    ``map_location``: a resharding load through it was refused with advice it had followed. They reach the load; one
    it does not take is refused, naming it."""
    trainer, _, loss = build("iql", tmp_path / "run")
    trainer.train()
    path = tdcp.CheckpointRotation(tmp_path / "run").entries()[-1].path
    fresh, fresh_buffer, fresh_loss = build("iql", tmp_path / "other")
    fresh.load_from_file(path, components=["loss_module"], world_size_change="reshard", verify=False)
    assert state_differences(state_snapshot(loss, "loss"), state_snapshot(fresh_loss, "loss")) == []
    assert len(fresh_buffer) == 0  # (not among the components chosen)
    with pytest.raises(TypeError, match="no_such_option"):
        fresh.load_from_file(path, no_such_option=1)


def test_a_save_from_a_hook_inside_an_iteration_is_said_inexact_at_its_resume(tmp_path: Path) -> None:
    """Probe d3: a ``save_trainer(force_save=True)`` from a ``post_optim`` hook saved the Trainer after part of an
    iteration; the resumed Trainer starts with the next collection, the rest of that iteration (optimisation steps,
    hooks, logs) never runs, and nothing said so. The save records it, and its load says so; saves at the end of an
    iteration (the rotation's, the final one) do not."""
    trainer, _ = _sac_trainer(tmp_path / "run", 32)  # (its rotation keeps 2: the save inside, the final one)
    calls = []

    def save_inside() -> None:
        calls.append(int(trainer.collected_frames))
        if len(calls) == 1:
            trainer.save_trainer(force_save=True)

    trainer.register_op("post_optim", save_inside)
    trainer.train()
    entries = tdcp.CheckpointRotation(tmp_path / "run").entries()
    inside, last = entries[0].path, entries[-1].path
    assert tdcp.read_manifest(inside)["step"] == calls[0]

    def resumed_warnings(path: Path) -> list[str]:
        again, _ = _sac_trainer(tmp_path / "again", 32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again.checkpoint.load(path)
        return [str(w.message) for w in caught if issubclass(w.category, tdcp.InexactResumeWarning)]

    assert any("saved in the middle of a training iteration" in w for w in resumed_warnings(inside))
    assert not any("middle of a training iteration" in w for w in resumed_warnings(last))


def test_a_save_from_a_hook_counts_toward_no_schedule_and_a_resume_clears_the_mark(tmp_path: Path) -> None:
    """Probe e1: a hook's save inside an iteration at a scheduled step (every 16 frames) counted as the rotation's
    save of that step, so the iteration's own save at its end was "not due", and the step's only entry resumed
    inexactly. It counts toward no schedule: the end-of-iteration save replaces it. And a Trainer whose iteration
    raised, resumed in the same process, was still marked inside an iteration: its next saves warned falsely."""
    from tests_distributed.trainer_zoo import build_trainer

    trainer = build_trainer("SACTrainer", 0, tmp_path / "run", total_frames=32, save_every=16)
    saved_inside: list[int] = []

    def save_inside() -> None:
        if not saved_inside:
            saved_inside.append(int(trainer.collected_frames))
            trainer.save_trainer(force_save=True)

    trainer.register_op("post_optim", save_inside)
    trainer.train()
    entries = {e.step: e.path for e in tdcp.CheckpointRotation(tmp_path / "run").entries()}
    assert saved_inside[0] in entries

    def said(path: Path) -> list[str]:
        again = build_trainer("SACTrainer", 0, tmp_path / "again", total_frames=32, save_every=16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again.checkpoint.load(path)
        return [str(w.message) for w in caught if "middle of a training iteration" in str(w.message)]

    assert said(entries[saved_inside[0]]) == []  # (replaced by the iteration's own save at its end)

    failing = build_trainer("SACTrainer", 0, tmp_path / "fails", total_frames=32, save_every=16)

    def fail() -> None:
        raise RuntimeError("an op failed")

    failing.register_op("post_optim", fail)
    with pytest.raises(RuntimeError, match="an op failed"):
        failing.train()
    assert tdcp.resume(failing.checkpoint, tmp_path / "run") is not None
    assert said(failing.checkpoint.save(tmp_path / "after")) == []


def test_a_preemption_signal_before_a_hooks_save_still_stops_the_trainer_at_the_iterations_end(
    tmp_path: Path,
) -> None:
    """Probe f1: a preemption signal that reached the rank before a hook's ``save_trainer(force_save=True)`` was
    taken by that save: the Trainer saved inside the iteration as the preemption's save (inexact), never called
    ``request_stop`` and trained on to ``total_frames``. The hook's save is a save of its own; the iteration's end
    stops the Trainer and makes the preemption's save there (exact)."""
    from tests_distributed.trainer_zoo import BUILDERS, trainer_classes

    kwargs = BUILDERS["SACTrainer"](
        "SACTrainer", 0, {"total_frames": 96, "save_every": 1000, "ckpt_dir": str(tmp_path), "num_epochs": None}
    )
    rotation = tdcp.CheckpointRotation(tmp_path / "run", every_steps=1000, preemption_signals=(signal.SIGUSR1,))
    kwargs["checkpoint_rotation"] = rotation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_classes()["SACTrainer"](**kwargs)
    signalled: list[int] = []

    def signal_then_save() -> None:
        if int(trainer.collected_frames) == 32 and not signalled:
            signalled.append(32)
            os.kill(os.getpid(), signal.SIGUSR1)  # (the scheduler's notice, during the iteration)
            trainer.save_trainer(force_save=True)

    trainer.register_op("post_optim", signal_then_save)
    try:
        trainer.train()
    finally:
        rotation.close()
    assert int(trainer.collected_frames) == 32 and trainer._stop_training
    (entry,) = tdcp.CheckpointRotation(tmp_path / "run").entries()  # (the hook's, replaced at the iteration's end)
    assert "mid_iteration" not in str(tdcp.read_manifest(entry.path)["components"]["trainer_rank_state"])


def test_a_hooks_save_before_the_batch_is_counted_never_replaces_the_previous_iterations_save(
    tmp_path: Path,
) -> None:
    """Probe f1: torchrl counts a batch's frames after its ``batch_process`` hooks, so a forced save from one is
    made at the previous iteration's step: it replaced that iteration's exact checkpoint by one saved inside the
    next iteration, which no later save replaced back. It is not made, and a warning says where to save instead.
    The same for a hook that rolls the Trainer back (a load) to a saved step, then saves; such a load keeps the
    Trainer marked inside its iteration (a save from a later hook of it is said inexact at its resume)."""
    from tests_distributed.trainer_zoo import build_trainer

    trainer = build_trainer("SACTrainer", 0, tmp_path / "run", total_frames=64, save_every=32)
    seen: list[int] = []

    def save_before_counting(batch: Any) -> Any:
        seen.append(int(trainer.collected_frames))
        if len(seen) == 3:  # (the third iteration: the frames still those of the second's end, 32)
            with pytest.warns(tdcp.TorchrlDcpWarning, match="not made"):
                trainer.save_trainer(force_save=True)
        return batch

    trainer.register_op("batch_process", save_before_counting)
    trainer.train()
    assert seen[2] == 32
    entries = {e.step: e.path for e in tdcp.CheckpointRotation(tmp_path / "run").entries()}
    assert sorted(entries) == [32, 64]
    for path in entries.values():
        assert "mid_iteration" not in str(tdcp.read_manifest(path)["components"]["trainer_rank_state"])

    rolling = build_trainer("SACTrainer", 0, tmp_path / "rolls", total_frames=64, save_every=32)
    calls: list[int] = []

    def roll_back_then_save() -> None:
        calls.append(int(rolling.collected_frames))
        if calls.count(48) == 1 and calls[-1] == 48:
            rolling.checkpoint.load(tmp_path / "rolls" / "step-000000000032")
            assert rolling._tdcp_mid_iteration is True  # (the rest of the iteration still runs)
            rolling.checkpoint.save(tmp_path / "snapshot")

    rolling.register_op("post_optim", roll_back_then_save)
    rolling.train()
    assert "mid_iteration" in str(tdcp.read_manifest(tmp_path / "snapshot")["components"]["trainer_rank_state"])


def _mark(path: Path) -> str:
    """``"mid"`` for a checkpoint saved from inside an iteration, else ``"exact"``."""
    return "mid" if "mid_iteration" in str(tdcp.read_manifest(path)["components"]["trainer_rank_state"]) else "exact"


def test_a_load_of_a_trainers_checkpoint_by_any_path_makes_its_rotation_count_from_the_loaded_step(
    tmp_path: Path,
) -> None:
    """Probe g1: only ``tdcp.resume`` through the rotation's own spelling of its directory and ``load_from_file``
    told the bound rotation the loaded step; after ``trainer.checkpoint.load(entry)`` (or a resume through a link to
    the directory) it counted from 0: an extra save at 48 the run that never stopped did not make, and a forced save
    from a ``batch_process`` hook replaced the loaded step's exact checkpoint. Any load restoring the Trainer's
    counters tells it now."""
    from tests_distributed.trainer_zoo import build_trainer

    first = build_trainer("SACTrainer", 0, tmp_path / "run", total_frames=32, save_every=32)
    first.train()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    for how in ("load", "resume through a link"):
        again = build_trainer("SACTrainer", 0, tmp_path / "run", total_frames=64, save_every=32)
        if how == "load":
            again.checkpoint.load(tmp_path / "run" / "step-000000000032")
        else:
            assert tdcp.resume(again.checkpoint, tmp_path / "link").step == 32
        assert again.checkpoint_rotation._last_step == 32
        snapshots: list[int] = []

        def snapshot(batch: Any, trainer: Any = again, snapshots: list[int] = snapshots) -> Any:
            if not snapshots:
                snapshots.append(int(trainer.collected_frames))
                with pytest.warns(tdcp.TorchrlDcpWarning, match="not made"):
                    trainer.save_trainer(force_save=True)
            return batch

        again.register_op("batch_process", snapshot)
        again.train()
        entries = {e.step: _mark(e.path) for e in tdcp.CheckpointRotation(tmp_path / "run").entries()}
        assert snapshots == [32] and entries == {32: "exact", 64: "exact"}, (how, entries)
        shutil.rmtree(tmp_path / "run" / "step-000000000064")


def test_a_save_due_by_time_from_a_hook_before_the_batch_is_counted_never_replaces_the_last_save(
    tmp_path: Path,
) -> None:
    """Probe g1: with ``every_seconds``, a plain ``save_trainer()`` from a ``batch_process`` hook (at the previous
    iteration's step: torchrl counts the batch after those hooks) was due by time and replaced that step's exact
    checkpoint; a crash before the iteration's end left the inexact one alone. It is not made (the iteration's own
    save stays due)."""
    from tests_distributed.trainer_zoo import BUILDERS, trainer_classes

    kwargs = BUILDERS["SACTrainer"](
        "SACTrainer", 0, {"total_frames": 96, "save_every": 1, "ckpt_dir": str(tmp_path), "num_epochs": None}
    )
    kwargs["checkpoint_rotation"] = tdcp.CheckpointRotation(tmp_path / "run", keep_last=10, every_seconds=0.001)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_classes()["SACTrainer"](**kwargs)

    def save_then_crash(batch: Any) -> Any:
        if int(trainer.collected_frames) == 32:
            trainer.save_trainer()
            raise RuntimeError("the node was lost")
        return batch

    trainer.register_op("batch_process", save_then_crash)
    with pytest.raises(RuntimeError, match="node was lost"):
        trainer.train()
    entries = {e.step: _mark(e.path) for e in tdcp.CheckpointRotation(tmp_path / "run").entries()}
    assert entries[32] == "exact", entries


def _sac_with(rotation: tdcp.CheckpointRotation, total_frames: int) -> Any:
    from tests_distributed.trainer_zoo import BUILDERS, trainer_classes

    kwargs = BUILDERS["SACTrainer"](
        "SACTrainer", 0, {"total_frames": total_frames, "save_every": 1, "ckpt_dir": "unused", "num_epochs": None}
    )
    kwargs["checkpoint_rotation"] = rotation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_classes()["SACTrainer"](**kwargs)


def _tiered(run: Path, local: Path) -> tdcp.CheckpointRotation:
    """Shared saves every 32 frames, node-local ones every 16 (one process: no replicas)."""
    tier = tdcp.LocalTier(local, every_steps=16, keep_last=4, replicas=0)
    return tdcp.CheckpointRotation(run, keep_last=10, every_steps=32, local=tier)


def test_a_roll_back_drops_the_local_tiers_abandoned_steps_and_a_partial_resume_counts_from_the_trainers_frames(
    tmp_path: Path,
) -> None:
    """Probe h1: a roll-back (``trainer.checkpoint.load`` of shared step 32 after resuming local step 64) left the
    local tier counting from 64 and holding steps 48 and 64 of the abandoned run, which a later resume took over the
    new run's shared step 64. The load drops them (as ``resume`` does) and the tier counts from 32. And a resume with
    ``components=`` leaving the Trainer's counters out counted from the entry's step (64) though the Trainer was at
    frame 0: it made no save at 32 or 64."""

    first = _tiered(tmp_path / "run", tmp_path / "local")
    _sac_with(first, 64).train()
    first.close()
    assert {"step-000000000048", "step-000000000064"} <= set(os.listdir(tmp_path / "local"))
    again = _tiered(tmp_path / "run", tmp_path / "local")
    trainer = _sac_with(again, 128)
    assert tdcp.resume(trainer.checkpoint, tmp_path / "run").tier == "local"
    with pytest.warns(tdcp.LocalTierWarning, match=r"steps \[48, 64\] were removed, newer than step 32"):
        with pytest.warns(tdcp.TorchrlDcpWarning, match=r"rolled back past its entries of steps \[64\]"):
            trainer.checkpoint.load(tmp_path / "run" / "step-000000000032")  # (said: a resume would take 64)
    assert again._last_step == again.local.last_step == 32
    assert not {"step-000000000048", "step-000000000064"} & set(os.listdir(tmp_path / "local"))
    again.close()

    partial = tdcp.CheckpointRotation(tmp_path / "run", keep_last=10, every_steps=32)
    warm = _sac_with(partial, 64)
    info = tdcp.resume(warm.checkpoint, tmp_path / "run", components=["policy", "loss_module", "optimizer"])
    assert info.step == 64 and "trainer_state" not in info.loaded
    assert partial._last_step == int(warm.collected_frames) == 0

    first = _tiered(tmp_path / "run-2", tmp_path / "local-2")  # (probe i1: its tier counted from 64, kept its steps)
    _sac_with(first, 64).train()
    first.close()
    partial = _tiered(tmp_path / "run-2", tmp_path / "local-2")
    warm = _sac_with(partial, 64)
    with pytest.warns(tdcp.LocalTierWarning, match="were removed"):
        info = partial.resume(warm.checkpoint, components=["policy", "loss_module", "optimizer"])
    assert info.tier == "local" and info.step == 64
    assert partial._last_step == partial.local.last_step == int(warm.collected_frames) == 0
    assert partial.local.steps_on_disk() == []
    partial.close()


def test_after_a_roll_back_this_runs_later_local_step_is_resumed_over_the_abandoned_runs_higher_shared_step(
    tmp_path: Path,
) -> None:
    """Probe i1: after a roll-back to shared step 32 past the abandoned run's shared step 64, the run saved local step
    48 and stopped; a resume compared the tiers by step and took the abandoned step 64. The tiers are ordered by
    commit: each local step's records name the newest shared commit the job knew of, so step 48 is resumed, exactly
    as the run had it."""
    first = _tiered(tmp_path / "run", tmp_path / "local")
    _sac_with(first, 64).train()
    first.close()
    again = _tiered(tmp_path / "run", tmp_path / "local")
    trainer = _sac_with(again, 96)
    with pytest.warns(tdcp.LocalTierWarning, match="were removed"):
        with pytest.warns(tdcp.TorchrlDcpWarning, match=r"rolled back past its entries of steps \[64\]"):
            trainer.checkpoint.load(tmp_path / "run" / "step-000000000032")
    expected: dict[str, torch.Tensor] = {}

    def crash_after_48(batch: Any) -> Any:
        if int(trainer.collected_frames) == 48:  # (the iteration after step 48's saves)
            expected.update({k: v.clone() for k, v in trainer.loss_module.state_dict().items()})
            raise RuntimeError("the node was lost")
        return batch

    trainer.register_op("batch_process", crash_after_48)
    with pytest.raises(RuntimeError, match="node was lost"):
        trainer.train()  # frames 32 -> 48: local step 48 (no shared save is due before 64)
    assert again.local.steps_on_disk()[-1] == 48 and {e.step for e in again.entries()} == {32, 64}
    again.close()

    later = _tiered(tmp_path / "run", tmp_path / "local")
    resumed = _sac_with(later, 64)
    info = later.resume(resumed.checkpoint)
    assert (info.tier, info.step) == ("local", 48), info
    assert int(resumed.collected_frames) == 48
    got = resumed.loss_module.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "not the roll-back run's step 48"
    later.close()


def test_a_hooks_save_is_made_where_the_loaded_step_is_not_in_the_rotation(tmp_path: Path) -> None:
    """Probe h1: a Trainer started from another run's step 32 (``trainer.checkpoint.load``) into an empty rotation
    directory: a forced save from a ``batch_process`` hook (at step 32) was refused, naming a checkpoint of step 32
    the rotation does not hold; a crash before the iteration's end then left the run with none. It is made."""
    from tests_distributed.trainer_zoo import build_trainer

    build_trainer("SACTrainer", 0, tmp_path / "other", total_frames=32, save_every=32).train()
    trainer = build_trainer("SACTrainer", 0, tmp_path / "new", total_frames=96, save_every=32)
    trainer.checkpoint.load(tmp_path / "other" / "step-000000000032")

    def snapshot_then_crash(batch: Any) -> Any:
        trainer.save_trainer(force_save=True)
        raise RuntimeError("the node was lost")

    trainer.register_op("batch_process", snapshot_then_crash)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.TorchrlDcpWarning)
        with pytest.raises(RuntimeError, match="node was lost"):
            trainer.train()
    entries = {e.step: _mark(e.path) for e in tdcp.CheckpointRotation(tmp_path / "new").entries()}
    assert entries == {32: "mid"}, entries


def test_a_resume_through_a_link_to_the_rotations_directory_resumes_with_its_local_tier(tmp_path: Path) -> None:
    """Probe k1: ``tdcp.resume(trainer.checkpoint, <a link to the rotation's directory>)`` compared the spellings as
    strings: a new rotation without the Trainer's local tier resumed the shared step 32, and the Trainer's rotation,
    told of that load, dropped the local tier's newer step 48 (the newest good state) as an abandoned future."""

    first = _tiered(tmp_path / "run", tmp_path / "local")
    _sac_with(first, 48).train()
    first.close()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    again = _tiered(tmp_path / "run", tmp_path / "local")
    info = tdcp.resume(_sac_with(again, 96).checkpoint, tmp_path / "link")
    assert (info.step, info.tier) == (48, "local")
    assert 48 in again.local.steps_on_disk()
    again.close()
