"""``model_state`` (the module adapter's state dict) equals DCP's ``get_model_state_dict`` for every kind of module
a user brings: plain, nested, tied weights, non-persistent and ``None`` buffers, ``torch.compile`` and
activation-checkpoint wrappers (the wrappers take DCP's path, which strips their prefixes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchrl_dcp.adapters.modules import model_state


def _tied() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    return m


def _buffers() -> torch.nn.Module:
    m = torch.nn.BatchNorm1d(3)
    m.register_buffer("scratch", torch.zeros(2), persistent=False)
    m.register_buffer("absent", None)
    return m


def _checkpointed() -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)), torch.nn.ReLU())


def _compiled() -> torch.nn.Module:
    return torch.compile(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh()))


MODULES: dict[str, Callable[[], torch.nn.Module]] = {
    "linear": lambda: torch.nn.Linear(3, 2),
    "nested": lambda: torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Sequential(torch.nn.LayerNorm(4))),
    "tied weights": _tied,
    "buffers": _buffers,
    "frozen": lambda: torch.nn.Linear(2, 2).requires_grad_(False),
    "checkpoint wrapper": _checkpointed,
    "torch.compile": _compiled,
    "module list": lambda: torch.nn.ModuleList([torch.nn.Linear(1, 1) for _ in range(3)]),
}


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_model_state_equals_dcp_helper(kind: str) -> None:
    torch.manual_seed(0)
    m = MODULES[kind]()
    ours, theirs = model_state(m), get_model_state_dict(m)
    assert list(ours) == list(theirs)
    for key in theirs:
        assert type(ours[key]) is type(theirs[key])
        assert ours[key].data_ptr() == theirs[key].data_ptr() and ours[key].shape == theirs[key].shape


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_loaded_parameters_stay_trainable_leaves(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A load reads into the parameters themselves (not detached views of them): afterwards they are the same
    objects, leaves with their ``requires_grad``, hold the saved values, and a backward pass reaches them."""
    import torchrl_dcp as tdcp

    torch.manual_seed(0)
    saved = MODULES[kind]()
    path = tdcp.DistributedCheckpoint(m=saved).save(tmp_path / "c")
    torch.manual_seed(1)
    m = MODULES[kind]()
    before = {n: (p, p.requires_grad) for n, p in m.named_parameters()}
    tdcp.DistributedCheckpoint(m=m).load(path)
    for name, p in m.named_parameters():
        assert p is before[name][0] and p.is_leaf and p.requires_grad == before[name][1] and p.grad_fn is None
    for (k, a), b in zip(model_state(m).items(), model_state(saved).values()):
        assert torch.equal(a, b), k
    trainable = [p for p in m.parameters() if p.requires_grad]
    if trainable:
        sum(p.float().sum() for p in trainable).backward()
        assert all(p.grad is not None for p in trainable)


class _WithExtraState(torch.nn.Module):
    """A module whose ``get_extra_state`` returns a value that is no tensor (a dict holding one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.count, self.tag, self.table = 0, "a", torch.zeros(3)

    def get_extra_state(self) -> dict:
        return {"count": self.count, "tag": self.tag, "table": self.table}

    def set_extra_state(self, state: dict) -> None:
        self.count, self.tag, self.table = state["count"], state["tag"], state["table"].clone()


class _TensorExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = torch.zeros(2)

    def get_extra_state(self) -> torch.Tensor:
        return self.v

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.v = state.clone()


@pytest.mark.parametrize("kind", ["dict", "tensor", "nested"])
def test_extra_state_round_trips(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torchrl_dcp as tdcp

    def make() -> torch.nn.Module:
        if kind == "dict":
            return _WithExtraState()
        if kind == "tensor":
            return _TensorExtraState()
        return torch.nn.Sequential(_WithExtraState(), torch.nn.ReLU(), _TensorExtraState())

    m = make()
    for mod in m.modules():
        if isinstance(mod, _WithExtraState):
            mod.count, mod.tag, mod.table = 5, "z", torch.arange(3.0)
        elif isinstance(mod, _TensorExtraState):
            mod.v = torch.tensor([1.5, -2.0])
    path = tdcp.DistributedCheckpoint(m=m).save(tmp_path / "c")
    fresh = make()
    tdcp.DistributedCheckpoint(m=fresh).load(path)
    for a, b in zip(m.modules(), fresh.modules()):
        if isinstance(a, _WithExtraState):
            assert (b.count, b.tag) == (5, "z") and torch.equal(b.table, a.table)
            assert torch.equal(b.lin.weight, a.lin.weight)
        elif isinstance(a, _TensorExtraState):
            assert torch.equal(b.v, a.v)


def test_a_lazy_module_loads_before_its_first_forward_and_trains_on_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torchrl's ``MLP`` without ``in_features`` builds ``LazyLinear`` layers: a policy rebuilt for a resume loads
    before its first forward (the load gives it the saved shapes), and training continues bit for bit."""
    from torchrl.modules import MLP

    import torchrl_dcp as tdcp

    torch.manual_seed(0)
    x = torch.randn(4, 3)
    policy = MLP(out_features=2, num_cells=[8, 8])
    policy(x)
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)

    def step(p: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        p(x).pow(2).sum().backward()
        o.step()

    step(policy, optim)
    path = tdcp.DistributedCheckpoint(policy=policy, optim=optim).save(tmp_path / "c")
    step(policy, optim)
    fresh = MLP(out_features=2, num_cells=[8, 8])
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert any(torch.nn.parameter.is_lazy(p) for p in fresh.parameters())
    tdcp.DistributedCheckpoint(policy=fresh, optim=fresh_optim).load(path)
    step(fresh, fresh_optim)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), fresh.parameters()))


