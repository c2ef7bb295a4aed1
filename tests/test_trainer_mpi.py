"""tests/mpi/trainer_tp.py under mpirun: TP=3 (3 ranks; SmolLM2's 9 heads rule out TP=2), DP=2,
and DP=2 over a trainer subgroup of a 3-rank world, on tiny random models in SmolLM2's and Qwen2's
layouts (the real SmolLM2 is checked against transformers in test_trainer); PPO's critic (a value
head) at TP=3 and at PP=2 against transformers' hidden states x head.

Measured 2026-12-01 on the 2-core dev machine: tp ~18 s, dp ~10 s (with SmolLM2: 51 s, 22 s).
"""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("mode,ranks", [("tp", 3), ("dp", 2), ("subgroup", 3)])
def test_trainer_under_mpirun(shared_job, mode, ranks):
    """Each mode runs in conftest's shared job of its world size."""
    out = shared_job(f"ranks_{ranks}")
    assert out.count(f"] {mode} OK in ") == ranks, out[-3000:]
    critic = {"tp": "critic TP=3 PP=1: values", "dp": "critic TP=1 PP=2: values"}.get(mode)
    assert critic is None or out.count(critic) == ranks, out[-3000:]  # the critic vs transformers
