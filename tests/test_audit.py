"""The state audit (torchrl_dcp.audit): what it walks, what it leaves out, and what it reports."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import torchrl_dcp as tdcp
from torchrl_dcp.audit import NOT_STATE, state_differences, state_snapshot


class Holder:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.steps = 0
        self.weights = torch.zeros(3)
        self.table = {"lr": 0.1, "betas": (0.9, 0.99), "array": np.arange(3)}
        self.items = [TensorDict({"a": torch.ones(2)}, [2]), {1, 2}]
        self.me = self  # a cycle: recorded as a reference, walked once
        self.handler = print  # behaviour, not state
        self.module = torch.nn.Linear(2, 1)


def test_every_reachable_value_is_fingerprinted_and_json_safe() -> None:
    snap = state_snapshot(Holder(), "h")
    assert json.loads(json.dumps(snap)) == snap
    assert snap["h.steps"] == "int 0" and snap["h.table['betas'][1]"] == "float 0.99"
    assert snap["h.me"] == "ref h" and "h.handler" not in snap
    assert snap["h.weights"].startswith("tensor torch.float32 (3,) ")
    assert snap["h.items[0]['a']"].startswith("tensor torch.float32 (2,) ")
    assert snap["h.table['array']"].startswith("tensor torch.int64 (3,) ")
    assert any(p.startswith("h.module._parameters['weight']") for p in snap)


def test_differences_name_each_attribute_that_differs() -> None:
    saved, restored = Holder(), Holder()
    saved.steps = 4
    saved.weights[1] = 2.0
    saved.table["new"] = "x"
    saved.module.weight.data[0, 0] += 1
    found = {d.path for d in state_differences(state_snapshot(saved), state_snapshot(restored))}
    assert found == {"obj.steps", "obj.weights", "obj.table['new']", "obj.module._parameters['weight']"}


def test_one_element_stride_zero_tensors_and_tensor_keys() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    snap = state_snapshot({"bound": torch.tensor(2.0).expand(1), "state": {p: {"step": 3}}})
    assert snap["obj['bound']"].startswith("tensor torch.float32 (1,)")
    assert snap["obj['state'][<Parameter #0>]['step']"] == "int 3"


def test_skips_by_name_and_by_class() -> None:
    h = Holder()
    assert "obj.steps" not in state_snapshot(h, skip=["steps"])
    assert "obj.steps" not in state_snapshot(h, skip=["Holder.steps"])
    assert "obj.steps" in state_snapshot(h, skip=["Other.steps"])
    assert all("." in entry and reason for entry, reason in NOT_STATE.items())


def test_skip_names_a_modules_parameters_by_class_and_takes_one_name_as_a_string() -> None:
    """``skip="weight"`` skipped nothing (iterated as letters) and ``"Linear.weight"`` missed the parameter (it is
    a key of the module's ``_parameters`` dict, not an attribute)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    weight = "obj._modules['0']._parameters['weight']"
    assert weight in state_snapshot(model)
    assert weight not in state_snapshot(model, skip="weight")
    assert weight not in state_snapshot(model, skip=["Linear.weight"])
    assert weight in state_snapshot(model, skip=["Conv2d.weight"])


def test_a_storage_is_audited_by_its_written_rows() -> None:
    def buffer(fill: float) -> ReplayBuffer:
        rb = ReplayBuffer(storage=LazyTensorStorage(8))
        rb.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
        rb._storage._storage["x"][3:] = fill  # rows never written: whatever the memory held
        return rb

    a, b = state_snapshot(buffer(0.0)), state_snapshot(buffer(7.0))
    assert state_differences(a, b) == []
    assert "obj._storage._storage[:3]['x']" in a


def test_an_exact_restore_audits_clean_and_an_inexact_one_does_not(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    path = ckpt.save(tmp_path / "c")
    torch.manual_seed(1)
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters())
    fresh = tdcp.DistributedCheckpoint()
    fresh.register("model", model2)
    fresh.register("optimizer", opt2)
    before = state_differences(state_snapshot(opt), state_snapshot(opt2))
    assert before  # (a fresh optimizer: no moments, other parameters)
    fresh.load(path)
    assert state_differences(state_snapshot(opt), state_snapshot(opt2)) == []


def test_a_collector_holding_trajectory_steps_audits_clean_after_a_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With ``trajs_per_batch``, the load hands the held steps to the next iterator through an object of the
    library's (set as ``collector.iterator``): the audit listed it as differing state."""
    import warnings

    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv, StepCounter, TransformedEnv

    import torchrl_dcp as tdcp

    def make(seed: int) -> TransformedEnv:
        env = TransformedEnv(PendulumEnv(), StepCounter(max_steps=7))
        env.set_seed(seed)
        return env

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    saved = Collector(make(0), None, frames_per_batch=10, total_frames=-1, trajs_per_batch=3)
    it = iter(saved)
    next(it)
    next(it)
    before = tdcp.state_snapshot(saved, "c")
    path = tdcp.DistributedCheckpoint(collector=saved).save(tmp_path / "c")
    fresh = Collector(make(9), None, frames_per_batch=10, total_frames=-1, trajs_per_batch=3)
    tdcp.DistributedCheckpoint(collector=fresh).load(path)
    assert tdcp.state_differences(before, tdcp.state_snapshot(fresh, "c")) == []
    saved.shutdown()
    fresh.shutdown()


def test_a_ragged_lazy_stack_and_signed_nans_are_audited() -> None:
    """``state_snapshot`` of a ragged ``LazyStackedTensorDict`` raised tensordict's "Failed to stack tensors" (it
    read each entry through the stack); a NaN and a -NaN, which a save keeps apart, had one fingerprint."""
    import math

    import torch
    from tensordict import LazyStackedTensorDict, TensorDict

    def ragged(last: float) -> LazyStackedTensorDict:
        parts = [TensorDict({"x": torch.zeros(2)}, []), TensorDict({"x": torch.full((3,), last)}, [])]
        return LazyStackedTensorDict(*parts, stack_dim=0)

    same = tdcp.state_differences(tdcp.state_snapshot(ragged(1.0), "s"), tdcp.state_snapshot(ragged(1.0), "s"))
    assert same == []
    other = tdcp.state_differences(tdcp.state_snapshot(ragged(1.0), "s"), tdcp.state_snapshot(ragged(2.0), "s"))
    assert [d.path for d in other] == ["s.tensordicts[1]['x']"], other
    nan, negative = float("nan"), -float("nan")
    assert math.copysign(1.0, negative) < 0
    assert tdcp.state_differences(tdcp.state_snapshot({"v": nan}, "c"), tdcp.state_snapshot({"v": negative}, "c"))


def test_a_container_of_another_type_is_a_difference() -> None:
    """A tuple restored as a list, a dict as a list of its keys, an object as another class: each is named (an empty
    container records nothing: its kind holds no state)."""

    class A:
        pass

    class B:
        pass

    saved = state_snapshot({"betas": (0.9, 0.99), "extra": {0: 1}, "obj": A(), "e": {}}, "s")
    restored = state_snapshot({"betas": [0.9, 0.99], "extra": [1], "obj": B(), "e": []}, "s")
    assert {d.path for d in state_differences(saved, restored)} == {"s['betas']", "s['extra']", "s['obj']"}
    same = state_snapshot({"betas": (0.9, 0.99), "extra": {0: 1}, "obj": A(), "e": {}}, "s")
    assert state_differences(saved, same) == []


def test_a_generators_state_is_audited() -> None:
    """Generators were recorded by type only: two ``PendulumEnv`` whose ``rng`` differ audited equal, so a restore
    leaving an env's generator behind passed the audit. Each kind's state is fingerprinted now."""
    import random

    from torchrl.envs import PendulumEnv

    def kinds(seed: int) -> dict:
        torch_gen = torch.Generator().manual_seed(seed)
        python = random.Random(seed)
        return {
            "torch": torch_gen,
            "numpy": np.random.default_rng(seed),
            "legacy": np.random.RandomState(seed),
            "python": python,
        }

    a, b = kinds(0), kinds(0)
    assert state_differences(state_snapshot(a), state_snapshot(b)) == []
    b["torch"].manual_seed(1)
    b["numpy"].random()
    b["legacy"].random_sample()
    b["python"].random()
    differ = state_differences(state_snapshot(a), state_snapshot(b))
    assert len({d.path for d in differ}) == 4, differ
    one, two = PendulumEnv(), PendulumEnv()
    one.set_seed(0)
    two.set_seed(1)
    assert any("rng" in d.path for d in state_differences(state_snapshot(one), state_snapshot(two)))


def test_the_audit_looks_inside_deques_byte_arrays_and_arrays() -> None:
    """Probe g4: a ``deque`` (torchrl's ``StreamingSliceSampler._queued_slices``, a buffer's prefetch queue), a
    ``bytearray`` or an ``array.array`` was fingerprinted by its type alone: a restore that lost their items passed
    the audit the conformance verdicts rely on."""
    import array
    import collections

    def holder(queue: list[int], raw: bytes, numbers: list[float], maxlen: int | None = None) -> dict[str, Any]:
        return {
            "q": collections.deque(queue, maxlen=maxlen),
            "b": bytearray(raw),
            "a": array.array("d", numbers),
        }

    same = state_differences(state_snapshot(holder([1, 2], b"ab", [0.5])), state_snapshot(holder([1, 2], b"ab", [0.5])))
    assert same == []
    differ = state_differences(
        state_snapshot(holder([1, 2], b"ab", [0.5])), state_snapshot(holder([1, 3], b"ac", [0.25], maxlen=4))
    )
    assert {d.path for d in differ} == {"obj['q'].maxlen", "obj['q'][1]", "obj['b']", "obj['a']"}, differ
