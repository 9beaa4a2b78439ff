"""A registered dict, list or TensorDict receives the saved bytes in its own tensors, as ``dcp.load`` fills a state
dict: ``{"model": model.state_dict(), "optim": optim.state_dict()}`` restores the model and the optimizer,
``TensorDict.from_module(policy)`` the policy, and parameters stay parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import torchrl_dcp as tdcp


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        optim.zero_grad()
        model(x).pow(2).mean().backward()
        optim.step()


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_dict_of_state_dicts_restores_the_model_and_the_optimizer_exactly(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, optim, 3, seed=0)
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3}
    ck = tdcp.DistributedCheckpoint(no_dist=True, app=state)
    path = ck.save(tmp_path / "c")
    _train(model, optim, 2, seed=1)
    reference = _weights(model)  # training that never stopped
    _train(model, optim, 4, seed=2)  # training goes on, then the job resumes
    state["epoch"] = 9
    ck.load(path)
    optim.load_state_dict(state["optim"])  # param groups are a copy (as after dcp.load)
    assert state["epoch"] == 3
    _train(model, optim, 2, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(reference, _weights(model)))


def test_a_fresh_process_restores_the_model_in_place_whatever_else_differs(tmp_path: Path) -> None:
    """Another dict shape elsewhere (a fresh optimizer has no state yet; a key added) leaves the model's tensors
    paired: they are filled where they are, the rest replaced."""
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters())
    _train(model, optim, 2, seed=0)
    path = tdcp.DistributedCheckpoint(
        no_dist=True, app={"model": model.state_dict(), "optim": optim.state_dict()}
    ).save(tmp_path / "c")
    fresh = torch.nn.Linear(4, 2)
    fresh_optim = torch.optim.Adam(fresh.parameters())
    state = {"model": fresh.state_dict(), "optim": fresh_optim.state_dict(), "new": 1}
    tdcp.DistributedCheckpoint(no_dist=True, app=state).load(path)
    fresh_optim.load_state_dict(state["optim"])
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(fresh)))
    assert state["model"]["weight"].data_ptr() == fresh.weight.data_ptr() and "new" not in state
    _train(model, optim, 1, seed=3)
    _train(fresh, fresh_optim, 1, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(fresh)))


def test_parameters_in_a_dict_stay_the_same_parameters(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    state = {"p": p, "nested": [p.detach().clone()], "grown": torch.zeros(2)}
    path = tdcp.DistributedCheckpoint(no_dist=True, app=state).save(tmp_path / "c")
    saved = p.detach().clone()
    with torch.no_grad():
        p.add_(1)
    state["grown"] = torch.zeros(5)  # another shape: a fresh tensor of the saved one takes its place
    tdcp.DistributedCheckpoint(no_dist=True, app=state).load(path)
    assert state["p"] is p and type(p) is torch.nn.Parameter and p.requires_grad
    assert torch.equal(p.detach(), saved) and torch.equal(state["nested"][0], saved)
    assert state["grown"].shape == (2,)


@pytest.mark.parametrize("locked", [False, True])
def test_a_tensordict_from_module_restores_the_module(tmp_path: Path, locked: bool) -> None:
    model = torch.nn.Linear(3, 2)
    params = TensorDict.from_module(model)
    params["frames"] = torch.tensor(100)  # an entry the live one lacks: the others still filled where they are
    path = tdcp.DistributedCheckpoint(no_dist=True, params=params).save(tmp_path / "c")
    saved = _weights(model)
    fresh = torch.nn.Linear(3, 2)
    live = TensorDict.from_module(fresh)
    if locked:
        live["frames"] = torch.tensor(0)
        live.lock_()
    tdcp.DistributedCheckpoint(no_dist=True, params=live).load(path)
    assert all(torch.equal(a, b) for a, b in zip(saved, _weights(fresh)))
    assert type(live["weight"]) is torch.nn.Parameter and live["weight"] is fresh.weight
    assert live["frames"].item() == 100


@pytest.mark.parametrize("locked", [False, True])
def test_a_damaged_file_leaves_the_registered_tensors_as_they_were(tmp_path: Path, locked: bool) -> None:
    td = TensorDict({"obs": torch.randn(4, 3)}, [4])
    state = {"w": torch.randn(5)}
    path = tdcp.DistributedCheckpoint(no_dist=True, td=td, app=state).save(tmp_path / "c")
    data = next(p for p in Path(path).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    if locked:
        td.lock_()
    obs, w = td["obs"].clone(), state["w"].clone()
    with pytest.raises(tdcp.CheckpointIntegrityError):
        tdcp.DistributedCheckpoint(no_dist=True, td=td, app=state).load(path)
    assert torch.equal(td["obs"], obs) and torch.equal(state["w"], w)


def test_two_components_sharing_memory_saved_apart_are_refused_before_anything_changes(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(no_dist=True, a={"x": torch.ones(4)}, b={"y": torch.full((4,), 2.0)}).save(
        tmp_path / "c"
    )
    live = torch.zeros(4)
    a, b = {"x": live}, {"y": live}  # one tensor now
    with pytest.raises(tdcp.IncompatibleComponentError, match="components 'a' and 'b' share memory now"):
        tdcp.DistributedCheckpoint(no_dist=True, a=a, b=b).load(path)
    assert torch.equal(live, torch.zeros(4))
    model = torch.nn.Linear(2, 2)  # a TensorDict of a module's parameters beside the module: saved apart, refused
    path = tdcp.DistributedCheckpoint(
        no_dist=True, policy=model, td=TensorDict.from_module(torch.nn.Linear(2, 2))
    ).save(tmp_path / "d")
    with pytest.raises(tdcp.IncompatibleComponentError, match="share memory now"):
        tdcp.DistributedCheckpoint(no_dist=True, policy=model, td=TensorDict.from_module(model)).load(path)
    per_rank = tdcp.DistributedCheckpoint(no_dist=True)  # saved sharing stored twice (per rank: no xref), equal bytes
    per_rank.register("policy", model, placement="per_rank")
    per_rank.register("td", TensorDict.from_module(model), placement="per_rank")
    path = per_rank.save(tmp_path / "f")
    fresh = torch.nn.Linear(2, 2)
    again = tdcp.DistributedCheckpoint(no_dist=True)
    again.register("policy", fresh, placement="per_rank")
    again.register("td", TensorDict.from_module(fresh), placement="per_rank")
    again.load(path)
    assert torch.equal(fresh.weight, model.weight)
    flat = {"w": model.weight.detach().view(-1)}  # another view of the module's weight, saved beside it: loads
    path = tdcp.DistributedCheckpoint(no_dist=True, policy=model, flat=flat).save(tmp_path / "g")
    tdcp.DistributedCheckpoint(no_dist=True, policy=model, flat=flat).load(path)
    shared = {"w": model.weight}  # saved sharing (stored once): loads, and keeps sharing
    path = tdcp.DistributedCheckpoint(no_dist=True, policy=model, d=shared).save(tmp_path / "e")
    tdcp.DistributedCheckpoint(no_dist=True, policy=model, d=shared).load(path)
    assert shared["w"] is model.weight


def test_a_tensor_read_in_place_is_seen_modified_by_autograd(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.ones(3))
    state = {"w": w}
    path = tdcp.DistributedCheckpoint(no_dist=True, app=state).save(tmp_path / "c")
    loss = (w * w).sum()  # the graph saved w for backward
    tdcp.DistributedCheckpoint(no_dist=True, app=state).load(path)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_models_state_dict_in_a_dict_is_restored_when_its_tensors_are_transposed_or_channels_last(
    tmp_path: Path,
) -> None:
    """``{"model": model.state_dict()}`` (as ``dcp.load`` fills one) of a channels-last convolution or a transposed
    weight: its tensors were not contiguous, so the load replaced them in the dict with fresh ones and the model kept
    its old weights, silently. A tensor laid out densely in any order is read where it is."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 5)).to(memory_format=torch.channels_last)
    model[1].weight.data = model[1].weight.data.t().contiguous().t()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    path = tdcp.DistributedCheckpoint(s={"model": model.state_dict()}).save(tmp_path / "c")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model.state_dict()}
    tdcp.DistributedCheckpoint(s=state).load(path)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]) and value.stride() == saved[key].stride(), key
        assert state["model"][key].data_ptr() == value.data_ptr(), key


