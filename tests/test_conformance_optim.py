"""Conformance matrix: every ``torch.optim`` optimizer that runs on CPU (and the variants that keep other state:
amsgrad, foreach, fused, centered, nesterov, decoupled weight decay) × fresh / stepped, with an LR scheduler; and
every LR scheduler kind.

Each case saves model + optimizer + scheduler, keeps training, loads into freshly built ones (never stepped) and
checks the next steps are bit for bit those of the run that never stopped. FSDP2 runs in tests_distributed/test_fsdp.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp

optim = torch.optim
OPTIMIZERS = {
    "adam": lambda p: optim.Adam(p, lr=1e-2),
    "adam_amsgrad": lambda p: optim.Adam(p, lr=1e-2, amsgrad=True),
    "adam_foreach": lambda p: optim.Adam(p, lr=1e-2, foreach=True),
    "adam_fused": lambda p: optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda p: optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adagrad": lambda p: optim.Adagrad(p, lr=1e-2),
    "adadelta": lambda p: optim.Adadelta(p),
    "adamax": lambda p: optim.Adamax(p),
    "asgd": lambda p: optim.ASGD(p, lr=1e-2),
    "nadam_decoupled": lambda p: optim.NAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda p: optim.RAdam(p, lr=1e-2),
    "rmsprop_centered": lambda p: optim.RMSprop(p, lr=1e-2, centered=True, momentum=0.5),
    "rprop": lambda p: optim.Rprop(p),
    "sgd_momentum": lambda p: optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd_nesterov": lambda p: optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda p: optim.Adafactor(p, lr=1e-2),
    "lbfgs": lambda p: optim.LBFGS(p, lr=0.5, history_size=3, max_iter=4),
}
CASES = list(itertools.product(OPTIMIZERS, ["fresh", "stepped"]))


def build(kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = OPTIMIZERS[kind](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer, scheduler=scheduler)
    return model, optimizer, scheduler, ckpt


def train(model, optimizer, scheduler, start: int, n: int) -> list[torch.Tensor]:
    out = []
    for step in range(start, start + n):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(step))

        def closure(x: torch.Tensor = x) -> torch.Tensor:  # LBFGS calls it several times; the others once
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        optimizer.step(closure)
        scheduler.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


@pytest.mark.parametrize("kind, state", CASES, ids=["-".join(c) for c in CASES])
def test_optimizer_conformance(tmp_path: Path, kind: str, state: str) -> None:
    model, optimizer, scheduler, ckpt = build(kind)
    steps = 3 if state == "stepped" else 0
    train(model, optimizer, scheduler, 0, steps)
    path = ckpt.save(tmp_path / "ckpt")
    saved_state = len(optimizer.state)  # none before a first step, except optimizers that build it eagerly (Adagrad)
    expected = train(model, optimizer, scheduler, steps, 4)

    model2, optimizer2, scheduler2, ckpt2 = build(kind)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # the fresh model differs until loaded
    ckpt2.load(path)
    assert len(optimizer2.state) == saved_state
    got = train(model2, optimizer2, scheduler2, steps, 4)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"step {steps + i} differs after the restore"


SCHEDULERS = {
    "step": lambda o: optim.lr_scheduler.StepLR(o, 2, 0.5),
    "multistep": lambda o: optim.lr_scheduler.MultiStepLR(o, [2, 5], 0.3),
    "exponential": lambda o: optim.lr_scheduler.ExponentialLR(o, 0.9),
    "cosine": lambda o: optim.lr_scheduler.CosineAnnealingLR(o, 10),
    "cosine_restarts": lambda o: optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 3),
    "one_cycle": lambda o: optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=50),
    "cyclic": lambda o: optim.lr_scheduler.CyclicLR(o, 0.001, 0.1, step_size_up=3, cycle_momentum=False),
    "linear": lambda o: optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 5),
    "polynomial": lambda o: optim.lr_scheduler.PolynomialLR(o, 10, 2.0),
    "lambda": lambda o: optim.lr_scheduler.LambdaLR(o, lambda e: 0.95**e),
    "multiplicative": lambda o: optim.lr_scheduler.MultiplicativeLR(o, lambda e: 0.95),
    "plateau": lambda o: optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
    "sequential": lambda o: optim.lr_scheduler.SequentialLR(
        o, [optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 3), optim.lr_scheduler.ExponentialLR(o, 0.9)], milestones=[3]
    ),
    "chained": lambda o: optim.lr_scheduler.ChainedScheduler(
        [optim.lr_scheduler.StepLR(o, 2, 0.5), optim.lr_scheduler.ExponentialLR(o, 0.9)]
    ),
}


def _schedule_run(
    kind: str, model: torch.nn.Module, optimizer: optim.Optimizer, scheduler: object, start: int, n: int
) -> list[float]:
    lrs = []
    for step in range(start, start + n):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step(loss.item()) if kind == "plateau" else scheduler.step()  # type: ignore[attr-defined]
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_lr_scheduler_conformance(tmp_path: Path, kind: str) -> None:
    """The learning rates after a restore are those of the run that never stopped (schedulers holding lambdas
    included: their ``state_dict`` leaves the functions out, the rebuilt scheduler brings its own)."""

    def build_all() -> tuple[torch.nn.Module, optim.Optimizer, object]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, optimizer, SCHEDULERS[kind](optimizer)

    model, optimizer, scheduler = build_all()
    _schedule_run(kind, model, optimizer, scheduler, 0, 4)
    path = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer, scheduler=scheduler).save(tmp_path / "c")
    expected = _schedule_run(kind, model, optimizer, scheduler, 4, 6)
    model2, optimizer2, scheduler2 = build_all()
    tdcp.DistributedCheckpoint(model=model2, optimizer=optimizer2, scheduler=scheduler2).load(path)
    assert _schedule_run(kind, model2, optimizer2, scheduler2, 4, 6) == expected
    assert torch.equal(model.weight, model2.weight)


def test_dreamer_v3_optimizer_keeps_float32_moments_of_bf16_parameters(tmp_path: Path) -> None:
    """torchrl's DreamerV3Optimizer accumulates float32 moments for bf16 parameters; ``load_state_dict`` casts
    state to the parameter's dtype, so they came back as bf16. After a restore the state holds the saved dtypes and
    values, and the next steps equal an uninterrupted run's bit for bit."""
    from torchrl.trainers.algorithms.dreamer_v3 import DreamerV3Optimizer

    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3).to(torch.bfloat16)
        return model, DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=0)

    def step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
        x = torch.full((2, 4), float(i + 1), dtype=torch.bfloat16)
        optim.zero_grad()
        model(x).float().pow(2).sum().backward()
        optim.step()

    model, optim = make(0)
    for i in range(3):
        step(model, optim, i)
    dtypes = {k: v.dtype for s in optim.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    assert torch.float32 in dtypes.values()
    path = tdcp.DistributedCheckpoint(model=model, optim=optim).save(tmp_path / "c")
    model2, optim2 = make(1)
    step(model2, optim2, 0)  # a state of its own first
    tdcp.DistributedCheckpoint(model=model2, optim=optim2).load(path)
    for (p, s), (p2, s2) in zip(optim.state.items(), optim2.state.items()):
        assert torch.equal(p, p2)
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                assert s2[k].dtype == v.dtype and torch.equal(s2[k], v), k
    for i in range(3, 5):
        step(model, optim, i)
        step(model2, optim2, i)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


KINDS = (
    {  # one optimizer of each class of OPTIMIZERS
        kind: make for kind, make in OPTIMIZERS.items() if kind in {"adam", "adamw", "adagrad", "adadelta", "adamax"}
    }
    | {k: OPTIMIZERS[k] for k in ("asgd", "nadam_decoupled", "radam", "rmsprop_centered", "rprop", "sgd_momentum")}
    | {k: OPTIMIZERS[k] for k in ("adafactor", "lbfgs")}
)
PAIRS = [(a, b) for a in KINDS for b in KINDS if a != b]


def _snapshot(optimizer: torch.optim.Optimizer) -> str:
    return repr(optimizer.state_dict())


@pytest.mark.parametrize("saved, live", PAIRS, ids=[f"{a}-into-{b}" for a, b in PAIRS])
def test_another_kind_of_optimizer_is_refused_or_steps(tmp_path: Path, saved: str, live: str) -> None:
    """A checkpoint of one kind of optimizer loaded into another (every ordered pair of torch's classes): refused
    before anything changes (IncompatibleComponentError), or loaded into an optimizer that can still step. None
    may load into one that fails at its next ``step`` (an Adam checkpoint gave an SGD no ``momentum``)."""
    model, optimizer, scheduler, _ = build(saved)
    train(model, optimizer, scheduler, 0, 2)
    path = tdcp.DistributedCheckpoint(optimizer=optimizer).save(tmp_path / "c")
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    target = KINDS[live](other.parameters())
    before = _snapshot(target)
    try:
        tdcp.DistributedCheckpoint(optimizer=target).load(path)
    except tdcp.IncompatibleComponentError as err:
        assert "another kind of optimizer" in str(err)
        assert _snapshot(target) == before
        return
    train(other, target, torch.optim.lr_scheduler.StepLR(target, step_size=2), 2, 2)  # must not raise


@pytest.mark.parametrize("kind", ["adam", "sgd_momentum", "rmsprop_centered", "asgd", "adagrad"])
@pytest.mark.parametrize("live_state", ["fresh", "stepped"])
def test_optimizer_state_of_another_model_is_refused_and_changes_nothing(
    tmp_path: Path, kind: str, live_state: str
) -> None:
    """An optimizer saved over one model loaded into the same optimizer over a model of other shapes: refused while
    planning, naming the state and both shapes, the optimizer unchanged; with ``strict='warn'`` (the model skipped
    as incompatible) the optimizer is skipped too, not loaded with state its parameters cannot use."""
    model, optimizer, scheduler, _ = build(kind)
    train(model, optimizer, scheduler, 0, 2)
    path = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer).save(tmp_path / "c")
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    target = OPTIMIZERS[kind](other.parameters())
    if live_state == "stepped":
        train(other, target, torch.optim.lr_scheduler.StepLR(target, step_size=2), 0, 1)
    before = _snapshot(target)
    with pytest.raises(tdcp.IncompatibleComponentError, match="saved for another model"):
        tdcp.DistributedCheckpoint(optimizer=target).load(path)
    assert _snapshot(target) == before
    with pytest.warns(UserWarning):
        result = tdcp.DistributedCheckpoint(model=other, optimizer=target).load(path, strict="warn")
    assert set(result.incompatible) == {"model", "optimizer"} and not result.loaded
    assert _snapshot(target) == before


DROPPED = [
    ("adam", "lr", True),
    ("adam", "betas", True),
    ("adam", "decoupled_weight_decay", False),  # (Adam's __setstate__ fills it: a state of an older torch)
    ("adam", "fused", False),
    ("lbfgs", "maximize", False),  # (LBFGS reads it with a default: older states have none, probe b2)
]


@pytest.mark.parametrize("kind, dropped, refused", DROPPED, ids=[f"{k}-{d}" for k, d, _ in DROPPED])
def test_a_param_group_without_an_option_the_step_reads_is_refused(
    tmp_path: Path, kind: str, dropped: str, refused: bool
) -> None:
    """Probe z3: an Adam parameter group whose ``lr`` was renamed, in a resealed manifest, loaded (torch's own
    ``load_state_dict`` takes it too) and the next ``step`` raised ``KeyError``. Refused while planning, the
    optimizer unchanged; an option the class's ``__setstate__`` fills in states of older torch versions, or its
    ``step`` reads with a default, still loads, and the optimizer steps."""
    from tests import forging

    model, optimizer, scheduler, _ = build(kind)
    train(model, optimizer, scheduler, 0, 2)
    path = tdcp.DistributedCheckpoint(optimizer=optimizer).save(tmp_path / "c")

    def drop(m: dict) -> None:
        groups = dict(m["components"]["optimizer"]["state"]["items"])["param_groups"]["items"]
        for group in groups:
            items = group["items"]
            assert any(k == dropped for k, _ in items)
            items[:] = [[k, v] for k, v in items if k != dropped]

    forging.edit(path, drop)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    target = OPTIMIZERS[kind](other.parameters())
    before = _snapshot(target)
    if refused:
        with pytest.raises(tdcp.IncompatibleComponentError, match=rf"parameter group 0 lacks options \['{dropped}'\]"):
            tdcp.DistributedCheckpoint(optimizer=target).load(path)
        assert _snapshot(target) == before
        return
    tdcp.DistributedCheckpoint(optimizer=target).load(path)
    train(other, target, torch.optim.lr_scheduler.StepLR(target, step_size=2), 2, 2)  # must not raise


TAMPERED = {  # case: (kind, options set on its group before saving, error, what it says)
    "betas_of_one": ("adam", {"betas": (0.9,)}, tdcp.CheckpointIntegrityError, "betas"),
    "amsgrad_without_its_state": ("adam", {"amsgrad": True}, tdcp.IncompatibleComponentError, "max_exp_avg_sq"),
    "fused_and_differentiable": (
        "adam",
        {"fused": True, "differentiable": True},
        tdcp.IncompatibleComponentError,
        "options torch's Adam refuses",
    ),
    "rprop_step_sizes_of_one": ("rprop", {"step_sizes": (1e-6,)}, tdcp.CheckpointIntegrityError, "step_sizes are"),
    "rprop_etas_of_one": ("rprop", {"etas": (0.5,)}, tdcp.CheckpointIntegrityError, "etas are"),
    "capturable_onto_cpu": (
        "adam",
        {"capturable": True},
        tdcp.IncompatibleComponentError,
        r"is capturable .* parameters are on \['cpu'\]",
    ),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_options_the_next_step_fails_on_are_refused(tmp_path: Path, case: str) -> None:
    """Probes b2 and c1: options no such optimizer holds (saved from a group set by hand, the bytes a forger writes)
    passed planning and the first ``step`` after the load failed, the model already overwritten: a one-element
    ``betas``, ``amsgrad`` over a state without ``max_exp_avg_sq`` (the expected state was the live group's),
    ``fused`` with ``differentiable``, Rprop's ``step_sizes`` of one (its ``etas`` of one: "IndexError: tuple index
    out of range", naming nothing), a CUDA save's ``capturable`` onto CPU parameters (torch's own
    ``load_state_dict`` takes it too). Refused while planning, the optimizer unchanged."""
    kind, options, error, said = TAMPERED[case]
    model, optimizer, scheduler, _ = build(kind)
    train(model, optimizer, scheduler, 0, 2)
    optimizer.param_groups[0].update(options)
    path = tdcp.DistributedCheckpoint(optimizer=optimizer).save(tmp_path / "c")
    _, target, _, _ = build(kind)
    before = _snapshot(target)
    with pytest.raises(error, match=said):
        tdcp.DistributedCheckpoint(optimizer=target).load(path)
    assert _snapshot(target) == before


def test_an_optimizer_whose_load_pre_hook_migrates_options_loads(tmp_path: Path) -> None:
    """Probe b2: an optimizer that renamed an option migrates older states in a ``load_state_dict`` pre-hook (torch's
    way); the check of the options its step reads looked at the saved groups, not what the hook makes of them, and
    refused what torch loads."""

    class Renamed(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 0.1, momentum_coef: float = 0.5) -> None:
            super().__init__(params, {"lr": lr, "momentum_coef": momentum_coef})

        @torch.no_grad()
        def step(self, closure=None):  # noqa: ANN001, ANN201
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"] * group["momentum_coef"])

    def migrate(opt, state_dict):  # noqa: ANN001, ANN202
        for group in state_dict["param_groups"]:
            if "beta" in group:
                group["momentum_coef"] = group.pop("beta")
        return state_dict

    old = Renamed(torch.nn.Linear(2, 1).parameters())
    for group in old.param_groups:
        group["beta"] = group.pop("momentum_coef")  # (as the older version saved it)
    path = tdcp.DistributedCheckpoint(optimizer=old).save(tmp_path / "c")
    model = torch.nn.Linear(2, 1)
    new = Renamed(model.parameters(), momentum_coef=0.9)
    new.register_load_state_dict_pre_hook(migrate)
    tdcp.DistributedCheckpoint(optimizer=new).load(path)
    assert new.param_groups[0]["momentum_coef"] == 0.5
    model(torch.ones(1, 2)).sum().backward()
    new.step()


def test_adam_with_tensor_betas_resumes_exactly(tmp_path: Path) -> None:
    """Probe c1: tensor ``betas`` (torch accepts them) were passed, unread, to the constructor check, and a valid
    checkpoint was refused ("'<=' not supported between 'float' and 'TensorSpec'")."""

    def make(p):  # noqa: ANN001, ANN202
        return optim.Adam(p, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)), foreach=False)

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = make(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train(model, optimizer, scheduler, 0, 2)
    path = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer, scheduler=scheduler).save(tmp_path / "c")
    expected = train(model, optimizer, scheduler, 2, 2)
    torch.manual_seed(1)
    other = torch.nn.Linear(3, 1)
    target = make(other.parameters())
    other_scheduler = torch.optim.lr_scheduler.StepLR(target, step_size=1, gamma=0.5)
    tdcp.DistributedCheckpoint(model=other, optimizer=target, scheduler=other_scheduler).load(path)
    got = train(other, target, other_scheduler, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_load_runs_no_step_hook_of_the_users(tmp_path: Path) -> None:
    """Probe c1: the load's probe optimizers stepped through torch's wrapper, so a user's global step hooks
    (``register_optimizer_step_pre_hook``: step counters, logging) fired at a load, on optimizers the user never
    built."""
    model, optimizer, scheduler, _ = build("adam")
    train(model, optimizer, scheduler, 0, 2)
    optimizer.param_groups[0].pop("differentiable")  # (an older torch's group: the probe step runs too)
    path = tdcp.DistributedCheckpoint(optimizer=optimizer).save(tmp_path / "c")
    import torch.optim.optimizer as optimizer_module

    fired: list[str] = []
    handles = [
        optimizer_module.register_optimizer_step_pre_hook(lambda *a: fired.append("pre")),
        optimizer_module.register_optimizer_step_post_hook(lambda *a: fired.append("post")),
    ]
    try:
        _, target, _, _ = build("adam")
        tdcp.DistributedCheckpoint(optimizer=target).load(path)
    finally:
        for handle in handles:
            handle.remove()
    assert fired == []


def test_a_forged_lbfgs_group_does_not_hang_the_load(tmp_path: Path) -> None:
    """Probe c1: a group lacking ``maximize`` made the load run a probe step with the checkpoint's options, and a
    forged ``max_iter`` of 10**12 with negative tolerances never returned. The probe steps with the live options."""
    from tests import forging

    model, optimizer, scheduler, _ = build("lbfgs")
    train(model, optimizer, scheduler, 0, 1)
    path = tdcp.DistributedCheckpoint(optimizer=optimizer).save(tmp_path / "c")
    forged = {"max_iter": 10**12, "max_eval": 10**12, "tolerance_grad": -1.0, "tolerance_change": -1.0}

    def forge(m: dict) -> None:
        for group in dict(m["components"]["optimizer"]["state"]["items"])["param_groups"]["items"]:
            group["items"][:] = [[k, forged.get(k, v)] for k, v in group["items"] if k != "maximize"]

    forging.edit(path, forge)
    _, target, _, _ = build("lbfgs")
    tdcp.DistributedCheckpoint(optimizer=target).load(path)  # (returns: the values are torch's to run)
    assert target.param_groups[0]["max_iter"] == 10**12
