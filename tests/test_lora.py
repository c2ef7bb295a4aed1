"""LoRA on the Megatron trainer (yatt/trainer/lora.py), world 1, TP=1, fp32, tiny random models.

The reference is PEFT's LoRA on the transformers model, given the same adapters through
:func:`yatt.trainer.lora.peft_state` (what the exporter writes): logprobs and the grad norm of one
step must match it, the engines' merged weights must give the same logprobs, and only the adapters
may move. tests/mpi/lora_tp.py (helpers here) checks the same at TP=2 and PP=2.
"""
from __future__ import annotations

import pytest
import torch

from conftest import _mpi_script
from conftest import trainer_tp as ref

lora_ref = _mpi_script("lora_tp")  # the PEFT reference
adapter_shard, randomise_b = lora_ref.adapter_shard, lora_ref.randomise_b


@pytest.mark.parametrize("model_type,tied,targets", [("llama", True, None), ("qwen2", False, ("linear_qkv", "linear_fc2"))])
def test_lora_policy_matches_peft_and_syncs_merged_weights(world1, tmp_path, model_type, tied, targets):
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import TARGETS, BaseReference, LoraSpec

    ref.save_tiny_hf(tmp_path, model_type, vocab_size=100, tied=tied)
    spec = LoraSpec(rank=4, alpha=8.0, targets=targets or TARGETS, seed=3)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2), lora=spec)
    trained = {n for n, p in policy.module.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith((".lora_A", ".lora_B")) for n in trained)
    assert len(trained) == 2 * len(spec.targets) * 2  # 2 layers
    mbs = ref.padded_micro_batches([[7, 12], [9]], 100, seed=1)

    # B = 0: the base model exactly
    plain = MegatronPolicy(tmp_path)
    for (lp, _), (base_lp, _) in zip(policy.compute_logprobs(mbs), plain.compute_logprobs(mbs)):
        assert torch.equal(lp, base_lp)

    randomise_b(policy, seed=4)
    # the reference policy of a LoRA run is the base model: the policy with its adapters off
    for (lp, _), (base_lp, _) in zip(BaseReference(policy).compute_logprobs(mbs), plain.compute_logprobs(mbs)):
        assert torch.equal(lp, base_lp)
    assert not torch.equal(policy.compute_logprobs(mbs)[0][0], plain.compute_logprobs(mbs)[0][0])
    lora_ref.check_against_peft(policy, tmp_path, spec, [adapter_shard(policy)])


def test_lora_state_is_the_adapters_alone_and_loads_back(world1, tmp_path):
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import LoraSpec

    ref.save_tiny_hf(tmp_path, "llama", vocab_size=100, tied=True)
    spec = LoraSpec(rank=2, alpha=4.0)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2), lora=spec)
    randomise_b(policy, seed=5)
    state = policy.model_state_dict()
    assert set(state) == {n for n, _ in policy.module.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
    other = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2), lora=spec)
    other.load_model_state_dict(state)
    mbs = ref.padded_micro_batches([[6, 10]], 100, seed=2)
    assert torch.equal(policy.compute_logprobs(mbs)[0][0], other.compute_logprobs(mbs)[0][0])
    with pytest.raises(ValueError, match="trainer.lora"):
        MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2)).load_model_state_dict(state)
    with pytest.raises(ValueError, match="trainer.lora"):
        MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2),
                       lora=LoraSpec(rank=2, targets=("linear_qkv",))).load_model_state_dict(state)


def test_lora_critic_trains_its_value_head_whole(world1, tmp_path):
    from yatt.trainer.actor import OptimConfig
    from yatt.trainer.critic import MegatronCritic
    from yatt.trainer.lora import LoraSpec

    ref.save_tiny_hf(tmp_path, "llama", vocab_size=100, tied=True)
    critic = MegatronCritic(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2), lora=LoraSpec(rank=2))
    trained = {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert "output_layer.weight" in trained and all(n.endswith((".lora_A", ".lora_B")) for n in trained - {"output_layer.weight"})
    assert "output_layer.weight" in critic.model_state_dict()


def test_lora_config_is_checked():
    from yatt.config import Config
    from yatt.trainer.lora import LoraSpec, add_adapters

    with pytest.raises(ValueError, match="trainer.lora.dropout"):
        Config.model_validate({"trainer": {"tp": 2, "lora": {"dropout": 0.1}}})
    with pytest.raises(ValueError, match="trainer.lora.targets"):
        Config.model_validate({"trainer": {"lora": {"targets": ["q_proj"]}}})
    with pytest.raises(ValueError, match="critic.lora"):
        Config.model_validate({"critic": {"lora": {"rank": 4}}})  # the critic is off
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        add_adapters(torch.nn.Module(), LoraSpec(targets=("q_proj",)), tp=1, tp_rank=0)


@pytest.mark.mpi
@pytest.mark.slow
def test_lora_at_tp2_and_pp2_matches_peft(shared_job):
    """tests/mpi/lora_tp.py in conftest's shared 2-rank job (~7 s of it, 2026-12-06)."""
    out = shared_job("ranks_2")
    assert out.count("] lora tp=2 OK in ") == 2 and out.count("] lora pp=2 OK in ") == 2, out[-3000:]


def test_lora_on_a_bf16_base_trains_the_adapters_alone(world1, tmp_path):
    """model.dtype=bfloat16: the frozen base held in bf16 (half the memory), the adapters trained
    through fp32 main parameters; the sync's merged weights come in bf16."""
    import math

    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import LoraSpec

    ref.save_tiny_hf(tmp_path, "llama", vocab_size=100, tied=True)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2), dtype=torch.bfloat16,
                            lora=LoraSpec(rank=2))
    base = {n: p.detach().clone() for n, p in policy.module.named_parameters() if not p.requires_grad}
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    before = adapter_shard(policy)
    stats = policy.train_step(ref.padded_micro_batches([[6, 10]], 100, seed=2), ref.sum_logprob_loss)
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert all(not torch.equal(a, before[n]) for n, a in adapter_shard(policy).items() if n.endswith(".lora_B"))
    assert all(torch.equal(p, base[n]) for n, p in policy.module.named_parameters() if not p.requires_grad)
    assert all(t.dtype == torch.bfloat16 for _, t in policy.export_hf_weights())