def test_weights_tied_now_but_saved_apart_are_refused_before_anything_changes(tmp_path: Path) -> None:
    """A module saved with two independent weights, loaded into one whose weights are tied: both saved tensors were
    read into the one memory, the last read winning, and the load reported success. Refused, as the same sharing
    across two components is; weights tied when saved load as before."""

    def pair() -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))

    path = tdcp.DistributedCheckpoint(no_dist=True, m=pair()).save(tmp_path / "apart")
    tied = pair()
    tied[1].weight = tied[0].weight
    before = tied[0].weight.detach().clone()
    with pytest.raises(tdcp.IncompatibleComponentError, match="component 'm' holds tensors that share memory now"):
        tdcp.DistributedCheckpoint(no_dist=True, m=tied).load(path)
    assert torch.equal(tied[0].weight, before)
    path = tdcp.DistributedCheckpoint(no_dist=True, m=tied).save(tmp_path / "tied")
    again = pair()
    again[1].weight = again[0].weight
    tdcp.DistributedCheckpoint(no_dist=True, m=again).load(path)
    assert torch.equal(again[0].weight, before) and again[0].weight is again[1].weight

    def viewed() -> torch.nn.Module:  # one memory under two layouts, saved so: loads (it was refused for a while)
        m = torch.nn.Module()
        w = torch.arange(6.0).reshape(2, 3)
        m.register_buffer("w", w)
        m.register_buffer("wt", w.t())
        return m

    src = viewed()
    src.w.mul_(10)
    path = tdcp.DistributedCheckpoint(no_dist=True, m=src).save(tmp_path / "views")
    dst = viewed()
    tdcp.DistributedCheckpoint(no_dist=True, m=dst).load(path)
    assert torch.equal(dst.w, src.w) and torch.equal(dst.wt, src.wt)


