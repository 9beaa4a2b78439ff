"""Changing the number of ranks: replay shards are redistributed, nothing lost or duplicated, priorities kept."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests_distributed.launch import launch

S = "tests_distributed.scenarios_reshard"


@pytest.mark.parametrize(
    "saved, resumed, capacity, preallocated",
    [(3, 2, 32, False), (2, 4, 32, False), (3, 2, 20, False), (3, 2, 32, True), (2, 3, 32, True)],
)
def test_prioritized_shards_are_redistributed(
    tmp_path: Path, saved: int, resumed: int, capacity: int, preallocated: bool
) -> None:
    """Lazy storages, and ``TensorStorage`` over rows the user allocated (``preallocated``), alike."""
    path = str(tmp_path / "ckpt")
    before = launch(f"{S}:save_shards", saved, path, capacity, preallocated)
    after = launch(f"{S}:load_resharded", resumed, path, 64, preallocated)
    old = Counter(tuple(item) for r in before for item in r.value["items"])
    new = Counter(tuple(item) for r in after for item in r.value["items"])
    assert new == old  # every transition once, with its priority leaf, bit for bit
    sizes = [len(r.value["items"]) for r in after]
    assert max(sizes) - min(sizes) <= 1  # evenly spread
    for r in after:
        assert (
            f"saved by {saved} ranks" in r.value["default_error"]
            and f"this job has {resumed}" in r.value["default_error"]
        )
        assert r.value["weight"] == [0.25] * 4  # replicated state as saved
        assert r.value.get("sample_ok", True)
        assert r.value["cursor"] == len(r.value["items"]) % 64
    draws = [r.value["draw"] for r in after]
    assert len(set(draws)) == len(draws)  # re-seeded streams differ between the new ranks
    again = launch(f"{S}:load_resharded", resumed, path, 64, preallocated)
    assert [r.value["draw"] for r in again] == draws  # ... deterministically


def test_a_reshard_that_lacks_capacity_changes_nothing(tmp_path: Path) -> None:
    """3 shards of 10 + 19 + 28 transitions onto 2 ranks with room for 16 each: refused before anything changes."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_shards", 3, path, 32)
    for r in launch(f"{S}:load_resharded_into_too_small_buffers", 2, path, 16):
        assert r.value["error"] is not None and "capacity" in r.value["error"], r.value
        assert r.value["policy_unchanged"] and r.value["rng_unchanged"] and r.value["buffer_untouched"], r.value


def test_python_and_numpy_generators_resume_per_rank_and_reshard_deterministically(tmp_path: Path) -> None:
    """Each rank resumes its own streams exactly; on another world size every new rank draws differently, and the
    same resharded resume draws the same numbers again."""
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_generators", 2, path)
    resumed = launch(f"{S}:load_generators", 2, path, False)
    assert [r.value["next"] for r in resumed] == [r.value["next"] for r in saved]
    assert saved[0].value["next"] != saved[1].value["next"]
    grown = launch(f"{S}:load_generators", 3, path, True)
    draws = [r.value["next"] for r in grown]
    for i in range(4):  # each generator kind: three different streams
        assert len({repr(d[i]) for d in draws}) == 3, draws
    assert [r.value["next"] for r in launch(f"{S}:load_generators", 3, path, True)] == draws


@pytest.mark.parametrize("saved, resumed", [(3, 2), (2, 3)])
def test_list_storage_buffers_are_redistributed(tmp_path: Path, saved: int, resumed: int) -> None:
    """``ReplayBuffer()`` (a ListStorage of tuples) on another world size: every transition lands once, intact."""
    path = str(tmp_path / "ckpt")
    before = launch(f"{S}:save_list_shards", saved, path)
    after = launch(f"{S}:load_list_resharded", resumed, path)
    assert sorted(i for r in after for i in r.value["ids"]) == sorted(i for r in before for i in r.value["ids"])
    sizes = [len(r.value["ids"]) for r in after]
    assert max(sizes) - min(sizes) <= 1 and all(r.value["values_ok"] for r in after)
    assert all(r.value["sample"] == 2 for r in after)


