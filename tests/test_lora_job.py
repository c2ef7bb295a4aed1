"""A LoRA job end to end (``trainer.lora`` and ``critic.lora``, PPO with GAE on the tiny policy,
a parity reward so every step trains): the engines get the merged weights (the rollout/trainer
logprob check), checkpoints hold adapters only and resume exactly (step 3 from step 2's checkpoint), and the
exports (PEFT adapter folder, merged folder, merged critic) load in transformers and give the
trainer's logprobs. Both jobs run in conftest's ``hosted`` fixture, with the other modules' jobs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import (DEMO_ARGS, DEMO_RECIPE, JobSpec, TinyModels, hosted_jobs, metric_records, resume_from,
                      resumed_pair)
from conftest import trainer_tp as ref

pytestmark = [pytest.mark.e2e, pytest.mark.mpi, pytest.mark.slow]
ARGS = ("trainer.total_steps=3", "trainer.lr=1e-3", "trainer.lora={rank: 4, alpha: 8}", "algo.estimator=gae",
        "algo.kl_in_reward=0.05",  # a reference policy: the base model, the adapters off
        "critic.enabled=true", "critic.lora={rank: 2, alpha: 2}",
        "reward.sources=[{name: parity, type: function, path: 'tests.reward_fns:parity', weight: 1.0}]")


@hosted_jobs
def lora_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """``lora_ref``, 3 steps, and ``lora_run``: the same job resumed from ``lora_ref``'s step-2 checkpoint;
    ``lora_tp2``: resumed from it with ``trainer.tp=2`` (the adapters resharded, DP 2 -> 1)."""
    args = [*DEMO_ARGS, f"model.path={models.policy}", *ARGS]
    pair = resumed_pair(root, "lora", DEMO_RECIPE, args, step=2)
    copy = resume_from(root / "lora_ref", root / "lora_tp2", 2)
    return pair | {"lora_tp2": JobSpec(DEMO_RECIPE, [*args, "trainer.tp=2"], copy=copy)}


def test_lora_job_syncs_merged_weights_resumes_exactly_and_exports(world1, hosted, tmp_path, tiny_policy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from yatt.export import export_checkpoint
    from yatt.trainer.actor import MegatronPolicy
    from yatt.trainer.lora import LoraSpec

    ref_job, run = hosted("lora_ref"), hosted("lora_run")
    first = ref_job.out
    train = [r for r in metric_records(first) if "reward_mean" in r]
    assert len(train) == 3 and all(r["grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in train)
    # the reference (the base: adapters off) equals the policy at step 1 and falls behind it after
    # (k1 of the rollout's logprobs to the reference's: step 1's is the engine/trainer rounding, ~1e-7)
    kls = [abs(r["reward_kl"]) for r in train]
    assert kls[0] < 1e-5 and all(kl > 1e-4 for kl in kls[1:]), kls
    # the engines' weights after each sync are the trainer's W + s B A
    assert all(r["logprob_diff_rollout_vs_train"] < 1e-4 for r in train), [r["logprob_diff_rollout_vs_train"] for r in train]
    step = first / "checkpoints" / "step_000003"
    adapters = torch.load(step / "model" / "tp0_pp0.pt", weights_only=True)
    assert adapters and all(k.endswith((".lora_A", ".lora_B")) for k in adapters)
    critic = torch.load(step / "model" / "critic_tp0_pp0.pt", weights_only=True)
    assert set(critic) - {k for k in critic if k.endswith((".lora_A", ".lora_B"))} == {"output_layer.weight"}

    # a run resumed from the first run's step-2 checkpoint (adapters, their optimizer state, base from
    # the HF folder again) trains step 3 exactly as the first run did
    assert "resumed from" in run.log, run.log[-4000:]
    resumed = [r for r in metric_records(run.out) if r["step"] == 3]
    assert resumed and resumed == [r for r in metric_records(first) if r["step"] == 3]

    # exports: PEFT folder, merged folder and the merged critic, against the trainer holding the checkpoint
    spec = LoraSpec(rank=4, alpha=8.0)
    policy = MegatronPolicy(tiny_policy, lora=spec)
    policy.load_model_state_dict(adapters)
    seqs = [torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 19)]
    mbs = [{"input_ids": s[None], "mask": torch.ones(1, len(s))} for s in seqs]
    trainer_lp = [lp for lp, _ in policy.compute_logprobs(mbs)]
    peft_dir = export_checkpoint(step, tmp_path / "adapter")
    merged_dir = export_checkpoint(step, tmp_path / "merged", merge=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in peft_dir.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32)
    models = {"peft": PeftModel.from_pretrained(base, peft_dir).eval(),
              "merged": AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()}
    for name, model in models.items():
        for lp, mb in zip(trainer_lp, mbs):
            with torch.no_grad():
                hf_lp, _ = ref.hf_logprobs_entropy(model, mb["input_ids"])
            assert (lp - hf_lp).abs().max().item() < 1e-4, name
    # python -m yatt.eval --checkpoint pushes the same merged weights into its engine
    from safetensors.torch import load_file

    from yatt.eval import checkpoint_weights

    merged = load_file(merged_dir / "model.safetensors")
    assert {n: t for n, t in checkpoint_weights(step, tiny_policy)}.keys() == merged.keys()
    assert all(torch.equal(t, merged[n]) for n, t in checkpoint_weights(step, tiny_policy))
    critic_dir = export_checkpoint(step, tmp_path / "critic", role="critic", merge=True)
    model = AutoModelForSequenceClassification.from_pretrained(critic_dir, dtype=torch.float32)
    assert torch.equal(model.score.weight, critic["output_layer.weight"])
    with pytest.raises(ValueError, match="--merge"):
        export_checkpoint(step, tmp_path / "critic_peft", role="critic")


def test_lora_adapters_resume_on_another_tp(hosted):
    """``lora_ref``'s step-2 checkpoint (TP 1, DP 2) resumed with ``trainer.tp=2`` (DP 1): the policy's
    and the critic's adapters and moments are resharded (``tests/test_relayout.py``: bit for bit),
    the engines get the merged weights of the resharded adapters (the rollout/trainer logprob
    check), and step 3 trains as the TP-1 run's did: the same rewards, the critic's loss and grad
    norm within 1e-3; the policy's grad norm within 1% (0.46% measured on 2026-12-07: at DP 1 the
    step's samples pack into other micro-batches, ``body_tokens_vs_padded`` 1.0 -> 0.70)."""
    ref_job, tp2 = hosted("lora_ref"), hosted("lora_tp2")
    assert "was saved with TP 1, PP 1 and this job has TP 2, PP 1: each rank rebuilds" in tp2.log, tp2.log[-4000:]
    got, want = ([r for r in metric_records(job.out) if "reward_mean" in r] for job in (tp2, ref_job))
    assert [r["step"] for r in got] == [1, 2, 3] and got[:2] == want[:2]
    assert got[2]["logprob_diff_rollout_vs_train"] < 1e-4, got[2]
    for key, rel in (("reward_mean", 1e-6), ("critic_grad_norm", 1e-3), ("value_loss", 1e-3), ("grad_norm", 1e-2)):
        assert got[2][key] == pytest.approx(want[2][key], rel=rel), (key, got[2][key], want[2][key])