@pytest.mark.parametrize("kind", ["inference", "expanded"])
def test_a_locked_tensordict_entry_no_load_can_write_is_refused_before_anything_changes(
    tmp_path: Path, kind: str
) -> None:
    """A locked TensorDict holding an inference tensor or an expanded view: planning accepted it, the load read the
    other entries and components in place, then update_ failed on it ("could not roll back"). Refused while
    planning, saying what to do; nothing changes."""
    if kind == "inference":
        with torch.inference_mode():
            odd = torch.randn(4)
    else:
        odd = torch.arange(3.0).expand(4, 3)
    td = TensorDict(a=torch.randn(4), odd=odd, batch_size=[4]).lock_()
    module = torch.nn.Linear(3, 3)
    path = tdcp.DistributedCheckpoint(no_dist=True, m=module, td=td).save(tmp_path / "c")
    td["a"].add_(1)
    with torch.no_grad():
        module.weight.add_(1)
    a, w = td["a"].clone(), module.weight.detach().clone()
    with pytest.raises(tdcp.CheckpointError, match="which no load can write into"):
        tdcp.DistributedCheckpoint(no_dist=True, m=module, td=td).load(path)
    assert torch.equal(td["a"], a) and torch.equal(module.weight, w)


def test_a_bare_inference_tensor_loads_and_an_expanded_one_is_refused_at_save(tmp_path: Path) -> None:
    """A bare tensor component made under inference mode saved, but every load failed with torch's raw error
    ("Inplace update to inference tensor"); an expanded one saved and could never be loaded back."""
    with torch.inference_mode():
        t = torch.randn(4)
    saved = t.clone()
    path = tdcp.DistributedCheckpoint(no_dist=True, t=t).save(tmp_path / "t")
    with torch.inference_mode():
        t.add_(1)
    tdcp.DistributedCheckpoint(no_dist=True, t=t).load(path)
    assert torch.equal(t, saved)
    with pytest.raises(tdcp.IncompatibleComponentError, match="is an expanded view .* could never be loaded back"):
        tdcp.DistributedCheckpoint(no_dist=True, e=torch.arange(3.0).expand(4, 3)).save(tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_tied_weights_in_two_layouts_across_components_saved_tied_load(tmp_path: Path) -> None:
    """An encoder's weight and a decoder's ``weight.t()`` (one memory, two layouts, two components), saved while
    tied: the records differ (one is the transpose), which the check read as saved apart and refused. The saved
    values are compared instead: they agree on every byte, so the load goes on, exactly."""

    def tied(seed: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
        torch.manual_seed(seed)
        enc, dec = torch.nn.Linear(3, 5, bias=False), torch.nn.Linear(5, 3, bias=False)
        dec.weight = torch.nn.Parameter(enc.weight.data.t())
        return enc, dec

    enc, dec = tied(0)
    tdcp.DistributedCheckpoint(enc=enc, dec=dec).save(tmp_path / "c")
    enc2, dec2 = tied(1)
    tdcp.DistributedCheckpoint(enc=enc2, dec=dec2).load(tmp_path / "c")
    assert torch.equal(enc2.weight, enc.weight) and torch.equal(dec2.weight, dec.weight)
    assert dec2.weight.data_ptr() == enc2.weight.data_ptr()  # (still tied)


@pytest.mark.parametrize("holder", ["dict", "from_module"])
@pytest.mark.parametrize("saved_first", ["model", "params"])
@pytest.mark.parametrize("loaded_first", ["model", "params"])
def test_a_tie_across_components_is_restored_in_any_registration_order(
    tmp_path: Path, holder: str, saved_first: str, loaded_first: str
) -> None:
    """A dict (or ``TensorDict.from_module``) holding a module's weight, stored once with the module: the tie came
    back only when the load registered the components in the save's order; otherwise the dict held a copy, and
    training after the resume went another way than training that never stopped. Any order now, exactly."""

    def build() -> tuple[torch.nn.Linear, object, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        params = {"weight": model.weight} if holder == "dict" else TensorDict.from_module(model)
        return model, params, torch.optim.SGD(model.parameters(), lr=0.1)

    def ckpt(first: str, model, params, optim) -> tdcp.DistributedCheckpoint:
        objs = {"model": model, "params": params}
        out = tdcp.DistributedCheckpoint()
        for name in (first, *(n for n in objs if n != first)):
            out.register(name, objs[name])
        out.register("optim", optim)
        return out

    model, params, optim = build()
    _train(model, optim, 1, 0)
    path = ckpt(saved_first, model, params, optim).save(tmp_path / "c")
    _train(model, optim, 1, 1)  # the run that never stopped
    model2, params2, optim2 = build()
    with torch.no_grad():
        model2.weight.mul_(-2)  # (other values)
    ckpt(loaded_first, model2, params2, optim2).load(path)
    assert params2["weight"].data_ptr() == model2.weight.data_ptr()
    _train(model2, optim2, 1, 1)
    assert torch.equal(params2["weight"], params["weight"]) and torch.equal(model2.weight, model.weight)


def test_a_live_tensor_overlapping_part_of_another_saved_apart_is_refused(tmp_path: Path) -> None:
    """A dict holding a row of a module's weight now (``m.weight.data[1]``), saved from a module and a dict of its
    own: the two reads overlap without starting at one address, which the check never compared; the last read won,
    silently. Refused before anything changes."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    tdcp.DistributedCheckpoint(m=m, stats={"row": torch.full((4,), 7.0)}).save(tmp_path / "c")
    m2 = torch.nn.Linear(4, 3)
    before = m2.weight.detach().clone()
    with pytest.raises(tdcp.IncompatibleComponentError, match="share memory now"):
        tdcp.DistributedCheckpoint(m=m2, stats={"row": m2.weight.data[1]}).load(tmp_path / "c")
    assert torch.equal(m2.weight, before)
    consistent = {"row": m.weight.data[1].clone()}  # (saved apart, but the same bytes: both reads agree)
    tdcp.DistributedCheckpoint(m=m, stats=consistent).save(tmp_path / "same")
    m3 = torch.nn.Linear(4, 3)
    tdcp.DistributedCheckpoint(m=m3, stats={"row": m3.weight.data[1]}).load(tmp_path / "same")
    assert torch.equal(m3.weight, m.weight)


def test_overlapping_tensors_holding_a_nan_compare_by_bytes(tmp_path: Path) -> None:
    """The overlap check compared the saved values with ``torch.equal``, which holds a NaN unequal to itself: a row
    holding a NaN, saved apart with the same bytes as the matrix's row, was refused."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    with torch.no_grad():
        m.weight[1, 2] = float("nan")
    tdcp.DistributedCheckpoint(m=m, stats={"row": m.weight.data[1].clone()}).save(tmp_path / "c")
    m2 = torch.nn.Linear(4, 3)
    tdcp.DistributedCheckpoint(m=m2, stats={"row": m2.weight.data[1]}).load(tmp_path / "c")
    assert torch.equal(m2.weight.isnan(), m.weight.isnan()) and torch.equal(
        m2.weight.nan_to_num(), m.weight.nan_to_num()
    )
