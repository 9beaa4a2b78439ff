"""The generated adversarial suite on 2 real ranks (gloo): every mutation of ``tests/test_adversarial.py``, on a
replicated and on a per-rank component, forged into a 2-rank checkpoint (see ``scenarios_adversarial.py``)."""

from __future__ import annotations

from pathlib import Path

from tests import test_adversarial as adv
from tests_distributed.launch import launch

S = "tests_distributed.scenarios_adversarial"
PER_RANK = ("replay_buffer", "prioritized", "rng", "generator")
REPLICATED = ("module", "chunked", "optimizer", "dict", "tensordict")


def cases() -> list[list[str]]:
    """Each mutation on the first kind it applies to of each placement (directories: what 2 ranks write)."""
    out = []
    for name, m in sorted(adv.MUTATIONS.items()):
        if "directory" not in m.backends:
            continue
        for kinds in (PER_RANK, REPLICATED):
            kind = next((k for k in kinds if m.applies(k)), None)
            if kind is not None:
                out.append([kind, name])
    return out


def test_a_forged_two_rank_checkpoint_never_becomes_the_state_of_any_rank(tmp_path: Path) -> None:
    launch(f"{S}:save_pristine", 2, str(tmp_path))
    todo = cases()
    assert len(todo) > 150
    results = launch(f"{S}:run_cases", 2, str(tmp_path), todo, timeout=900)
    problems: list[str] = []
    for i in range(len(todo)):
        per_rank = [r.value[i] for r in results]
        case = per_rank[0]["case"]
        refused = [bool(r["error"]) for r in per_rank]
        if per_rank[0]["unread"]:  # only .metadata is forged: every rank restores the saved state, verify refuses
            if any(refused):
                problems.append(f"{case}: a load refused a .metadata it does not read: {per_rank[0]['error']}")
            if "metadata" not in str(per_rank[0]["verify_error"]):
                problems.append(f"{case}: verify does not refuse the forged .metadata: {per_rank[0]['verify_error']}")
            problems += [f"{case}: rank {rank}: {p}" for rank, r in enumerate(per_rank) for p in r["problems"]]
            continue
        if any(refused) and not all(refused):
            problems.append(f"{case}: refused on some ranks only: {[r['error'] for r in per_rank]}")
            continue
        if all(refused):
            for rank, r in enumerate(per_rank):
                if not r["checkpoint_error"]:
                    problems.append(f"{case}: rank {rank} raised {r['error']}")
                if r["changed"]:
                    problems.append(f"{case}: a refused load changed {r['changed']} on rank {rank}: {r['error']}")
            if not any(n in r["error"] for r in per_rank for n in r["names"]):
                problems.append(f"{case}: no rank's error names any of {per_rank[0]['names']}: {per_rank[0]['error']}")
            if per_rank[0]["verify_error"] is None and not per_rank[0]["compatibility"]:
                problems.append(f"{case}: verify accepts what load refuses: {per_rank[0]['error']}")
        else:
            if per_rank[0]["must_refuse"]:
                problems.append(f"{case}: the load accepted a forgery the format promises to refuse")
            if per_rank[0]["verify_error"] is not None and not per_rank[0]["tools_only"]:
                problems.append(f"{case}: load accepted what verify refuses: {per_rank[0]['verify_error']}")
            problems += [f"{case}: rank {rank}: {p}" for rank, r in enumerate(per_rank) for p in r["problems"]]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
