"""A ``torchrl.checkpoint`` checkpoint is checked by the registered adapter as our own checkpoints are.

An import read the torchrl files and restored them through ``load_state_dict`` (or the buffer's rows and settings)
without the adapter's checks: a replay buffer whose plain-JSON writer cursor points past its rows, a prioritized
sampler with a negative ``alpha``, an optimizer state of another model (the next ``step()`` failed), a negative
learning rate, a Python RNG stream of zeros (``random.random()`` then draws 0.0 for ever) all loaded. torchrl's format
has no checksums: editing its JSON is what a forger does. Each is now refused before any object changes, as the same
state in our format is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.checkpoint import Checkpoint, GlobalRNGState
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

import torchrl_dcp as tdcp


def _plain() -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)


def _prioritized() -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(storage=LazyTensorStorage(10), sampler=PrioritizedSampler(10, 0.7, 0.5), batch_size=2)


def _edit_json(path: Path, pattern: str, edit: Callable[[Any], None]) -> None:
    (found,) = path.glob(pattern)
    value = json.loads(found.read_text())
    edit(value)
    found.write_text(json.dumps(value))


BUFFER_EDITS = {
    "writer cursor past the rows of a buffer never full": (_plain, "writer/metadata.json", {"cursor": 8}, "cursor"),
    "writer cursor past max_size": (_plain, "writer/metadata.json", {"cursor": 1000}, "cursor"),
    "prioritized alpha negative": (_prioritized, "sampler/sampler_metadata.json", {"_alpha": -1.0}, "alpha"),
    "prioritized max-priority index past the capacity": (
        _prioritized,
        "sampler/sampler_metadata.json",
        {"_max_priority": [1.0, 50]},
        "max",
    ),
}


@pytest.mark.parametrize("case", BUFFER_EDITS)
def test_a_buffer_state_no_save_writes_is_refused_leaving_the_buffer(tmp_path: Path, case: str) -> None:
    build, member, values, says = BUFFER_EDITS[case]
    rb = build()
    rb.extend(TensorDict({"x": torch.arange(4.0)}, [4]))
    path = Path(Checkpoint(rb=rb).save(tmp_path / "c"))
    _edit_json(path, f"components/*-rb/{member}", lambda m: m.update(values))
    live = build()
    live.extend(TensorDict({"x": torch.full((2,), 7.0)}, [2]))
    before = tdcp.state_snapshot(live)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=says) as err:
        tdcp.DistributedCheckpoint(rb=live).load(path)
    assert "no save writes that state" in str(err.value)
    assert not tdcp.state_differences(before, tdcp.state_snapshot(live))


def _adam(fan_in: int, fan_out: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    policy = torch.nn.Linear(fan_in, fan_out)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.randn(4, fan_in)).sum().backward()
    optim.step()
    return policy, optim


def test_an_optimizer_state_of_another_model_is_incompatible_as_in_our_format(tmp_path: Path) -> None:
    _, saved = _adam(3, 2)
    theirs = Checkpoint(optim=saved).save(tmp_path / "theirs")
    ours = tdcp.DistributedCheckpoint(optim=saved).save(tmp_path / "ours")
    for path in (ours, theirs):
        _, live = _adam(2, 3)
        before = tdcp.state_snapshot(live)
        with pytest.raises(tdcp.IncompatibleComponentError, match="'optim'"):
            tdcp.DistributedCheckpoint(optim=live).load(path)
        assert not tdcp.state_differences(before, tdcp.state_snapshot(live))


def test_a_negative_learning_rate_is_refused(tmp_path: Path) -> None:
    _, saved = _adam(3, 2)
    path = Path(Checkpoint(optim=saved).save(tmp_path / "c"))
    (state,) = path.glob("components/*/state.json")
    text = state.read_text()
    forged = text.replace('"lr"},{"kind":"value","value":0.001}', '"lr"},{"kind":"value","value":-5.0}')
    assert forged != text
    state.write_text(forged)
    _, live = _adam(3, 2)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="lr is -5.0"):
        tdcp.DistributedCheckpoint(optim=live).load(path)
    assert live.param_groups[0]["lr"] == 0.001


@pytest.mark.parametrize("into", ["GlobalRNGState", "RNGState"])
def test_a_python_stream_of_zeros_is_refused(tmp_path: Path, into: str) -> None:
    path = Path(Checkpoint(rng=GlobalRNGState()).save(tmp_path / "c"))

    def zeros(node: Any) -> None:  # "python": (3, (w0, ..., w623, position), None)
        words = node["items"][0][1]["items"][1]["items"]
        for word in words[:-1]:
            word["value"] = 0

    _edit_json(path, "components/*rng/state.json", zeros)
    before = random.getstate()
    live = GlobalRNGState() if into == "GlobalRNGState" else tdcp.RNGState()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="all zeros"):
        tdcp.DistributedCheckpoint(rng=live).load(path)
    assert random.getstate() == before


def test_honest_torchrl_checkpoints_of_checked_components_still_load(tmp_path: Path) -> None:
    rb = _prioritized()
    rb.extend(TensorDict({"x": torch.arange(6.0)}, [6]))
    rb.update_priority(torch.arange(6), torch.arange(1.0, 7.0))
    policy, optim = _adam(3, 2)
    path = Checkpoint(rb=rb, optim=optim, rng=GlobalRNGState()).save(tmp_path / "c")
    live_rb, (_, live_optim) = _prioritized(), _adam(3, 2)
    result = tdcp.DistributedCheckpoint(rb=live_rb, optim=live_optim, rng=GlobalRNGState()).load(path)
    assert result.loaded == {"rb", "optim", "rng"}
    differences = tdcp.state_differences(tdcp.state_snapshot(rb), tdcp.state_snapshot(live_rb))
    assert not [d for d in differences if "_last_cursor" not in d.path]  # (torchrl's dump leaves the last cursor out)
    assert not tdcp.state_differences(tdcp.state_snapshot(optim), tdcp.state_snapshot(live_optim))


def test_a_state_our_format_cannot_hold_is_restored_as_torchrl_restores_it(tmp_path: Path) -> None:
    """A scheduler built with NumPy milestones (its ``state_dict``'s ``Counter`` keyed by ``np.int64``): the checks
    re-encode the state in our format, which refused the keys (a save-time ``EncodingError`` on a load). The generic
    adapter checks kinds only: such a state goes to the object's ``load_state_dict``, as before the checks."""
    import numpy as np

    def build() -> tuple[torch.optim.Optimizer, Any]:
        optim = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        return optim, torch.optim.lr_scheduler.MultiStepLR(optim, milestones=np.array([2, 4]), gamma=0.5)

    optim, sched = build()
    for _ in range(3):
        optim.step()
        sched.step()
    path = Checkpoint(optim=optim, sched=sched).save(tmp_path / "c")
    live_optim, live = build()
    tdcp.DistributedCheckpoint(optim=live_optim, sched=live).load(path)
    assert live.last_epoch == 3 and live.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("into", ["GlobalRNGState", "RNGState"])
@pytest.mark.parametrize("edit", ["numpy has_gauss 2", "python gauss an int"])
def test_rng_values_no_generator_holds_are_refused(tmp_path: Path, into: str, edit: str) -> None:
    path = Path(Checkpoint(rng=GlobalRNGState()).save(tmp_path / "c"))

    def forge(node: Any) -> None:  # "python": (3, words, gauss); "numpy": (kind, keys, pos, has_gauss, gauss)
        items = {key["value"]: value for key, value in node["items"]}
        if edit == "numpy has_gauss 2":
            items["numpy"]["items"][3].update(value=2)
        else:
            items["python"]["items"][2].update(value=7)

    _edit_json(path, "components/*rng/state.json", forge)
    live = GlobalRNGState() if into == "GlobalRNGState" else tdcp.RNGState()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="has_gauss|gauss values"):
        tdcp.DistributedCheckpoint(rng=live).load(path)


