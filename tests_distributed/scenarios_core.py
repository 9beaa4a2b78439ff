"""Per-rank programs for the core multi-process tests (run through ``launch``)."""

from __future__ import annotations

import os
import random
import signal
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def _objects(seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    big = {f"w{i}": torch.full((256,), float(seed + i)) for i in range(8)}  # replicated, several tensors
    shard = {"values": torch.arange(5, dtype=torch.float64) + 100 * rank + seed, "rank": rank}
    stats = {"episodes": 10 + rank + seed, "name": f"rank-{rank}"}
    return {"model": model, "optimizer": optimizer, "big": big, "shard": shard, "stats": stats}


def _checkpoint(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(model=objs["model"], optimizer=objs["optimizer"], big=objs["big"])
    ckpt.register("shard", objs["shard"], placement="per_rank")
    ckpt.register("stats", objs["stats"], placement="per_rank")
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def _train_step(objs: dict[str, Any]) -> None:
    x = torch.randn(8, 4)
    loss = objs["model"](x).pow(2).mean()
    objs["optimizer"].zero_grad()
    loss.backward()
    for p in objs["model"].parameters():
        dist.all_reduce(p.grad)
    objs["optimizer"].step()


def _draws() -> list[float]:
    return [torch.rand(1).item(), random.random(), float(np.random.rand())]


def _fingerprint(objs: dict[str, Any]) -> list[float]:
    return [float(p.double().sum()) for p in objs["model"].state_dict().values()]


def save_then_draw(path: str, seed: int) -> dict[str, Any]:
    """Train one step, save, and report what the next random draws and training give."""
    rank = dist.get_rank()
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(seed + rank)
    objs = _objects(seed)
    torch.manual_seed(seed + rank)
    _train_step(objs)
    ckpt = _checkpoint(objs)
    ckpt.save(path, step=1, metadata={"seed": seed})
    draws = _draws()
    _train_step(objs)
    return {"draws": draws, "after_step": _fingerprint(objs)}


def load_then_draw(path: str, seed: int) -> dict[str, Any]:
    """Fresh objects built with another seed, load, and report the same things."""
    rank = dist.get_rank()
    objs = _objects(seed + 1000)
    ckpt = _checkpoint(objs)
    result = ckpt.load(path)
    draws = _draws()
    _train_step(objs)
    return {
        "loaded": sorted(result.loaded),
        "draws": draws,
        "after_step": _fingerprint(objs),
        "shard": objs["shard"]["values"].tolist(),
        "shard_rank": objs["shard"]["rank"],
        "stats": objs["stats"],
        "big": [objs["big"][f"w{i}"][0].item() for i in range(8)],
        "rank": rank,
        "step": result.step,
    }


def load_replicated_only(path: str, seed: int) -> dict[str, Any]:
    """On another world size: replicated components load, per-rank ones are refused clearly."""
    objs = _objects(seed + 1000)
    ckpt = _checkpoint(objs)
    out: dict[str, Any] = {}
    try:
        ckpt.load(path)
        out["full_load"] = "loaded"
    except tdcp.WorldSizeMismatchError as err:
        out["full_load"] = str(err)
    result = ckpt.load(path, components=["model", "big"])
    out["loaded"] = sorted(result.loaded)
    out["unrequested"] = sorted(result.unrequested)
    out["big"] = [objs["big"][f"w{i}"][0].item() for i in range(8)]
    return out


def save_and_die(path: str, seed: int, phase: str) -> None:
    """Start a save to ``path`` and SIGKILL rank 1 at ``phase`` of it."""
    import torchrl_dcp.storage.writer as storage_writer

    objs = _objects(seed)
    ckpt = _checkpoint(objs)
    if dist.get_rank() == 1:
        import torchrl_dcp.storage.writer as writer

        if phase == "write":  # killed in the middle of writing its data file
            original_pwrite = writer.pwrite_all

            def write_and_die(fd, data, offset):  # type: ignore[no-untyped-def]
                original_pwrite(fd, data, offset)
                os.kill(os.getpid(), signal.SIGKILL)

            writer.pwrite_all = write_and_die
        elif phase == "checksum":  # killed after its file is written and checksummed, before reporting it
            original_share = storage_writer.write_share

            def die(*args, **kwargs):  # type: ignore[no-untyped-def]
                original_share(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
                raise AssertionError

            storage_writer.write_share = die
    ckpt.save(path, step=2)


def rotate_and_die(path: str) -> dict[str, Any]:
    """A rotation's save of step 2 whose coordinator (rank 0) is SIGKILLed in the prune, after the commit: rank 1
    reports the error it gets."""
    from torchrl_dcp import rotation as rotation_module

    prune = rotation_module.CheckpointRotation.prune

    def die_in_prune(self, **kwargs):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return prune(self, **kwargs)

    rotation_module.CheckpointRotation.prune = die_in_prune  # type: ignore[method-assign]
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), timeout=10)
    rotation = tdcp.CheckpointRotation(path, every_steps=2)
    try:
        for step in (1, 2):
            rotation.maybe_save(ckpt, step)
    except tdcp.CheckpointError as err:
        return {"error": str(err)}
    return {"error": None}


def raise_on_one_rank(path: str, seed: int) -> dict[str, Any]:
    """An unencodable value on rank 1 only: every rank gets a CheckpointError, nothing is written."""
    objs = _objects(seed)
    ckpt = _checkpoint(objs)
    if dist.get_rank() == 1:
        objs["stats"]["bad"] = object()
    try:
        ckpt.save(path, step=3)
    except tdcp.CheckpointError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def save_unlike(path: str, case: str) -> dict[str, Any]:
    """A good checkpoint at ``path``, then a save the ranks describe differently (``case``): every rank must get the
    same CheckpointError before anything is written, the good checkpoint kept."""
    objs = _objects(0)
    ckpt = _checkpoint(objs)
    ckpt.save(path, step=1)
    rank = dist.get_rank()
    target, step, components = path, 2, None
    if rank == 1:
        if case == "extra_component":  # (a replicated one: every rank must hold it; a per-rank one is saved absent)
            ckpt.register("extra", {"n": 1})
        elif case == "placement":
            ckpt = tdcp.DistributedCheckpoint(model=objs["model"])
            ckpt.register("stats", objs["stats"], placement="replicated")
            ckpt.register("rng", tdcp.RNGState())
        elif case == "kind":
            ckpt = tdcp.DistributedCheckpoint(model=objs["model"])
            ckpt.register("stats", torch.zeros(2), placement="per_rank")
            ckpt.register("rng", tdcp.RNGState())
        elif case == "path":
            target = path + "-elsewhere"
        elif case == "step":
            step = 3
        elif case == "components":
            components = ["model"]
        elif case == "chunking":  # (what TDCP_CHUNK_BYTES set on one node only gives that rank: probe m6)
            from torchrl_dcp import chunking

            chunking.CHUNK_BYTES, chunking.MIN_CHUNKED_BYTES = (
                chunking.CHUNK_BYTES // 2,
                chunking.MIN_CHUNKED_BYTES // 2,
            )
    try:
        ckpt.save(target, step=step, components=components)
    except tdcp.CheckpointError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def load_unlike(path: str, case: str) -> dict[str, Any]:
    """Two checkpoints; rank 1 loads the other one (``path``) or fewer components (``components``): every rank
    must get the same CheckpointError and keep its objects (replicated state loaded silently differed by rank)."""
    ckpt = _checkpoint(_objects(0))
    ckpt.save(path + "-a", step=1)
    ckpt.save(path + "-b", step=2)
    objs = _objects(7)
    before = [t.clone() for t in objs["model"].state_dict().values()]
    target, components = path + "-a", None
    if dist.get_rank() == 1:
        if case == "path":
            target = path + "-b"
        else:
            components = ["optimizer", "shard", "stats", "rng", "big"]
    try:
        _checkpoint(objs).load(target, components=components)
    except tdcp.CheckpointError as err:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, objs["model"].state_dict().values()))
        return {"error": type(err).__name__, "message": str(err), "unchanged": unchanged}
    return {"error": None}


def save_while_loading(path: str) -> dict[str, Any]:
    """Rank 0 saves while rank 1 loads (after a save both made): their exchanges met, the load's description of
    what it loads against the save's gathered plan; rank 0 raised a bare ``ValueError`` (unpacking what it gathered).
    Every rank now raises a ``CheckpointError`` naming the other's exchange, and the checkpoint stays as it was."""
    ckpt = _checkpoint(_objects(0))
    ckpt.save(path, step=1)
    try:
        if dist.get_rank() == 0:
            ckpt.save(path + "-b", step=2)
        else:
            ckpt.load(path)
    except Exception as err:  # noqa: BLE001 - what the user sees, whatever it is
        return {
            "error": type(err).__name__,
            "checkpoint_error": isinstance(err, tdcp.CheckpointError),
            "message": str(err),
        }
    return {"error": None}


def first_call_late(path: str) -> dict[str, Any]:
    """Rank 1 reaches the process's first checkpoint call (a resume right after a restart) past the timeout: the
    creation of the checkpoint group failed with torch's store errors naming no rank; a CollectiveError now."""
    import time

    ckpt = tdcp.DistributedCheckpoint(timeout=3, model=torch.nn.Linear(2, 2))
    if dist.get_rank() == 1:
        time.sleep(6)
    try:
        tdcp.resume(ckpt, path)
    except Exception as err:  # noqa: BLE001 - what the user sees, whatever it is
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def group_creation_that_never_ends(path: str) -> dict[str, Any]:
    """Rank 0's creation of the checkpoint group blocks past its timeout (what gloo's rendezvous does when the peer
    dies while it connects: the survivor waited for minutes with ``timeout=2``): given up after the timeout and a
    grace period, a CollectiveError."""
    import threading
    import time

    from torchrl_dcp import _dist

    _dist._GROUP_GRACE = 1.0
    if dist.get_rank() == 0:
        never = threading.Event()
        _dist.dist.new_group = lambda **kwargs: never.wait()  # type: ignore[assignment]
    ckpt = tdcp.DistributedCheckpoint(timeout=2, model=torch.nn.Linear(2, 2))
    started = time.monotonic()
    try:
        ckpt.save(path)
    except Exception as err:  # noqa: BLE001 - what the user sees, whatever it is
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - started}
    return {"error": None}


