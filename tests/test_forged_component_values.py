"""JSON-valued and small tensor states of torchrl components that no save writes: each written by the library's own
save of a tampered object (every checksum the library's, as a forger resealing the files gets), then refused by a
load (naming the problem, the live object left as it was) and, where the state alone tells, by ``verify`` too
(a hook's adapter shares the generic adapter's id, which is what ``verify`` runs for it).

A sampler without replacement's remaining epoch (rows past the buffer, an index twice, negative ones), a
collector's counters and next trajectory id, ``RandomTruncationTransform``'s horizons, an offline-to-online hook's
fractions, a buffer hook in torchrl's own layout with a writer cursor past its rows, and a ``MultiStepTransform``'s
held-back transitions (more than ``n_steps``, another dtype than the buffer's rows).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import Compose, PendulumEnv, StepCounter, TransformedEnv
from torchrl.envs.transforms import MultiStepTransform, RandomTruncationTransform

import torchrl_dcp as tdcp
from tests import forging


def _without_replacement() -> ReplayBuffer:
    rb = ReplayBuffer(storage=LazyTensorStorage(32), sampler=SamplerWithoutReplacement(), batch_size=4)
    rb.extend(TensorDict({"x": torch.arange(10.0)}, [10]))
    rb.sample()
    return rb


def _epoch(values: list[int]) -> Callable[[ReplayBuffer], None]:
    def forge(rb: ReplayBuffer) -> None:
        rb._sampler._sample_list = torch.tensor(values)

    return forge


def _truncating_collector() -> Collector:
    env = TransformedEnv(
        PendulumEnv(), Compose(StepCounter(), RandomTruncationTransform(min_horizon=3, max_horizon=6, prob=1.0))
    )
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=4, total_frames=400)
    next(iter(collector))
    return collector


def _collector_attr(name: str, value: Any) -> Callable[[Collector], None]:
    def forge(collector: Collector) -> None:
        setattr(collector, name, value)

    return forge


def _horizons(value: Any) -> Callable[[Collector], None]:
    def forge(collector: Collector) -> None:
        collector.env.transform[1]._horizons = value

    return forge


def _next_traj_id(value: int) -> Callable[[Collector], None]:
    def forge(collector: Collector) -> None:
        collector._traj_pool._traj_id.fill_(value)

    return forge


def _n_step_buffer() -> ReplayBuffer:
    rb = ReplayBuffer(storage=LazyTensorStorage(32), transform=MultiStepTransform(n_steps=3, gamma=0.9))
    rb.extend(_transitions(6))
    return rb


def _transitions(n: int, dtype: torch.dtype = torch.float32) -> TensorDict:
    obs = torch.arange(n, dtype=dtype).unsqueeze(-1)
    done = torch.zeros(n, 1, dtype=torch.bool)
    nxt = {
        "obs": obs + 1,
        "reward": torch.ones(n, 1),
        "done": done,
        "terminated": done.clone(),
        "truncated": done.clone(),
    }
    return TensorDict({"obs": obs, "next": nxt}, [n])


def _held(td: TensorDict) -> Callable[[ReplayBuffer], None]:
    def forge(rb: ReplayBuffer) -> None:
        rb._transform[0]._buffer = td

    return forge


def _offline_to_online() -> Any:
    from torchrl.data.replay_buffers.offline_to_online import OfflineToOnlineReplayBuffer
    from torchrl.trainers.algorithms.offline_to_online import OfflineToOnlineReplayBufferHook

    offline = ReplayBuffer(storage=LazyTensorStorage(100))
    offline.extend(TensorDict({"x": torch.arange(100.0)}, [100]))
    rb = OfflineToOnlineReplayBuffer(
        offline_dataset=offline, online_storage=LazyTensorStorage(10), batch_size=8, offline_fraction=0.5
    )
    rb.extend(TensorDict({"x": -torch.arange(1.0, 5.0)}, [4]))
    return OfflineToOnlineReplayBufferHook(rb)


def _fraction(value: float) -> Callable[[Any], None]:
    def forge(hook: Any) -> None:
        hook.replay_buffer._offline_fraction = value

    return forge


#: (build the object, tamper with it, what the refusal says, whether ``verify`` can tell from the state alone)
FORGERIES: dict[str, tuple[Callable[[], Any], Callable[[Any], None], str, bool]] = {
    "sample list past the rows": (_without_replacement, _epoch([20, 21, 22]), r"holds index 20, outside 0..9", True),
    "sample list with an index twice": (_without_replacement, _epoch([0, 0, 0]), r"an index twice", True),
    "sample list with a negative index": (_without_replacement, _epoch([-5, 1]), r"holds index -5", True),
    "collector frames a string": (_truncating_collector, _collector_attr("_frames", "abc"), r"frames is 'abc'", True),
    "collector frames negative": (_truncating_collector, _collector_attr("_frames", -1000), r"frames is -1000", True),
    "collector iter a float": (_truncating_collector, _collector_attr("_iter", 2.5), r"iter is 2.5", True),
    "next trajectory id negative": (_truncating_collector, _next_traj_id(-50), r"next id is -50", True),
    "next trajectory id in flight": (_truncating_collector, _next_traj_id(0), r"ids would be handed out twice", True),
    "horizons a string": (_truncating_collector, _horizons("abc"), r"horizons 'abc'", True),
    "horizons of 1000 envs": (_truncating_collector, _horizons(torch.full((1000,), 5)), r"RandomTruncation", False),
    "horizons as floats": (_truncating_collector, _horizons(torch.tensor([2.5])), r"horizons torch.float32", True),
    "horizon past max_horizon": (_truncating_collector, _horizons(torch.tensor([60])), r"outside 1..6", False),
    "offline fraction above 1": (_offline_to_online, _fraction(7.0), r"offline fraction is 7.0", False),
    "offline fraction negative": (_offline_to_online, _fraction(-3.0), r"offline fraction is -3.0", False),
    "more held transitions than n_steps": (_n_step_buffer, _held(_transitions(50)), r"more than its n_steps=3", False),
    "held transitions of another dtype": (
        _n_step_buffer,
        _held(_transitions(2, torch.float64)),
        r"holds back 'obs' as torch.float64",
        False,
    ),
}


def _state(obj: Any) -> Any:
    return tdcp.state_snapshot(obj)


@pytest.mark.parametrize("name", FORGERIES)
def test_a_component_state_no_save_writes_is_refused(tmp_path: Path, name: str) -> None:
    build, forge, says, by_verify = FORGERIES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (RandomTruncationTransform is saved with an InexactResumeWarning)
        forged = build()
        forge(forged)
        path = tdcp.DistributedCheckpoint(obj=forged).save(tmp_path / "c")
        if by_verify:
            with pytest.raises(tdcp.CheckpointError, match=says):
                tdcp.verify(path)
        live = build()
        before = _state(live)
        with pytest.raises(tdcp.CheckpointError, match=says):
            tdcp.DistributedCheckpoint(obj=live).load(path)
        assert not tdcp.state_differences(before, _state(live))
        control = build()
        tdcp.DistributedCheckpoint(obj=control).load(tdcp.DistributedCheckpoint(obj=build()).save(tmp_path / "honest"))


def test_a_buffer_hook_in_torchrls_own_layout_is_checked_once_restored(tmp_path: Path) -> None:
    """A hook state saved through torchrl's ``state_dict`` (checkpoints written before the buffer went through the
    replay-buffer adapter) says nothing the checks read before the restore: the buffer is checked as restored (a
    writer cursor past the storage's rows here), and the refused restore is rolled back."""
    from torchrl_dcp.adapters.trainer import TrainerHookAdapter

    class Saved:
        def __init__(self, state: Any) -> None:
            self.state = state

        def state_dict(self) -> Any:
            return self.state

        def load_state_dict(self, state: Any) -> None:
            return None

    state = _offline_to_online().state_dict()
    state["online_buffer"]["_storage"]["_len"] = 10
    state["online_buffer"]["_writer"]["_cursor"] = 57
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("hook", Saved(state), adapter=TrainerHookAdapter())
    path = ckpt.save(tmp_path / "c")
    hook = _offline_to_online()
    online = hook.replay_buffer.online_buffer
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"writer's cursor is 57"):
        tdcp.DistributedCheckpoint(hook=hook).load(path)
    assert len(online) == 4 and online._writer._cursor == 4