@pytest.mark.parametrize(
    "live, expected",
    [
        ("list", "not a tensor storage"),  # tensor shards into a ListStorage: never their key names as transitions
        ("extra", "entries the checkpoint does not (['extra'])"),  # rows would keep values no save wrote
        ("float16", "float32, the buffer holds ((3,), torch.float16)"),  # never a silent lossy cast
    ],
)
def test_a_reshard_into_a_storage_unlike_the_saved_one_is_refused_before_anything_changes(
    tmp_path: Path, live: str, expected: str
) -> None:
    """What the same-world load refuses, a reshard refuses too, while planning: the buffer keeps what it held."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "plain")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "plain", live)
    assert r.value["error"] is not None and expected in r.value["error"], r.value
    assert r.value["len_unchanged"], r.value


def test_a_reshard_keeps_the_saved_prioritized_sampler_settings(tmp_path: Path) -> None:
    """alpha, beta (annealed) and eps are the saved ones, not the new buffer's constructor arguments."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "prioritized")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "prioritized", "prioritized")
    assert r.value["error"] is None and r.value["len"] == 12, r.value
    assert r.value["alpha_beta_eps"][:2] == [0.7, 0.9], r.value


def test_a_slice_sampler_never_samples_across_two_saved_shards(tmp_path: Path) -> None:
    """Two shards joined on one rank would give slices spanning unrelated episodes: refused; one shard per new rank
    (2 -> 2 ranks by their own shards is the same-world load, so 2 -> 4: each new rank takes half a shard) samples
    only slices of consecutive transitions."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "slice")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "slice", "fresh")
    assert r.value["error"] is not None and "SliceSampler" in r.value["error"], r.value
    for rank, r in enumerate(launch(f"{S}:load_kind_resharded", 4, path, "slice", "fresh")):
        assert r.value["error"] is None and r.value["len"] == 3 and r.value["joins"] == [], r.value
        # rows 0-2 and 3-5 of saved rank 0 end episodes (ids 2, 5); saved rank 1's halves end mid-episode (102, 105)
        assert any("does not end an episode" in w for w in r.value["inexact"]) == (rank >= 2), r.value


def test_a_slice_samplers_part_ending_mid_episode_is_warned_about(tmp_path: Path) -> None:
    """Each new rank's newest row was mid-episode (still running when saved, or the cut fell inside it): the next
    rows written, a fresh episode, were joined to it in slices, silently. Now an InexactResumeWarning says so."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "slice_open")
    for r in launch(f"{S}:load_kind_resharded", 4, path, "slice_open", "fresh"):
        assert r.value["error"] is None and r.value["len"] == 3, r.value
        assert any("does not end an episode" in w for w in r.value["inexact"]), r.value