def test_saving_a_lazy_module_before_its_first_forward_says_what_to_do(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from torchrl.modules import MLP

    import torchrl_dcp as tdcp

    with pytest.raises(tdcp.CheckpointError, match="not initialised yet.*run one forward pass"):
        tdcp.DistributedCheckpoint(policy=MLP(out_features=2, num_cells=[8])).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("backend", ["directory", "archive"])
def test_td3_loss_with_one_element_stride_0_buffers_saves_and_loads_exactly(tmp_path, backend: str) -> None:  # type: ignore[no-untyped-def]
    """TD3Loss keeps its action bounds as ``torch.tensor(x).expand(1)`` (stride 0, one element: ``is_contiguous()``
    says yes, ``view(torch.uint8)`` refuses); the loss saves, verifies, converts and loads into a fresh one (whose
    bounds are stride 0 too) exactly, its parameters and target parameters included."""
    from torchrl.data import Bounded
    from torchrl.modules import MLP, Actor, ValueOperator
    from torchrl.objectives import TD3Loss

    import torchrl_dcp as tdcp

    def make(seed: int, low: float) -> TD3Loss:
        torch.manual_seed(seed)
        spec = Bounded(low, 1.0, shape=(1,))
        actor = Actor(MLP(in_features=3, out_features=1, num_cells=[8]), in_keys=["observation"], spec=spec)
        q = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[8]), in_keys=["observation", "action"])
        return TD3Loss(actor, q, action_spec=spec)

    saved = make(0, -1.0)
    assert saved.min_action.stride() == (0,)
    path = tdcp.DistributedCheckpoint(loss=saved).save(tmp_path / "c")
    tdcp.verify(path)
    where = tdcp.to_archive(path, tmp_path / "c.zip") if backend == "archive" else path
    fresh = make(1, -0.5)
    tdcp.DistributedCheckpoint(loss=fresh).load(where)
    for (k, a), (_, b) in zip(saved.state_dict().items(), fresh.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), k


class _Expanded(torch.nn.Module):
    def __init__(self, expanded: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 3)
        self.register_buffer("grid", torch.randn(3).expand(4, 3) if expanded else torch.randn(4, 3))


def test_an_expanded_buffer_is_refused_at_save_and_at_load_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torchrl_dcp as tdcp

    with pytest.raises(tdcp.EncodingError, match="'grid' is an expanded view"):
        tdcp.DistributedCheckpoint(no_dist=True, policy=_Expanded(True)).save(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    path = tdcp.DistributedCheckpoint(no_dist=True, policy=_Expanded(False)).save(tmp_path / "b")
    live = _Expanded(True)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(tdcp.IncompatibleComponentError, match="'grid' is an expanded view"):
        tdcp.DistributedCheckpoint(no_dist=True, policy=live).load(path)
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())  # nothing copied


class _LazyBuffers(torch.nn.Module):
    """Buffers set at the first forward: one in a slot registered as ``None``, one a plain ``None`` attribute
    replaced by a registered buffer (torchrl's ``REDQLoss.target_entropy_buffer``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("slot", None)
        self.plain = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slot is None:
            self.slot = x.detach().mean(0)
            del self.plain
            self.register_buffer("plain", x.detach().sum())
        return self.lin(x) + self.slot + self.plain


def test_buffers_a_module_sets_at_its_first_forward_load_into_a_fresh_one_and_roll_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A module saved after its first forward loads into one built alike that has not run yet (the load registers
    the buffers it sets lazily, with the saved values), and training goes on exactly; a load refused later leaves
    the slots as they were. A parameter slot holding ``None`` is no such slot: still refused."""
    import torchrl_dcp as tdcp

    torch.manual_seed(0)
    saved = _LazyBuffers()
    saved(torch.randn(3, 2))
    path = tdcp.DistributedCheckpoint(m=saved).save(tmp_path / "c")
    fresh = _LazyBuffers()
    tdcp.DistributedCheckpoint(m=fresh).load(path)
    assert fresh.state_dict().keys() == saved.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))
    x = torch.randn(4, 2)
    assert torch.equal(fresh(x), saved(x))

    class Failing:  # restored after the module (both read in place), refuses its state
        def __init__(self) -> None:
            self.t = torch.zeros(2)

        def state_dict(self) -> dict:
            return {"t": self.t}

        def load_state_dict(self, state: dict) -> None:
            raise RuntimeError("refused on purpose")

    path = tdcp.DistributedCheckpoint(m=saved, z=Failing()).save(tmp_path / "e")
    other = _LazyBuffers()
    with pytest.raises(tdcp.CheckpointError, match="refused on purpose"):
        tdcp.DistributedCheckpoint(m=other, z=Failing()).load(path)
    assert other.slot is None and other.plain is None and "plain" not in other._buffers
    assert "slot" in other._buffers and other.state_dict().keys() == {"lin.weight", "lin.bias"}

    no_bias = torch.nn.Linear(2, 2, bias=False)
    path = tdcp.DistributedCheckpoint(m=torch.nn.Linear(2, 2)).save(tmp_path / "d")
    with pytest.raises(tdcp.IncompatibleComponentError, match="bias"):
        tdcp.DistributedCheckpoint(m=no_bias).load(path)


