"""A load is exact or a clear error: objects on the meta device (no memory) and modules of another dtype are refused
while the load is planned, naming the component and tensor, and leave every object as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import torchrl_dcp as tdcp


def _saved(tmp_path: Path, **objects) -> Path:
    torch.manual_seed(0)
    return tdcp.DistributedCheckpoint(**objects).save(tmp_path / "ck", step=1)


@pytest.mark.parametrize(
    "meta",
    [
        lambda: torch.nn.Linear(3, 2, device="meta"),
        lambda: torch.empty(6, device="meta"),
        lambda: TensorDict({"a": torch.empty(3, device="meta")}, [3], device="meta"),
        lambda: TensorDict({"a": torch.empty(3, device="meta")}, [3]).lock_(),
        lambda: TensorDict({"n": TensorDict({"a": torch.empty(3, device="meta")}, [3], device="meta")}, [3]),
    ],
    ids=["module", "tensor", "tensordict", "locked-tensordict", "nested-tensordict"],
)
def test_load_into_meta_objects_is_refused_naming_the_component(tmp_path: Path, meta) -> None:
    """Such a load claimed success (``result.loaded``) and restored nothing: the object still held meta tensors."""
    obj = meta()
    if isinstance(obj, torch.nn.Module):
        saved = torch.nn.Linear(3, 2)
    elif isinstance(obj, torch.Tensor):
        saved = torch.arange(6.0)
    elif "n" in obj.keys():
        saved = TensorDict({"n": TensorDict({"a": torch.arange(3.0)}, [3])}, [3])
    else:
        saved = TensorDict({"a": torch.arange(3.0)}, [3])
    path = _saved(tmp_path, x=saved)
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"(?s)'x'.*meta device.*(before loading|materialise)"):
        tdcp.DistributedCheckpoint(x=obj).load(path)
    result = tdcp.DistributedCheckpoint(x=obj).load(path, strict="ignore")
    assert "x" not in result.loaded and "x" in result.incompatible


def test_meta_module_refusal_names_the_tensor_and_to_empty(tmp_path: Path) -> None:
    path = _saved(tmp_path, policy=torch.nn.Linear(3, 2))
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"'policy'.*'(weight|bias)'.*to_empty\(device="):
        tdcp.DistributedCheckpoint(policy=meta).load(path)
    meta.to_empty(device="cpu")  # what the message says to do: then the load restores exactly
    tdcp.DistributedCheckpoint(policy=meta).load(path)
    torch.manual_seed(0)
    assert torch.equal(meta.weight, torch.nn.Linear(3, 2).weight)


def test_meta_refusal_leaves_the_other_components_unchanged(tmp_path: Path) -> None:
    """The refusal comes while planning: a component planned before it is not touched."""
    path = _saved(tmp_path, a=torch.arange(4.0), b=torch.nn.Linear(2, 2))
    a = torch.zeros(4)
    with pytest.raises(tdcp.IncompatibleComponentError, match="meta device"):
        tdcp.DistributedCheckpoint(a=a, b=torch.nn.Linear(2, 2, device="meta")).load(path)
    assert torch.equal(a, torch.zeros(4))


def test_bare_tensor_is_read_in_place(tmp_path: Path) -> None:
    """The registered tensor receives the saved bytes where it is (every reference to it sees them)."""
    path = _saved(tmp_path, t=torch.arange(6.0))
    t = torch.zeros(6)
    view = t[2:]
    tdcp.DistributedCheckpoint(t=t).load(path)
    assert torch.equal(t, torch.arange(6.0)) and torch.equal(view, torch.arange(2.0, 6.0))
    odd = torch.zeros(2, 6).t()[:, 0]  # not contiguous: copied into
    odd_path = _saved(tmp_path / "odd", t=torch.arange(6.0))
    tdcp.DistributedCheckpoint(t=odd).load(odd_path)
    assert torch.equal(odd, torch.arange(6.0))


def test_module_of_another_dtype_is_refused_not_cast(tmp_path: Path) -> None:
    """A float32 checkpoint loaded silently into a float16 module (1 + 2**-20 became 1.0)."""
    src = torch.nn.Linear(3, 2)
    with torch.no_grad():
        src.weight[0, 0] = 1.0 + 2**-20
    path = tdcp.DistributedCheckpoint(policy=src).save(tmp_path / "ck", step=1)
    half = torch.nn.Linear(3, 2).half()
    before = {k: v.clone() for k, v in half.state_dict().items()}
    with pytest.raises(
        tdcp.IncompatibleComponentError,
        match=r"'policy'.*'(weight|bias)' is torch.float32 in the checkpoint, torch.float16 in the module.*then cast",
    ):
        tdcp.DistributedCheckpoint(policy=half).load(path)
    assert all(torch.equal(v, half.state_dict()[k]) for k, v in before.items())
    same = torch.nn.Linear(3, 2)  # the saved dtype: exact
    tdcp.DistributedCheckpoint(policy=same).load(path)
    assert torch.equal(same.weight, src.weight)


def test_module_buffer_of_another_dtype_is_refused(tmp_path: Path) -> None:
    """Buffers too: BatchNorm's float running mean into a module whose running mean is double."""
    path = _saved(tmp_path, norm=torch.nn.BatchNorm1d(4))
    norm = torch.nn.BatchNorm1d(4)
    norm.running_mean = norm.running_mean.double()  # (still the buffer)
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"'running_mean' is torch.float32.*torch.float64"):
        tdcp.DistributedCheckpoint(norm=norm).load(path)
    assert torch.equal(norm.running_mean, torch.zeros(4, dtype=torch.float64))


def test_bf16_module_round_trip_stays_exact(tmp_path: Path) -> None:
    src = torch.nn.Linear(4, 3).to(torch.bfloat16)
    path = tdcp.DistributedCheckpoint(m=src).save(tmp_path / "ck")
    dst = torch.nn.Linear(4, 3).to(torch.bfloat16)
    tdcp.DistributedCheckpoint(m=dst).load(path)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))


def test_optimizer_over_meta_parameters_is_refused(tmp_path: Path) -> None:
    """``load_state_dict`` moves the saved state onto the parameters' device: onto meta, nothing would be kept."""
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    path = _saved(tmp_path, optim=optim)
    meta = torch.optim.Adam(torch.nn.Linear(3, 2, device="meta").parameters())
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"'optim'.*meta device.*to_empty"):
        tdcp.DistributedCheckpoint(optim=meta).load(path)
    assert not meta.state