# ---------------------------------------------------------------------- optimizers, schedulers, hooks, RNG streams
def _adam() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def _scheduled() -> dict[str, Any]:
    objs = _adam()
    objs["sched"] = torch.optim.lr_scheduler.StepLR(objs["optimizer"], step_size=2, gamma=0.5)
    return objs


class _ExtraKeyStepLR(torch.optim.lr_scheduler.StepLR):  # (a resealed manifest whose state holds one more key)
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "step": 5}


def _first_state(objs: dict[str, Any]) -> dict[str, Any]:
    return next(iter(objs["optimizer"].state.values()))


def _state_entry(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def forge(objs: dict[str, Any]) -> None:
        _first_state(objs)[key] = value

    return forge


def _group_option(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def forge(objs: dict[str, Any]) -> None:
        objs["optimizer"].param_groups[0][key] = value

    return forge


def _rng_words(which: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def forge(objs: dict[str, Any]) -> None:
        real = objs["rng"].state_dict

        def forged() -> dict[str, Any]:
            state = real()
            if which == "python":
                state["python"]["state"] = value(state["python"]["state"])
            elif which == "numpy":
                state["numpy"]["keys"] = value(state["numpy"]["keys"])
            elif which == "python gauss":
                state["python"]["gauss"] = value
            else:
                state["torch"] = value
            return state

        objs["rng"].state_dict = forged

    return forge


def _rng() -> dict[str, Any]:
    return {"rng": tdcp.RNGState()}


def _global_rng() -> dict[str, Any]:
    from torchrl.checkpoint import GlobalRNGState

    return {"rng": GlobalRNGState()}


def _global_python_zeros(objs: dict[str, Any]) -> None:
    """torchrl's ``GlobalRNGState`` (its ``random.getstate()`` tuple) with a Python stream of zeros."""
    real = objs["rng"].state_dict

    def forged() -> dict[str, Any]:
        state = real()
        version, words, gauss = state["python"]
        state["python"] = (version, (0,) * (len(words) - 1) + (words[-1],), gauss)
        return state

    objs["rng"].state_dict = forged


def _global_has_gauss_2(objs: dict[str, Any]) -> None:
    """torchrl's ``GlobalRNGState`` (NumPy's ``get_state()`` tuple) with a ``has_gauss`` of 2."""
    real = objs["rng"].state_dict

    def forged() -> dict[str, Any]:
        state = real()
        kind, keys, pos, _, gauss = state["numpy"]
        state["numpy"] = (kind, keys, pos, 2, gauss)
        return state

    objs["rng"].state_dict = forged


def _zeros_but_position(words: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(words)
    out[-1] = words[-1]
    return out


def _counting_env() -> dict[str, Any]:
    from torchrl.envs import TrajCounter

    env = TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=4), TrajCounter()))
    env.set_seed(0)
    env.rollout(3)
    return {"env": env}


def _frames_hook() -> dict[str, Any]:
    from torchrl.trainers import CountFramesLog

    return {"hook": CountFramesLog(frame_skip=1)}


#: (build the objects, tamper with them, what the refusal says, whether ``verify`` tells)
STATE_FORGERIES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None], str, bool]] = {
    "Adam step of the parameter's shape": (_adam, _state_entry("step", torch.ones(2, 3)), r"'step' is a", False),
    "Adam step a bool tensor": (_adam, _state_entry("step", torch.tensor(True)), r"'step' is a torch.bool", False),
    "Adam exp_avg a scalar": (_adam, _state_entry("exp_avg", torch.tensor(0.0)), r"'exp_avg' is a scalar", False),
    "Adam exp_avg a number": (_adam, _state_entry("exp_avg", 0.5), r"'exp_avg' is a float", False),
    "Adam step negative": (_adam, _state_entry("step", torch.tensor(-1.0)), r"step is -1.0", True),
    "lr a string": (_adam, _group_option("lr", "0.1"), r"lr is '0.1'", True),
    "lr NaN": (_adam, _group_option("lr", float("nan")), r"lr is nan", True),
    "betas at 1": (_adam, _group_option("betas", (1.0, 0.999)), r"betas are", True),
    "eps negative": (_adam, _group_option("eps", -1.0), r"eps is -1.0", True),
    "scheduler key shadowing its step()": (
        _scheduled,
        lambda objs: setattr(objs["sched"], "__class__", _ExtraKeyStepLR),
        r"one of its methods",
        False,
    ),
    "scheduler last_epoch a string": (
        _scheduled,
        lambda objs: setattr(objs["sched"], "last_epoch", "x"),
        r"'last_epoch' is a str",
        False,
    ),
    "Python stream of zeros": (_rng, _rng_words("python", _zeros_but_position), r"all zeros", True),
    # (GlobalRNGState's payload is the generic state-dict adapter's: verify, which knows no object, cannot tell)
    "Python stream of zeros (GlobalRNGState)": (_global_rng, _global_python_zeros, r"all zeros", False),
    "NumPy has_gauss 2 (GlobalRNGState)": (_global_rng, _global_has_gauss_2, r"has_gauss 2", False),
    "NumPy key past 32 bits": (_rng, _rng_words("numpy", lambda k: k + (1 << 32)), r"outside 32 bits", True),
    "Python pending Gaussian infinite": (_rng, _rng_words("python gauss", float("inf")), r"Gaussian of inf", True),
    "torch state of 100 bytes": (
        _rng,
        _rng_words("torch", torch.zeros(100, dtype=torch.uint8)),
        r"refused by torch",
        True,
    ),
    "TrajCounter count negative": (
        _counting_env,
        lambda objs: setattr(objs["env"].transform[1]._traj_count, "value", -7),
        r"holds count -7",
        False,
    ),
    "frame count negative": (
        _frames_hook,
        lambda objs: setattr(objs["hook"], "frame_count", -1000),
        r"not a count",
        False,
    ),
    "frame count null": (  # (probe u3: None was let through; the hook's next call raised TypeError)
        _frames_hook,
        lambda objs: setattr(objs["hook"], "frame_count", None),
        r"not a count",
        False,
    ),
}


