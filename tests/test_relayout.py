"""Resume on another TP or PP (yatt/checkpoint/relayout.py): a trained policy's checkpoint
resharded from TP 1, PP 1 to TP 3, PP 2 and back is the saved state bit for bit (weights, Adam
moments and steps, a bf16 run's fp32 main parameters), and the TP 3 shards are what the HF
mapping gives for the policy's exported weights. The whole jobs that resume this way are in
tests/test_resume.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import trainer_tp as ref
from yatt.checkpoint.relayout import SavedShards, relaid_states, reshard
from yatt.checkpoint.run_state import _model_state
from yatt.trainer.hf_mapping import hf_to_megatron, megatron_names, megatron_name_of, megatron_to_hf
from yatt.trainer.model import _stage_name


def _trained(path, dtype):
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    policy = MegatronPolicy(path, optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0, total_steps=6), dtype=dtype)
    for seed in (0, 1):
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
        policy.train_step([{"input_ids": ids, "mask": torch.ones(2, 12)}], ref.sum_logprob_loss)
    return policy


def _save(folder, tp: int, pp: int, shard) -> None:
    """Checkpoint files of the actor in layout (tp, pp): ``shard(t, s) -> (model, optim)``."""
    for kind in ("model", "optim"):
        (folder / kind).mkdir(parents=True, exist_ok=True)
    for t in range(tp):
        for s in range(pp):
            model, optim = shard(t, s)
            torch.save(model, folder / "model" / f"tp{t}_pp{s}.pt")
            torch.save(optim, folder / "optim" / f"tp{t}_pp{s}.pt")


def _optimizer(states: dict[str, dict], bf16: bool, scheduler: dict) -> dict:
    """An optimizer file as Megatron's optimizers write it (one param group), from name -> state."""
    names = list(states)
    inner = {"state": {i: {k: v for k, v in states[n].items() if k != "main"} for i, n in enumerate(names)},
             "param_groups": [{"lr": 0.0, "params": list(range(len(names)))}]}
    optimizer = {"optimizer": inner, "fp32_from_fp16_params": [[states[n]["main"] for n in names]]} if bf16 else inner
    return {"optimizer": optimizer, "scheduler": scheduler, "param_names": [[names]]}


def _state(policy) -> dict:
    out = {f"model.{k}": v.clone() for k, v in policy.module.state_dict().items() if isinstance(v, torch.Tensor)}
    optim = policy.optimizer.state_dict()
    for i, s in optim.get("optimizer", optim)["state"].items():
        out.update({f"state.{i}.{k}": v.clone() for k, v in s.items()})
    for g, group in enumerate(optim.get("fp32_from_fp16_params", [])):
        out.update({f"main.{g}.{j}": p.detach().clone() for j, p in enumerate(group)})
    return out


@pytest.mark.parametrize("model_type,tied,dtype", [("qwen2", False, torch.float32), ("llama", True, torch.bfloat16)],
                         ids=["qwen2-untied-fp32", "llama-tied-bf16"])
