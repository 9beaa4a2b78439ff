"""Python's and NumPy's generator objects resume their streams exactly, whatever their kind and where they stood
(a cached Gaussian included), through a directory and an archive; a mismatch is refused before anything changes."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchrl_dcp as tdcp

BIT_GENERATORS = ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"]


def _python(seed: int) -> random.Random:
    return random.Random(seed)


def _draw_python(r: random.Random, n: int) -> list[Any]:
    return [
        f(r) for _ in range(n) for f in (lambda r: r.random(), lambda r: r.gauss(0, 1), lambda r: r.getrandbits(70))
    ]


def _numpy(kind: str) -> Callable[[int], np.random.Generator]:
    return lambda seed: np.random.Generator(getattr(np.random, kind)(seed))


def _draw_numpy(g: np.random.Generator, n: int) -> list[Any]:
    return [g.random(n).tolist(), g.normal(size=n).tolist(), g.integers(0, 1 << 62, n).tolist(), g.integers(0, 7)]


def _draw_legacy(g: np.random.RandomState, n: int) -> list[Any]:
    return [g.rand(n).tolist(), g.randn(n).tolist(), g.randint(0, 1 << 30, n).tolist(), g.randn()]  # odd randn: cached


def _same_stream(gen: np.random.Generator, state: dict[str, Any]) -> bool:
    """Whether ``gen`` stands where ``state`` was taken (states hold arrays: compared by what they draw)."""
    twin = np.random.Generator(type(gen.bit_generator)())
    twin.bit_generator.state = state
    return gen.integers(0, 1 << 62, 8).tolist() == twin.integers(0, 1 << 62, 8).tolist()


KINDS: dict[str, tuple[Callable[[int], Any], Callable[[Any, int], list[Any]]]] = {
    "random.Random": (_python, _draw_python),
    "RandomState": (np.random.RandomState, _draw_legacy),
    **{f"Generator[{k}]": (_numpy(k), _draw_numpy) for k in BIT_GENERATORS},
}


@pytest.mark.parametrize("archive", [False, True], ids=["directory", "archive"])
@pytest.mark.parametrize("drawn", [0, 1, 3])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_generator_resumes_its_stream_exactly(tmp_path: Path, kind: str, drawn: int, archive: bool) -> None:
    make, draw = KINDS[kind]
    gen = make(7)
    for _ in range(drawn):
        draw(gen, 5)
    path = tdcp.DistributedCheckpoint(gen=gen).save(tmp_path / "c")
    if archive:
        path = tdcp.to_archive(path, tmp_path / "c.zip")
    expected = draw(gen, 9)
    fresh = make(12345)
    result = tdcp.DistributedCheckpoint(gen=fresh).load(path)
    assert result.loaded == {"gen"}
    assert draw(fresh, 9) == expected
    assert result.manifest["components"]["gen"]["placement"] == "per_rank"


@pytest.mark.parametrize("saved, live", [("PCG64", "MT19937"), ("Philox", "SFC64")])
def test_another_bit_generator_is_refused_before_anything_changes(tmp_path: Path, saved: str, live: str) -> None:
    model = torch.nn.Linear(2, 2)
    path = tdcp.DistributedCheckpoint(gen=_numpy(saved)(1), model=model).save(tmp_path / "c")
    other, target = torch.nn.Linear(2, 2), _numpy(live)(2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    state = target.bit_generator.state
    with pytest.raises(tdcp.IncompatibleComponentError, match=f"'gen'.*{saved}.*{live}.*numpy.random.{saved}"):
        tdcp.DistributedCheckpoint(gen=target, model=other).load(path)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert _same_stream(target, state)


def test_a_system_random_cannot_be_saved_and_says_why(tmp_path: Path) -> None:
    with pytest.raises(tdcp.CheckpointError, match="SystemRandom has no state"):
        tdcp.DistributedCheckpoint(gen=random.SystemRandom()).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


class _FailsOnRestore(tdcp.Adapter):
    adapter_id = "tests.fails_on_restore"

    def state(self, obj: Any, ctx: Any) -> Any:
        return {"n": 1}

    def restore(self, obj: Any, state: Any, ctx: Any) -> Any:
        raise RuntimeError("restore failed")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_failed_load_rolls_a_restored_generator_back(tmp_path: Path, kind: str) -> None:
    """A generator restored before another component fails is put back where it stood."""
    make, draw = KINDS[kind]
    ckpt = tdcp.DistributedCheckpoint(gen=make(3))
    ckpt.register("last", object(), adapter=_FailsOnRestore())
    path = ckpt.save(tmp_path / "c")
    live, twin = make(4), make(4)
    draw(live, 2), draw(twin, 2)
    loading = tdcp.DistributedCheckpoint(gen=live)
    loading.register("last", object(), adapter=_FailsOnRestore())
    with pytest.raises(tdcp.CheckpointError, match="restore failed"):
        loading.load(path)
    assert draw(live, 5) == draw(twin, 5)


def test_what_a_generator_load_cannot_give_back_is_warned_about_at_save(tmp_path: Path) -> None:
    """A numpy Generator's spawn count (numpy lets no one set it: spawn() after a load repeats the children) and a
    random.Random subclass's own attributes were dropped without a word; a plain one saves silently."""
    import warnings

    spawned = np.random.default_rng(42)
    spawned.spawn(2)
    with pytest.warns(tdcp.InexactResumeWarning, match=r"component 'g': .*spawned 2 child generator"):
        tdcp.DistributedCheckpoint(g=spawned, no_dist=True).save(tmp_path / "a")

    class Counting(random.Random):
        def __init__(self, seed: int) -> None:
            super().__init__(seed)
            self.draws = 0

    with pytest.warns(tdcp.InexactResumeWarning, match=r"component 'r': its Counting holds attributes .*draws"):
        tdcp.DistributedCheckpoint(r=Counting(1), no_dist=True).save(tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        tdcp.DistributedCheckpoint(g=np.random.default_rng(1), r=random.Random(2), no_dist=True).save(tmp_path / "c")