def test_a_resharded_buffer_with_a_transform_not_verified_exact_is_warned_about(tmp_path: Path) -> None:
    """A load at the saved world size warned that the buffer's transform is not verified exact; a reshard did not."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "observation_norm")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "observation_norm", "fresh")
    assert r.value["error"] is None and r.value["len"] == 12, r.value
    assert any("not verified exact in a buffer" in w for w in r.value["inexact"]), r.value


def test_a_reshard_renumbers_the_rows_index_entries_and_keeps_their_generations(tmp_path: Path) -> None:
    """Rows kept the ``"index"`` entry of their saved position (``update_tensordict_priority`` of ``rb[5:8]`` then
    changed rows 3-5), and a ``track_generations`` writer's slot stamps were not taken over (every received row
    said -1). Each row's entry is now its new position, and its stamp the one of its saved slot."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "prioritized")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "prioritized", "fresh")
    assert r.value["index"] == list(range(12)), r.value
    path = str(tmp_path / "gens")
    launch(f"{S}:save_kind_shards", 2, path, "generations")  # 6 rows into 4 slots: ids 4, 5 in slots written twice
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "generations", "fresh")
    assert r.value["ids"] == [2, 3, 4, 5, 102, 103, 104, 105], r.value  # (oldest first, each shard in turn)
    assert r.value["generations"] == [0, 0, 1, 1, 0, 0, 1, 1, -1, -1], r.value
    assert r.value["index"] == list(range(8)), r.value
    path = str(tmp_path / "user")  # a plain writer's rows: their "index" is the user's own, never renumbered
    launch(f"{S}:save_kind_shards", 2, path, "user_index")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "user_index", "fresh")
    assert r.value["index"] == [*range(6), *range(6)], r.value
    path = str(tmp_path / "preallocated")  # 6 of 8 preallocated rows written per shard: those 6 renumbered (torchrl
    launch(f"{S}:save_kind_shards", 2, path, "preallocated")  # counts all 8: the 2 never written are the oldest)
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "preallocated", "fresh")
    assert r.value["index"] == [-1, -1, *range(2, 8), -1, -1, *range(10, 16)], r.value
    path = str(tmp_path / "preallocated_unwritten")  # probe t3: one saved rank had not written yet, so its rows
    launch(f"{S}:save_kind_shards", 2, path, "preallocated_unwritten")  # lacked "index": the reshard was refused
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "preallocated_unwritten", "fresh")
    assert r.value["error"] is None, r.value
    assert r.value["ids"] == [-1] * 8 + [-1] * 5 + [100, 101, 102], r.value  # (torchrl counts the 8 rows a shard has)
    assert r.value["index"] == [0] * 8 + [0] * 5 + [13, 14, 15], r.value  # zeros, as torchrl's first write gives


def test_transitions_held_back_by_an_n_step_transform_refuse_a_reshard(tmp_path: Path) -> None:
    """A MultiStepTransform's held-back transitions continue their saved rank's env stream: never dropped silently."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_kind_shards", 2, path, "nstep")
    (r,) = launch(f"{S}:load_kind_resharded", 1, path, "nstep", "fresh")
    assert r.value["error"] is not None and "MultiStepTransform holds transitions back" in r.value["error"], r.value


@pytest.mark.parametrize("frozen", [False, True])
def test_a_resharded_collector_takes_the_sub_envs_statistics_and_the_trajectory_counter(
    tmp_path: Path, frozen: bool
) -> None:
    """A reshard restored a collector's ``state_dict()`` only: a SerialEnv's sub-envs' VecNormV2 statistics stayed
    fresh and a Compose'd TrajCounter restarted at 0 (handing out counts saved rank 0 had used), where the docs
    promise the transform statistics and counters of saved rank ``r % W``. Probe i1: a frozen VecNormV2 came back
    unfrozen (its flag was left with the saved rank's episode), and updated its statistics from the first step."""
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_counted_collector", 2, path, frozen)
    (resumed,) = (r.value for r in launch(f"{S}:load_counted_collector", 1, path))
    assert resumed["frozen"] == [frozen, frozen], resumed
    if frozen:  # saved rank 0's statistics, kept as they were through the fresh trajectory's reset
        assert resumed["vecnorm"] == saved[0].value["vecnorm"], (resumed, saved[0].value)
    # saved rank 0's statistics, updated by the reset that starts the fresh trajectory (one observation each)
    assert all(n >= s for n, s in zip(resumed["vecnorm"], saved[0].value["vecnorm"])), (resumed, saved[0].value)
    assert resumed["vecnorm"] and min(saved[0].value["vecnorm"]) > 2
    assert resumed["next_min_count"] > saved[0].value["max_count"]  # counts go on from saved rank 0's


def test_a_collector_holding_complete_trajectories_is_not_resharded(tmp_path: Path) -> None:
    """``trajs_per_batch``: complete trajectories a collector has collected and not yielded are transitions; a
    world-size change dropped them without a word (the collector is reset). Refused on every rank, nothing changed."""
    path = str(tmp_path / "ckpt")
    (saved,) = launch(f"{S}:save_assembling_collector", 1, path)
    assert saved.value["held"] > 0
    results = launch(f"{S}:load_assembling_collector_resharded", 2, path)
    assert all(r.value["error"] is not None and r.value["unchanged"] for r in results), results
    assert any("complete trajectories it had not yielded" in r.value["message"] for r in results)