def resume_past_a_users_file(path: str, seed: int) -> dict[str, Any]:
    """Two entries, a user's file put into the newest one (by rank 0): every rank's resume stops there, naming it;
    moved out, every rank resumes the newest."""
    objs = _objects(seed)
    ckpt = _checkpoint(objs)
    rotation = tdcp.CheckpointRotation(path, keep_last=3)
    for step in (1, 2):
        rotation.save(ckpt, step=step)
    newest = rotation.latest()
    if dist.get_rank() == 0:
        (newest / "eval_results.json").write_text("{}")
    dist.barrier()
    out: dict[str, Any] = {}
    try:
        rotation.resume(ckpt)
    except tdcp.CheckpointError as err:
        out["error"], out["message"] = type(err).__name__, str(err)
    dist.barrier()
    if dist.get_rank() == 0:
        (newest / "eval_results.json").rename(newest.parent / "eval_results.json")
    dist.barrier()
    out["step"] = rotation.resume(ckpt).step
    return out


def per_rank_on_some_ranks(path: str, phase: str) -> dict[str, Any]:
    """A per-rank component registered on rank 0 alone (an evaluation hook, a logger): saved, rank 1's state absent.
    ``phase``: ``save``; ``load`` (registered as saved); ``load_everywhere`` (rank 1 registers it too: kept, said);
    ``replicated`` (a replicated one on rank 0 alone: refused on every rank); ``save_options`` / ``options_unknown``
    (``component_options`` naming it, or a name no rank registered), ``load_options`` / ``load_options_unknown``
    (the same at a load); ``reshard`` / ``reshard_rank_0`` (on 3 ranks,
    every rank's buffer, or rank 0's alone: refused); ``skip_own`` (rank 1 registers none of its own per-rank
    ``stats``: said on rank 1)."""
    rank = dist.get_rank()
    objs = _objects(0)
    ckpt = _checkpoint(objs)
    if phase == "skip_own" and rank == 1:  # (its saved "stats" are its own: skipped, said there)
        ckpt = tdcp.DistributedCheckpoint(model=objs["model"], optimizer=objs["optimizer"], big=objs["big"])
        ckpt.register("shard", objs["shard"], placement="per_rank")
        ckpt.register("rng", tdcp.RNGState())
    evaluator = {"evaluations": 3 + rank, "best": 10.0 * (rank + 1)}
    demos = _demonstrations(rank)  # (a buffer and a generator of rank 0's: adapters that check what they load)
    generator = torch.Generator().manual_seed(5 + rank)
    if phase == "replicated" and rank == 0:
        ckpt.register("evaluator", evaluator)
    elif rank == 0 or phase == "load_everywhere":
        ckpt.register("evaluator", evaluator, placement="per_rank")
        ckpt.register("demos", demos)
        ckpt.register("generator", generator, placement="per_rank")
    if phase in ("reshard", "reshard_rank_0"):  # (on 3 ranks: rank 0's 3 rows, rank 1's absent state, shared out)
        buffer = _demonstrations(rank)
        buffer.empty()
        ckpt = (
            tdcp.DistributedCheckpoint(demos=buffer)
            if phase == "reshard" or rank == 0
            else tdcp.DistributedCheckpoint()
        )
        ckpt.register("generator", generator, placement="per_rank")  # (new rank r takes saved rank r % 2's)
        error = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ckpt.load(path, world_size_change="reshard")
            except tdcp.CheckpointError as err:
                error = str(err)
        said = [str(w.message) for w in caught if issubclass(w.category, tdcp.InexactResumeWarning)]
        rows = buffer._storage._storage["id"][: len(buffer)].tolist() if len(buffer) else []
        return {"demos": rows, "draw": torch.rand(1, generator=generator).item(), "said": said, "error": error}
    if phase in ("save", "replicated", "save_selected", "select_unknown", "save_options", "options_unknown"):
        chosen = {"save_selected": ["evaluator", "model"], "select_unknown": ["model", "nope"]}.get(phase)
        options = {"save_options": ["evaluator"], "options_unknown": ["evaluator", "nope"]}.get(phase, [])
        try:
            ckpt.save(path, step=1, components=chosen, component_options={n: tdcp.CheckpointOptions() for n in options})
        except tdcp.CheckpointError as err:
            return {"error": str(err)}
        return {"error": None}
    evaluator.update(evaluations=-1, best=-1.0)
    torch.rand(3, generator=generator)  # (moved on from its seed: a load puts it back, where rank 0 saved one)
    options = {"load_options": ["evaluator"], "load_options_unknown": ["nope"]}.get(phase, [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ckpt.load(path, component_options={n: tdcp.CheckpointOptions() for n in options})
        except tdcp.CheckpointError as err:
            return {"error": str(err)}
    said = [str(w.message) for w in caught if issubclass(w.category, tdcp.InexactResumeWarning)]
    skipped = [str(w.message) for w in caught if issubclass(w.category, tdcp.UnrestoredComponentWarning)]
    rows = demos._storage._storage["id"][: len(demos)].tolist() if len(demos) else []
    draw = torch.rand(1, generator=generator).item()
    return {
        "evaluator": evaluator,
        "loaded": sorted(result.loaded),
        "said": said,
        "skipped": skipped,
        "demos": rows,
        "draw": draw,
    }


def _demonstrations(rank: int) -> Any:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    rb.extend(TensorDict({"id": torch.arange(3) + 100 * rank}, [3]))
    return rb