def test_a_redq_loss_loads_into_one_that_has_not_run_yet(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torchrl's ``REDQLoss`` registers ``target_entropy_buffer`` at its first forward: a loss saved after training
    loads into a fresh one built alike, with that buffer."""
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.data import Bounded
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import REDQLoss

    import torchrl_dcp as tdcp

    def build() -> REDQLoss:
        torch.manual_seed(0)
        net = torch.nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[8]), NormalParamExtractor())
        actor = ProbabilisticActor(
            TensorDictModule(net, ["observation"], ["loc", "scale"]),
            in_keys=["loc", "scale"],
            spec=Bounded(-2.0, 2.0, shape=(1,)),
            distribution_class=TanhNormal,
            return_log_prob=True,
        )
        q = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[8]), in_keys=["observation", "action"])
        return REDQLoss(actor, q, num_qvalue_nets=2, sub_sample_len=1)

    loss = build()
    _ = loss.target_entropy  # what its first forward does
    loss.target_entropy_buffer.fill_(-3.0)
    path = tdcp.DistributedCheckpoint(loss=loss).save(tmp_path / "c")
    fresh = build()
    assert "target_entropy_buffer" not in fresh.state_dict()
    tdcp.DistributedCheckpoint(loss=fresh).load(path)
    assert fresh.target_entropy.item() == -3.0
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), loss.state_dict().values()))


@pytest.mark.parametrize("key", ["_is_full_backward_hook", ".lazy", "lin._is_full_backward_hook", "lin..x"])
def test_forged_keys_naming_torch_internals_or_empty_parts_are_refused(tmp_path, key: str) -> None:  # type: ignore[no-untyped-def]
    """A load registers a lazily set buffer where the module holds ``None``: a forged key naming one of torch's
    own ``None`` attributes (``_is_full_backward_hook``), or with an empty part (``.lazy`` resolving to ``lazy``),
    was registered over it. Refused, the module unchanged."""
    import torchrl_dcp as tdcp
    from tests import forging

    torch.manual_seed(0)
    path = tdcp.DistributedCheckpoint(m=_LazyBuffers()).save(tmp_path / "c")

    def forge(m: dict) -> None:  # an extra key, an alias of a tensor the state holds
        node = {"t": "alias", "key": "lin.bias", "device": "cpu", "dtype": "float32", "shape": [2]}
        m["components"]["m"]["state"]["items"].append([key, node])

    forging.edit(path, forge)
    live = _LazyBuffers()
    with pytest.raises(tdcp.IncompatibleComponentError, match="keys differ"):
        tdcp.DistributedCheckpoint(m=live).load(path)
    assert live._is_full_backward_hook is None and live.lin._is_full_backward_hook is None
    assert live.state_dict().keys() == {"lin.weight", "lin.bias"} and live.plain is None


def test_a_forged_grad_flag_never_touches_live_tensors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``"grad": true`` forged on a module's buffer (read in place) or an optimizer's state: autograd was switched
    on for the live tensors (a BatchNorm then failed its forward). Only fresh tensors read for a value are tracked."""
    import torchrl_dcp as tdcp
    from tests import forging

    def build() -> tuple[torch.nn.Module, torch.optim.Adam]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        optim = torch.optim.Adam(model.parameters())
        model(torch.randn(5, 3)).sum().backward()
        optim.step()
        return model, optim

    model, optim = build()
    path = tdcp.DistributedCheckpoint(policy=model, optim=optim).save(tmp_path / "c")

    def forge(m: dict) -> None:
        forging.tensor_node(m["components"]["policy"]["state"], "1.running_mean")["grad"] = True
        for node in codec_nodes(m["components"]["optim"]["state"]):
            if node.get("t") == "tensor":
                node["grad"] = True

    forging.edit(path, forge)
    live, live_optim = build()
    tdcp.DistributedCheckpoint(policy=live, optim=live_optim).load(path)
    assert not live[1].running_mean.requires_grad
    assert not any(t.requires_grad for s in live_optim.state.values() for t in s.values() if torch.is_tensor(t))
    live.train()
    live(torch.randn(5, 3)).sum().backward()  # trains on


def codec_nodes(skeleton):  # type: ignore[no-untyped-def]
    from torchrl_dcp.format.codec import walk_nodes

    return list(walk_nodes(skeleton))
