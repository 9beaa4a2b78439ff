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
