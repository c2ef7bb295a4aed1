"""Multi-turn episodes in whole jobs (``rollout.env``) under ``mpirun -np 2``, on a tiny random
policy whose end-of-turn token is likely (its output row scaled up), so that turns end on their own
and episodes run several turns: the trainer's logprobs over the whole multi-turn sequences equal
the engine's on the model's tokens, the turn metrics are reported, and a run resumed from a
checkpoint taken between steps goes on to the same metrics (SIGTERM's save and exit 75: test_resume
and test_async_rl)."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import DEMO_ARGS, DEMO_RECIPE, JobSpec, TinyModels, hosted_jobs, metric_records, resumed_pair, trainer_tp

pytestmark = [pytest.mark.e2e, pytest.mark.mpi, pytest.mark.slow]
ARGS = ("rollout.env=tests.envs:Continue", "rollout.max_turns=3", "rollout.max_tokens=12", "rollout.max_model_len=512",
        "trainer.total_steps=3", "algo.entropy_coef=0.01", "checkpoint.keep_last=3")


def save_chatty_policy(path: Path) -> Path:
    """conftest's tiny random policy, untied, with the end-of-turn token's output row scaled by 20,
    into ``path``: its logit is large whenever it is positive, so a turn ends after a few tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    trainer_tp.save_tiny_vllm(path, tied=False, max_position_embeddings=1024)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"][eos] *= 20.0
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@hosted_jobs
def agentic_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """``agentic_ref``, 3 steps of multi-turn episodes on the chatty policy, and ``agentic_run``: the
    same job resumed from ``agentic_ref``'s step-1 checkpoint."""
    model = f"model.path={save_chatty_policy(root / 'chatty_policy')}"
    return resumed_pair(root, "agentic", DEMO_RECIPE, [*DEMO_ARGS, model, *ARGS], step=1)


def test_multi_turn_episodes_train_on_the_model_tokens_and_resume_exactly(hosted):
    ref, run = hosted("agentic_ref"), hosted("agentic_run")
    records = metric_records(ref.out)
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["turns_mean"] > 1.5 and r["turns_max"] == 3  # several turns, the limit reached
        assert r["turns_end_max_turns"] > 0 and r["turns_env_tokens_mean"] > 0
        assert r["tool_calls_go"] > 0 and r["reward_mean"] > 0  # the environment's turn rewards
    # on-policy step 1: the trainer's logprobs of the model's tokens over whole 3-turn sequences
    # (environment tokens in the context, masked out) equal the engine's, turn by turn
    assert train[0]["logprob_diff_rollout_vs_train"] < 1e-3
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 3]
    # the reference's step-1 checkpoint (and its whole metrics.jsonl, which the resumed run must cut
    # back to step 1) resumed in a new job: the same records at every later step, episodes and all
    assert "resumed from" in run.log, run.log[-4000:]
    assert metric_records(run.out) == records
