"""A MultiAsyncCollector saved between two batches goes on collecting (torchrl 0.14's workers hung it).

The scenario runs in a child process under a timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCENARIO = textwrap.dedent(
    """
    import sys, warnings
    import torch
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiAsyncCollector
    from torchrl.envs import CatTensors, Compose, PendulumEnv, StepCounter, TransformedEnv, UnsqueezeTransform
    import torchrl_dcp as tdcp

    def make():
        return TransformedEnv(PendulumEnv(), Compose(
            UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
            CatTensors(["th", "thdot"], "observation", del_keys=False), StepCounter(20)))

    if __name__ == "__main__":
        path, action = sys.argv[1], sys.argv[2]
        policy = TensorDictModule(torch.nn.Linear(2, 1), ["observation"], ["action"])
        collector = MultiAsyncCollector([make, make], policy, frames_per_batch=1000, total_frames=-1)
        it = iter(collector)
        for _ in range(2):
            next(it)
        ckpt = tdcp.DistributedCheckpoint(collector=collector)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.save(path) if action == "save" else ckpt.load(path)
        assert any(issubclass(w.category, tdcp.InexactResumeWarning) for w in caught)
        sizes = [next(it).numel() for _ in range(4)]  # hung here: every worker waited for a message
        collector.shutdown()
        print("batches", sizes)
    """
)


@pytest.mark.parametrize("action", ["save", "load"])
def test_a_running_multi_async_collector_goes_on_after_a_save_or_load(tmp_path: Path, action: str) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    ckpt = tmp_path / "ckpt"
    for step in ["save", "load"] if action == "load" else ["save"]:  # a load: into a collector that is running
        try:
            out = subprocess.run(
                [sys.executable, str(script), str(ckpt), step], capture_output=True, text=True, timeout=150
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the collector hung after a {step} between two batches")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "batches [1000, 1000, 1000, 1000]" in out.stdout