@pytest.mark.parametrize("name", STATE_FORGERIES)
def test_a_state_no_save_writes_is_refused_leaving_the_objects(tmp_path: Path, name: str) -> None:
    build, forge, says, by_verify = STATE_FORGERIES[name]
    forged = build()
    forge(forged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (RandomTruncationTransform: an InexactResumeWarning)
        path = tdcp.DistributedCheckpoint(**forged).save(tmp_path / "c")
    if by_verify:
        with pytest.raises(tdcp.CheckpointError, match=says):
            tdcp.verify(path)
    live = build()
    if name.startswith(("Python", "NumPy", "torch state")):
        import random

        before = (random.getstate(), torch.get_rng_state())
    else:
        before = {k: tdcp.state_snapshot(v) for k, v in live.items()}
    with pytest.raises(tdcp.CheckpointError, match=says), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.DistributedCheckpoint(**live).load(path)
    if name.startswith(("Python", "NumPy", "torch state")):
        assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    else:
        assert all(not tdcp.state_differences(before[k], tdcp.state_snapshot(v)) for k, v in live.items())


@pytest.mark.parametrize("placement", ["replicated", "per_rank"])
def test_a_mapping_naming_a_key_twice_is_refused_at_load_and_verify(tmp_path: Path, placement: str) -> None:
    """A resealed skeleton whose Adam state lists ``exp_avg`` a second time, pointing at ``exp_avg_sq``'s record:
    the last one won, and the loaded optimizer held one tensor as both moments (verify passed). A per-rank dict's
    key twice likewise loaded another tensor in its place."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.ones(2, 4)).sum().backward()
    optim.step()
    stats = {"t": torch.zeros(2), "i": torch.arange(3)}
    path = (
        tdcp.DistributedCheckpoint(optimizer=optim).register("stats", stats, placement=placement).save(tmp_path / "c")
    )

    def twice(m: dict[str, Any]) -> None:
        moments = m["components"]["optimizer"]["state"]["items"][0][1]["items"][0][1]["items"]
        moments.append(["exp_avg", dict(next(v for k, v in moments if k == "exp_avg_sq"))])
        stats = m["components"]["stats"]
        items = (stats["ranks"]["0"] if placement == "per_rank" else stats)["state"]["items"]
        items.append(["t", dict(next(v for k, v in items if k == "i"))])

    forging.edit(path, twice)
    with pytest.raises(tdcp.CheckpointFormatError, match="holds the key 'exp_avg' twice"):
        tdcp.verify(path)
    live = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())
    with pytest.raises(tdcp.CheckpointError, match="holds the key '(exp_avg|t)' twice"):
        tdcp.DistributedCheckpoint(optimizer=live).register("stats", {}, placement=placement).load(path)
    assert live.state_dict()["state"] == {}


@pytest.mark.parametrize("device", ["not-a-device", "cuda:-1", 0, -1, ["cpu"]])
def test_a_tensordict_device_no_save_writes_is_refused_before_anything_is_read(tmp_path: Path, device: Any) -> None:
    """Probe u3: a resealed TensorDict ``device`` that names no device was found only by the restore, after the rows
    were read in place into the live TensorDict (left holding them); ``0`` loaded and set a device on a TensorDict
    saved without one."""
    path = tdcp.DistributedCheckpoint(
        td=TensorDict({"obs": torch.arange(4.0), "n": {"b": torch.ones(4, 2)}}, [4])
    ).save(tmp_path / "c")

    def forge(m: dict[str, Any]) -> None:
        items = m["components"]["td"]["state"]["items"]
        (entry,) = [e for e in items if e[0] == "device"]
        entry[1] = device

    forging.edit(path, forge)
    live = TensorDict({"obs": torch.full((4,), -7.0), "n": {"b": torch.zeros(4, 2)}}, [4])
    with pytest.raises(tdcp.CheckpointFormatError, match=r"c: component 'td': malformed"):
        tdcp.DistributedCheckpoint(td=live).load(path)
    assert torch.equal(live["obs"], torch.full((4,), -7.0)) and live.device is None


def test_a_trajectory_counter_in_a_parent_envs_copy_is_checked_too(tmp_path: Path) -> None:
    """Probe u3: a TrajCounter's count is saved with the env's transforms and again with each cached parent env's
    (which share the counter); only the first copy was checked, and a forged -7 in the other handed out negative
    trajectory ids after the resume."""
    from torchrl.envs import RewardSum, TrajCounter

    def build() -> TransformedEnv:
        env = TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=4), TrajCounter(), RewardSum()))
        env.set_seed(0)
        env.rollout(3)
        return env

    def items(node: dict[str, Any]) -> dict[Any, Any]:
        return {e[0]: e for e in node["items"]}

    path = tdcp.DistributedCheckpoint(env=build()).save(tmp_path / "c")
    forged = []

    def forge(m: dict[str, Any]) -> None:
        state = m["components"]["env"]["ranks"]["0"]["state"]
        for entry in items(items(state)["parents"][1]).values():
            transforms = items(items(entry[1])["transforms"][1])
            if "transform.1" in transforms:
                items(transforms["transform.1"][1])["traj_count"][1] = -7
                forged.append(entry[0])

    forging.edit(path, forge)
    assert forged
    live = build()
    before = live.transform[1]._traj_count.value
    with pytest.raises(tdcp.CheckpointIntegrityError, match="parent env.*holds count -7"):
        tdcp.DistributedCheckpoint(env=live).load(path)
    assert live.transform[1]._traj_count.value == before