@pytest.mark.parametrize("value", [1, 0.5])
def test_a_capturable_group_of_a_number_onto_cpu_parameters_is_refused(tmp_path: Path, value: float) -> None:
    """``capturable`` 1 or 0.5 (torch's step reads any truthy value as capturable, and asserts on CPU parameters):
    only ``True`` was compared with the parameters' device."""
    _, saved = _adam(3, 2)
    path = Path(Checkpoint(optim=saved).save(tmp_path / "c"))
    (state,) = path.glob("components/*/state.json")
    text = state.read_text()
    forged = text.replace(
        '"capturable"},{"kind":"value","value":false}', f'"capturable"}},{{"kind":"value","value":{value}}}'
    )
    assert forged != text
    state.write_text(forged)
    _, live = _adam(3, 2)
    with pytest.raises(tdcp.IncompatibleComponentError, match="is capturable"):
        tdcp.DistributedCheckpoint(optim=live).load(path)


def test_a_sampler_without_replacement_that_never_sampled_loads(tmp_path: Path) -> None:
    """torchrl writes its ``_sample_list`` (``None``) as a non-tensor entry of the sampler's folder, which the import
    called "unexpected nested entry" (an honest checkpoint refused as malformed)."""
    from torchrl.data import SamplerWithoutReplacement

    def build() -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=LazyTensorStorage(10), sampler=SamplerWithoutReplacement(), batch_size=2)

    rb = build()
    rb.extend(TensorDict({"x": torch.arange(5.0)}, [5]))
    path = Checkpoint(rb=rb).save(tmp_path / "c")
    live = build()
    tdcp.DistributedCheckpoint(rb=live).load(path)
    assert live[:]["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and live._sampler._sample_list is None
