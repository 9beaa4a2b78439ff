"""Conformance: torchrl's exploration modules, value estimators and target updaters, enumerated from its packages.

Each class with a recipe is built, used, annealed and saved, restored into one built with another seed, and used
again: its next outputs (under the same global RNG draws) and the state audit equal the one that never stopped.
The others say where they are covered or why no recipe exists; a class torchrl adds fails
:func:`test_every_learner_class_of_torchrl_is_covered_or_said_why` until it gets one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, OneHot

import torchrl_dcp as tdcp
from torchrl_dcp.audit import state_differences, state_snapshot


def _td(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"observation": torch.randn(4, 3, generator=g), "action": torch.rand(4, 2, generator=g)}, [4])


def _egreedy(seed: int) -> dict[str, Any]:
    from torchrl.modules import EGreedyModule

    torch.manual_seed(seed)
    return {"module": EGreedyModule(OneHot(2), eps_init=0.9, eps_end=0.1, annealing_num_steps=10)}


def _gaussian(seed: int) -> dict[str, Any]:
    from torchrl.modules import AdditiveGaussianModule

    torch.manual_seed(seed)
    return {
        "module": AdditiveGaussianModule(Bounded(-1, 1, (2,)), sigma_init=1.0, sigma_end=0.1, annealing_num_steps=10)
    }


def _noisy(seed: int) -> dict[str, Any]:
    from torchrl.modules import NoisyLinear

    torch.manual_seed(seed)
    return {"module": NoisyLinear(3, 2)}


def _use_exploration(objs: dict[str, Any], i: int) -> torch.Tensor:
    module, td = objs["module"], _td(i)
    if type(module).__name__ == "EGreedyModule":
        td["action"] = torch.nn.functional.one_hot(torch.randint(2, (4,)), 2).bool()
    out = module(td)["action"].clone()
    module.step()
    return out


def _use_noisy(objs: dict[str, Any], i: int) -> torch.Tensor:
    out = objs["module"](_td(i)["observation"]).detach().clone()
    objs["module"].reset_noise()
    return out


def _updater(kind: str) -> Callable[[int], Any]:
    def build(seed: int) -> dict[str, Any]:
        from torchrl.modules import MLP, QValueActor
        from torchrl.objectives import DQNLoss, HardUpdate, SoftUpdate

        torch.manual_seed(seed)
        actor = QValueActor(MLP(in_features=3, out_features=2, num_cells=[8]), in_keys=["observation"], spec=OneHot(2))
        loss = DQNLoss(actor, action_space="one-hot", delay_value=True)
        loss.make_value_estimator(gamma=0.9)  # (else made by the first forward: built alike before a load)
        updater = (
            SoftUpdate(loss, eps=0.9) if kind == "SoftUpdate" else HardUpdate(loss, value_network_update_interval=3)
        )
        return {"loss": loss, "updater": updater, "optimizer": torch.optim.SGD(loss.parameters(), lr=0.1)}

    return build


def _use_learner(learner: dict[str, Any], i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    td = TensorDict(
        {
            "observation": torch.randn(4, 3, generator=g),
            "action": torch.nn.functional.one_hot(torch.randint(2, (4,), generator=g), 2),
            "next": {
                "observation": torch.randn(4, 3, generator=g),
                "reward": torch.randn(4, 1, generator=g),
                "done": torch.zeros(4, 1, dtype=torch.bool),
                "terminated": torch.zeros(4, 1, dtype=torch.bool),
            },
        },
        [4],
    )
    loss = learner["loss"](td)["loss"]
    learner["optimizer"].zero_grad()
    loss.backward()
    learner["optimizer"].step()
    learner["updater"].step()
    return torch.cat([p.detach().flatten() for p in learner["loss"].target_value_network_params.values(True, True)])


#: class -> (build(seed) -> the components to register, use(components, i) -> an output to compare)
RECIPES: dict[str, tuple[Callable[[int], dict[str, Any]], Callable[[Any, int], torch.Tensor]]] = {
    "EGreedyModule": (_egreedy, _use_exploration),
    "AdditiveGaussianModule": (_gaussian, _use_exploration),
    "NoisyLinear": (_noisy, _use_noisy),
    "SoftUpdate": (_updater("SoftUpdate"), _use_learner),
    "HardUpdate": (_updater("HardUpdate"), _use_learner),
}
#: the others, and where they are covered or why not
NO_RECIPE = {
    "EGreedyWrapper": "a deprecated wrapper of EGreedyModule (the module's recipe covers its state)",
    "AdditiveGaussianWrapper": "a deprecated wrapper of AdditiveGaussianModule (see its recipe)",
    "OrnsteinUhlenbeckProcessWrapper": "a deprecated wrapper of OrnsteinUhlenbeckProcessModule",
    "OrnsteinUhlenbeckProcessModule": "its noise lives in the tensordict it writes (`_ou_prev_noise`, `_ou_steps`), "
    "which the collector's carrier holds: covered under a Collector, annealed mid-run (tests/test_collector.py::"
    "test_a_collectors_exploration_noise_resumes_mid_trajectory_with_its_annealing); registered alone, "
    "register that tensordict too",
    "ConsistentDropout": "its mask lives in the tensordict it reads, not in the module",
    "ConsistentDropoutModule": "its mask lives in the tensordict under a key naming the instance's id by default: "
    "give it a mask key of your own so a fresh module in another process reads it",
    "gSDEModule": "exploration noise for `gSDENoise`: its state is the transform's, covered by the transforms matrix",
    "LazygSDEModule": "the lazy form of gSDEModule (see it)",
    "NoisyLazyLinear": "exact once initialized (as NoisyLinear); a fresh uninitialized one keeps in_features=0 after "
    "a load, as with torchrl's own load_state_dict: run one forward before loading",
    "GAE": "tests/test_value_estimators.py: exact registered with its value network; warned registered without it",
    "TD0Estimator": "tests/test_value_estimators.py (as GAE)",
    "TD1Estimator": "tests/test_value_estimators.py (as GAE)",
    "TDLambdaEstimator": "tests/test_value_estimators.py (as GAE)",
    "TD0Estimate": "an alias of TD0Estimator",
    "TD1Estimate": "an alias of TD1Estimator",
    "TDLambdaEstimate": "an alias of TDLambdaEstimator",
    "VTrace": "keeps its value and actor networks as plain attributes, as GAE: warned when registered without them "
    "(the same check); no recipe of its own (it needs an actor's log-probabilities)",
    "MultiAgentGAE": "GAE over agents: the same plain-attribute network (warned without it); no multi-agent recipe",
    "ValueEstimatorBase": "the base class",
    "TargetNetUpdater": "the base class",
}


def learner_classes() -> list[str]:
    """torchrl's exploration modules, value estimators and target updaters, by class name."""
    import torchrl.modules.models.exploration as noisy
    import torchrl.modules.tensordict_module.exploration as exploration
    import torchrl.objectives.utils as updaters
    import torchrl.objectives.value as estimators

    found = {n for n in exploration.__all__ if inspect.isclass(getattr(exploration, n))}
    found |= {n for n, c in vars(noisy).items() if inspect.isclass(c) and c.__module__ == noisy.__name__}
    found |= {
        n for n, c in vars(estimators).items() if inspect.isclass(c) and issubclass(c, estimators.ValueEstimatorBase)
    }
    found |= {n for n, c in vars(updaters).items() if inspect.isclass(c) and issubclass(c, updaters.TargetNetUpdater)}
    return sorted(found)


def test_every_learner_class_of_torchrl_is_covered_or_said_why() -> None:
    found = set(learner_classes())
    assert {"EGreedyModule", "GAE", "SoftUpdate", "NoisyLinear"} <= found
    assert found <= set(RECIPES) | set(NO_RECIPE), f"new in torchrl: {found - set(RECIPES) - set(NO_RECIPE)}"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_learner_class_resumes_exactly(tmp_path: Path, name: str) -> None:
    build, use = RECIPES[name]
    objs = build(0)
    for i in range(3):
        use(objs, i)
    saved = state_snapshot(objs, "objs")
    ckpt = tdcp.DistributedCheckpoint(**objs)
    ckpt.register("rng", tdcp.RNGState())
    path = ckpt.save(tmp_path / "c")
    expected = [use(objs, i) for i in range(3, 6)]
    fresh = build(1)
    restore = tdcp.DistributedCheckpoint(**fresh)
    restore.register("rng", tdcp.RNGState())
    restore.load(path)
    assert state_differences(saved, state_snapshot(fresh, "objs")) == []
    got = [use(fresh, i) for i in range(3, 6)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