def test_a_checkpoint_resharded_to_tp3_pp2_and_back_is_the_saved_state(world1, tmp_path, model_type, tied, dtype):
    ref.save_tiny_hf(tmp_path / "hf", model_type, vocab_size=100, tied=tied)
    policy = _trained(tmp_path / "hf", dtype)
    model, optim = _model_state(policy)
    _save(tmp_path / "tp1", 1, 1, lambda t, s: (model, optim))
    saved = SavedShards(tmp_path / "tp1", "actor", policy.layout, 1)
    bf16 = dtype == torch.bfloat16
    kinds = ("exp_avg", "exp_avg_sq") + (("main",) if bf16 else ())

    wide = dataclasses.replace(policy.layout, tp=3)  # padded vocab 102
    exported = dict(policy.export_hf_weights())  # the weight sync's kernel: an independent path
    step = next(iter(optim["optimizer"].get("optimizer", optim["optimizer"])["state"].values()))["step"]

    def shard(t, s):
        by_mapping = dict(hf_to_megatron(exported, wide, t))
        params, states = {}, {}
        for name in megatron_names(wide):
            for local in _stage_name(name, wide, 2, s):
                params[local] = reshard(saved, name, "param", wide, t)
                torch.testing.assert_close(params[local].float(), by_mapping[name].float(), rtol=0, atol=0)
                states[local] = {"step": step.clone()} | {k: reshard(saved, name, k, wide, t) for k in kinds}
        return params, _optimizer(states, bf16, optim["scheduler"])

    _save(tmp_path / "tp3pp2", 3, 2, shard)
    back = torch.load(tmp_path / "tp3pp2" / "model" / "tp1_pp0.pt")
    assert back["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((6 + 2 * 3) * 16 // 3, 96)
    assert back["embedding.word_embeddings.weight"].shape == (34, 96)
    assert "output_layer.weight" in torch.load(tmp_path / "tp3pp2" / "model" / "tp0_pp1.pt")  # tied: the copy

    fresh = _trained(tmp_path / "hf", dtype)  # other weights and moments: trained on other batches
    fresh.train_step([{"input_ids": torch.arange(24).reshape(2, 12), "mask": torch.ones(2, 12)}], ref.sum_logprob_loss)
    before = _state(fresh)
    assert all(not torch.equal(before[k], v) for k, v in _state(policy).items() if k.startswith(("state.", "main.")))
    state, relaid = relaid_states(SavedShards(tmp_path / "tp3pp2", "actor", wide, 2), fresh, 0)
    fresh.load_model_state_dict(state)
    fresh.optimizer.load_state_dict(relaid["optimizer"])
    fresh.scheduler.num_steps = 0
    fresh.scheduler.load_state_dict(relaid["scheduler"])
    want, got = _state(policy), _state(fresh)
    assert got.keys() == want.keys() and any(k.startswith("state.") for k in want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert fresh.scheduler.num_steps == policy.scheduler.num_steps


def test_hf_names_map_back_to_their_megatron_parameter():
    layout = _small_layout()
    shapes = {"embedding.word_embeddings.weight": (12, 4), "output_layer.weight": (12, 4), "linear_qkv.weight": (8, 4),
              "linear_qkv.bias": (8,), "linear_proj.weight": (4, 4), "linear_fc1.weight": (12, 4),
              "linear_fc2.weight": (4, 6)}
    for name in megatron_names(layout):
        shape = next((v for k, v in shapes.items() if name.endswith(k)), (4,))
        for hf_name, _ in megatron_to_hf(name, [torch.zeros(shape)], layout):
            assert megatron_name_of(hf_name) == name
    with pytest.raises(KeyError, match="model.layers.0.mlp.act"):
        megatron_name_of("model.layers.0.mlp.act")


def _small_layout():
    from yatt.trainer.hf_mapping import Layout

    return Layout(num_layers=2, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2, ffn_hidden_size=6,
                  vocab_size=12, tied_embeddings=False, qkv_bias=True, tp=1)


def test_a_checkpoint_without_named_optimizer_states_is_refused(tmp_path):
    optim = {"optimizer": {"state": {}, "param_groups": []}, "scheduler": {}}
    _save(tmp_path, 1, 1, lambda t, s: ({"decoder.layers.0.input_layernorm.weight": torch.ones(4)}, optim))
    saved = SavedShards(tmp_path, "actor", _small_layout(), 1)
    with pytest.raises(ValueError, match=r"config key 'resume': .* before checkpoints named their optimizer states"):
        saved.state_entry("decoder.layers.0.input_layernorm.weight")


def test_lora_adapters_resharded_to_tp3_pp2_and_back_are_the_saved_ones(world1, tmp_path):
    """A LoRA policy's checkpoint (adapters on the four targets and their Adam moments, no base
    weights) resharded from TP 1, PP 1 to TP 3, PP 2 and back equals the saved state bit for bit;
    the TP 3 shards merge into the same PEFT adapter tensors as the TP 1 ones (an independent
    path: :func:`yatt.trainer.lora.peft_state`, the export's)."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.hf_mapping import global_param_name
    from yatt.trainer.lora import LoraSpec, is_adapter, peft_state

    ref.save_tiny_hf(tmp_path / "hf", "qwen2", vocab_size=100, tied=False)

    def trained(seeds):
        policy = MegatronPolicy(tmp_path / "hf", optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0, total_steps=6),
                                lora=LoraSpec(rank=2, alpha=4.0))
        for seed in seeds:
            ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
            policy.train_step([{"input_ids": ids, "mask": torch.ones(2, 12)}], ref.sum_logprob_loss)
        return policy

    policy = trained((0, 1))
    model, optim = _model_state(policy)
    assert len(model) == 4 * 2 * policy.layout.num_layers and all(is_adapter(k) for k in model)
    _save(tmp_path / "tp1", 1, 1, lambda t, s: (model, optim))
    saved = SavedShards(tmp_path / "tp1", "actor", policy.layout, 1)
    wide = dataclasses.replace(policy.layout, tp=3)
    step = next(iter(optim["optimizer"]["state"].values()))["step"]
    tp3: dict[int, dict[str, torch.Tensor]] = {t: {} for t in range(3)}

    def shard(t, s):
        params, states = {}, {}
        for name in model:  # PP 1: the global names
            for local in _stage_name(name, wide, 2, s):
                params[local] = tp3[t][global_param_name(local, wide, 2, s)] = reshard(saved, name, "param", wide, t)
                states[local] = {"step": step.clone()} | {k: reshard(saved, name, k, wide, t)
                                                          for k in ("exp_avg", "exp_avg_sq")}
        return params, _optimizer(states, False, optim["scheduler"])

    _save(tmp_path / "tp3pp2", 3, 2, shard)
    qkv_b = tp3[1]["decoder.layers.0.self_attention.linear_qkv.lora_B"]
    assert qkv_b.shape == (model["decoder.layers.0.self_attention.linear_qkv.lora_B"].shape[0] // 3, 2)
    assert tp3[2]["decoder.layers.0.mlp.linear_fc2.lora_B"].shape == model["decoder.layers.0.mlp.linear_fc2.lora_B"].shape
    want_peft, got_peft = peft_state([model], policy.layout), peft_state([tp3[t] for t in range(3)], wide)
    assert got_peft.keys() == want_peft.keys() and all(torch.equal(got_peft[k], v) for k, v in want_peft.items())

    fresh = trained((2,))  # other adapters and moments
    assert all(not torch.equal(_state(fresh)[k], v) for k, v in _state(policy).items() if k.startswith("state."))
    state, relaid = relaid_states(SavedShards(tmp_path / "tp3pp2", "actor", wide, 2), fresh, 0)
    assert state.keys() == model.keys()
    fresh.load_model_state_dict(state)
    fresh.optimizer.load_state_dict(relaid["optimizer"])
    fresh.scheduler.num_steps = 0
    fresh.scheduler.load_state_dict(relaid["scheduler"])
    want, got = _state(policy), _state(fresh)
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []
