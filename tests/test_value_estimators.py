"""torchrl's value estimators keep their network as a plain attribute (``GAE.value_network``): registered alone,
their ``state_dict()`` holds ``gamma`` and ``lmbda`` only. Such a save is named by an ``InexactResumeWarning``;
registered with the network, the estimator resumes exactly."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.objectives.value import GAE, TD0Estimator, TD1Estimator, TDLambdaEstimator

import torchrl_dcp as tdcp

ESTIMATORS = {
    "GAE": lambda net: GAE(gamma=0.9, lmbda=0.8, value_network=net),
    "TD0Estimator": lambda net: TD0Estimator(gamma=0.9, value_network=net),
    "TD1Estimator": lambda net: TD1Estimator(gamma=0.9, value_network=net),
    "TDLambdaEstimator": lambda net: TDLambdaEstimator(gamma=0.9, lmbda=0.8, value_network=net),
}


def _built(kind: str, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    net = TensorDictModule(torch.nn.Linear(3, 1), ["observation"], ["state_value"])
    return ESTIMATORS[kind](net), net


def _advantage(estimator: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(7)
    td = TensorDict(
        {
            "observation": torch.randn(1, 5, 3),
            "next": {
                "observation": torch.randn(1, 5, 3),
                "reward": torch.randn(1, 5, 1),
                "done": torch.zeros(1, 5, 1, dtype=torch.bool),
                "terminated": torch.zeros(1, 5, 1, dtype=torch.bool),
            },
        },
        [1, 5],
    )
    with torch.no_grad():
        return estimator(td)["advantage"]


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_an_estimator_registered_without_its_network_is_named(tmp_path: Path, kind: str) -> None:
    """The load said ``loaded={'est'}`` and left the fresh network's weights: other advantages, no word."""
    estimator, _ = _built(kind, 0)
    with pytest.warns(tdcp.InexactResumeWarning, match=r"'est' \(saving\): value_network \(TensorDictModule\) is held"):
        path = tdcp.DistributedCheckpoint(est=estimator).save(tmp_path / "alone")
    with pytest.warns(
        tdcp.InexactResumeWarning, match=r"'est' \(loading\): value_network \(TensorDictModule\) is held"
    ):
        tdcp.DistributedCheckpoint(est=_built(kind, 1)[0]).load(path)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_an_estimator_registered_with_its_network_resumes_exactly(tmp_path: Path, kind: str) -> None:
    estimator, net = _built(kind, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        path = tdcp.DistributedCheckpoint(est=estimator, critic=net).save(tmp_path / "both")
    fresh, fresh_net = _built(kind, 1)
    assert not torch.equal(_advantage(fresh), _advantage(estimator))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        tdcp.DistributedCheckpoint(est=fresh, critic=fresh_net).load(path)
    assert torch.equal(_advantage(fresh), _advantage(estimator))
