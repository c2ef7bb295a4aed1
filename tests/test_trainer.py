"""Single-process tests of the Megatron trainer (world 1, TP=1) on the real SmolLM2-135M, fp32.

torch.distributed and Megatron's parallel_state are process-global: one module-scoped fixture
initialises them (world 1, TP=1) and the models are loaded once per module.
Measured (2-core CPU): logits max |diff| vs HF 5e-5 (|logits| <= 31), logprob / entropy 3e-5,
grad norm relative diff vs HF autograd 6e-5.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import trainer_tp as ref


LOGITS_ATOL = 2e-4


@pytest.fixture(scope="module")
def smol(world1):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yatt.assets.model import resolve_model

    path = resolve_model(ref.MODEL)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def frozen(smol):
    from yatt.trainer.actor import MegatronPolicy

    return MegatronPolicy(smol[0])


@pytest.fixture(scope="module")
def micro_batches(smol):
    return ref.make_micro_batches(smol[2], ref.TEXTS, per_mb=2)


def test_cpu_layer_version_pin_and_idempotence(world1, monkeypatch):
    from yatt.trainer import megatron_cpu

    assert megatron_cpu.apply() is True and megatron_cpu.apply() is True
    monkeypatch.setattr(megatron_cpu, "_applied", False)
    monkeypatch.setattr(megatron_cpu, "version", lambda name: "0.17.0")
    with pytest.raises(RuntimeError, match="0.16.1"):
        megatron_cpu.apply()


def test_cpu_layer_clips_gradients_in_place(world1):
    """Megatron's clip by total norm, through the CPU layer's in-place scaling, scales every
    gradient by ``max_norm / (norm + 1e-6)`` in place (same storage), and leaves them alone
    under the norm; two distinct lists are still a copy ``dst = src * scale``."""
    from megatron.core.optimizer import clip_grads

    from yatt.trainer import megatron_cpu

    megatron_cpu.apply()
    assert clip_grads.multi_tensor_scale_impl is megatron_cpu._scale_in_place
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300, 1)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before, storage = [p.grad.clone() for p in params], [p.grad.data_ptr() for p in params]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    for p, g, ptr in zip(params, before, storage):
        torch.testing.assert_close(p.grad, g * (1.0 / (4.0 + 1e-6)), rtol=0, atol=0)
        assert p.grad.data_ptr() == ptr
    unclipped = [p.grad.clone() for p in params]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, unclipped))
    src, dst = [torch.full((3,), 2.0)], [torch.zeros(3)]
    megatron_cpu._scale_in_place(0, None, [src, dst], 0.5)
    assert torch.equal(dst[0], torch.ones(3)) and torch.equal(src[0], torch.full((3,), 2.0))
    megatron_cpu._scale_in_place(0, None, [[], []], 0.5)  # no gradients on this rank: nothing to do


def test_cpu_layer_tiny_gpt_trains_one_step(world1):
    """Megatron's own stack (GPTModel, DDP, optimizer, schedule) runs a step on CPU."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, hidden_dropout=0.1, attention_dropout=0.1,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        model_parallel_cuda_manual_seed(7)
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128,
                         max_sequence_length=32, position_embedding_type="rope")
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.finalize_model_grads_func = finalize_model_grads
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
        before = [p.detach().clone() for p in model.parameters()]
        ids = torch.randint(0, 128, (2, 16))

        def step(data, m):
            x = next(data)
            out = m(x, torch.arange(16).expand_as(x), None, labels=x)  # [B, T] per-token loss
            return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

        model.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids]), model=[model],
                                          num_microbatches=1, seq_length=16, micro_batch_size=2)
        ok, grad_norm, _ = opt.step()
    assert ok and math.isfinite(out[0]["loss"].item()) and math.isfinite(grad_norm) and grad_norm > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_logits_match_transformers(smol, frozen):
    _, hf, tok = smol
    ids = torch.tensor([tok(ref.TEXTS[0])["input_ids"]])
    with torch.no_grad():
        ours = frozen.module(ids, torch.arange(ids.shape[1])[None], None)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max().item() < LOGITS_ATOL


def test_compute_logprobs_match_transformers(smol, frozen, micro_batches):
    out = frozen.compute_logprobs(micro_batches)
    assert len(out) == len(micro_batches)
    for (lp, ent), mb in zip(out, micro_batches):
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == mb["input_ids"].shape
        assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
        with torch.no_grad():
            ref_lp, ref_ent = ref.hf_logprobs_entropy(smol[1], mb["input_ids"])
        assert (lp - ref_lp).abs().max().item() < ref.LOGPROB_ATOL
        assert (ent - ref_ent).abs().max().item() < ref.LOGPROB_ATOL


def test_hf_megatron_hf_round_trip_is_bit_identical(smol, frozen):
    from yatt.trainer.hf_mapping import hf_to_megatron, layout_from_hf, megatron_to_hf
    from yatt.trainer.model import SafetensorsState, read_hf_config

    path = smol[0]
    ckpt = SafetensorsState(path)
    hf_state = {name: ckpt[name] for name in ckpt}
    for tp in (1, 3):
        layout = layout_from_hf(read_hf_config(path), tp)
        per_rank = [dict(hf_to_megatron(hf_state, layout, r)) for r in range(tp)]
        back = dict(kv for name in per_rank[0] for kv in megatron_to_hf(name, [s[name] for s in per_rank], layout))
        assert back.keys() == hf_state.keys() - {"lm_head.weight"}  # tied: embed_tokens only
        assert all(torch.equal(back[n], hf_state[n]) for n in back)
    exported = dict(frozen.export_hf_weights())  # through the loaded GPTModel
    assert exported.keys() == back.keys() and all(torch.equal(exported[n], hf_state[n]) for n in exported)


def test_round_trip_padded_vocab_qkv_bias_untied():
    """Vocab 10 over TP=3 (padded to 12), Qwen2-style QKV bias, untied lm_head; shard shapes."""
    from yatt.trainer.hf_mapping import Layout, hf_to_megatron, megatron_to_hf

    L = Layout(num_layers=1, hidden_size=8, num_heads=6, num_kv_heads=3, head_dim=4, ffn_hidden_size=9,
               vocab_size=10, tied_embeddings=False, qkv_bias=True, tp=3)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (10, 8), "lm_head.weight": (10, 8), "model.norm.weight": (8,),
              "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
              "model.layers.0.self_attn.q_proj.weight": (24, 8), "model.layers.0.self_attn.k_proj.weight": (12, 8),
              "model.layers.0.self_attn.v_proj.weight": (12, 8), "model.layers.0.self_attn.q_proj.bias": (24,),
              "model.layers.0.self_attn.k_proj.bias": (12,), "model.layers.0.self_attn.v_proj.bias": (12,),
              "model.layers.0.self_attn.o_proj.weight": (8, 24), "model.layers.0.mlp.gate_proj.weight": (9, 8),
              "model.layers.0.mlp.up_proj.weight": (9, 8), "model.layers.0.mlp.down_proj.weight": (8, 9)}
    hf_state = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    per_rank = [dict(hf_to_megatron(hf_state, L, r)) for r in range(3)]
    assert per_rank[2]["embedding.word_embeddings.weight"].shape == (4, 8)
    assert (per_rank[2]["output_layer.weight"][2:] == 0).all()  # padding rows
    qkv = per_rank[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (16, 8)  # one KV group: 2 q heads + k + v, head dim 4
    assert torch.equal(qkv[8:12], hf_state["model.layers.0.self_attn.k_proj.weight"][4:8])
    assert per_rank[0]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (6, 8)
    back = dict(kv for name in per_rank[0] for kv in megatron_to_hf(name, [s[name] for s in per_rank], L))
    assert back.keys() == hf_state.keys() and all(torch.equal(back[n], hf_state[n]) for n in back)


@pytest.mark.parametrize("model_type,tied", [("qwen2", False), ("llama", True)])
def test_tiny_random_models_match_transformers(world1, tmp_path, model_type, tied):
    from yatt.trainer.model import build_gpt_model

    hf = ref.save_tiny_hf(tmp_path, model_type, vocab_size=100, tied=tied)
    model, layout = build_gpt_model(tmp_path)
    assert layout.qkv_bias == (model_type == "qwen2") and layout.tied_embeddings == tied
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids, torch.arange(12).expand_as(ids), None) - hf(ids).logits).abs().max().item()
    assert diff < 1e-5, diff


def test_layout_rejects_what_it_cannot_map():
    from yatt.trainer.hf_mapping import layout_from_hf

    smol = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
            "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}
    with pytest.raises(ValueError, match="KV heads"):
        layout_from_hf(smol, tp=2)
    with pytest.raises(NotImplementedError):
        layout_from_hf({**smol, "model_type": "mistral"})
    with pytest.raises(NotImplementedError):
        layout_from_hf({**smol, "hidden_act": "gelu"})


def test_train_step_semantics(smol, frozen, micro_batches):
    """Gradient = d/dθ of the SUM over micro-batches; loss = -sum logprob raises logprobs; lr schedule."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    path, hf, _ = smol
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.train_step(micro_batches, ref.sum_logprob_loss)
    actor = MegatronPolicy(path, optim=OptimConfig(lr=1e-5, min_lr=1e-6, total_steps=2))

    def total(policy):
        return sum((lp * mb["mask"]).sum().item() for (lp, _), mb in zip(policy.compute_logprobs(micro_batches), micro_batches))

    before = total(actor)
    hf_norm = ref.hf_grad_norm(hf, micro_batches, ref.sum_logprob_loss)
    stats = actor.train_step(micro_batches, ref.sum_logprob_loss)
    assert set(stats) == {"grad_norm", "lr", "update_skipped", "loss", "tokens"} and stats["update_skipped"] == 0
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert abs(stats["grad_norm"] - hf_norm) <= ref.GRAD_NORM_RTOL * hf_norm, (stats["grad_norm"], hf_norm)
    assert stats["lr"] == pytest.approx(1e-5)
    assert stats["loss"] == pytest.approx(-before, rel=1e-5)
    assert stats["tokens"] == sum(mb["mask"].sum().item() for mb in micro_batches)
    after = total(actor)
    assert after > before + 1.0, (before, after)
    # cosine half-way at step 1 of 2: min + (max - min) / 2
    assert actor.train_step(micro_batches[:1], ref.sum_logprob_loss)["lr"] == pytest.approx(5.5e-6)


def test_bf16_policy_trains(world1, tmp_path):
    """bf16 params (Float16Module + fp32 main params): finite step, logprobs near fp32 HF."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    hf = ref.save_tiny_hf(tmp_path, "llama", vocab_size=100, tied=True)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-3), dtype=torch.bfloat16)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mbs = [{"input_ids": ids, "mask": torch.ones(2, 12)}]
    (lp, _), = policy.compute_logprobs(mbs)
    with torch.no_grad():
        ref_lp, _ = ref.hf_logprobs_entropy(hf, ids)
    assert lp.dtype == torch.float32 and (lp - ref_lp).abs().max().item() < 0.1
    stats = policy.train_step(mbs, ref.sum_logprob_loss)
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert dict(policy.export_hf_weights())["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_guard_skips_a_planted_nan_and_keeps_the_weights(world1, tmp_path):
    """A NaN loss gives a non-finite grad norm: the guard skips the update (weights and lr
    schedule untouched); the next clean step is applied, with the same grad norm as unguarded."""
    from yatt.algos.guard import StabilityGuard
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    ref.save_tiny_hf(tmp_path, "llama", vocab_size=100, tied=True)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-3, min_lr=1e-4, total_steps=4))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mbs = [{"input_ids": ids, "mask": torch.ones(2, 12)}]

    def nan_loss(logprobs, entropy, mb):
        loss, stats = ref.sum_logprob_loss(logprobs, entropy, mb)
        return loss * float("nan"), stats

    before = {k: v.clone() for k, v in policy.export_hf_weights()}
    guard = StabilityGuard()
    stats = policy.train_step(mbs, nan_loss, guard)
    assert stats["update_skipped"] == 1.0 and not math.isfinite(stats["grad_norm"]) and guard.skipped_non_finite == 1
    assert all(torch.equal(v, before[k]) for k, v in policy.export_hf_weights())
    clean = policy.train_step(mbs, ref.sum_logprob_loss, guard)
    assert clean["update_skipped"] == 0.0 and math.isfinite(clean["grad_norm"]) and clean["grad_norm"] > 0
    assert clean["lr"] == pytest.approx(1e-3)  # the skipped step did not advance the schedule
    assert any(not torch.equal(v, before[k]) for k, v in policy.export_hf_weights())
    assert list(guard.history) == [clean["grad_norm"]]


def _prompt_masked(micro_batches):
    """Micro-batches whose ``response_mask`` covers only the second half of each sequence."""
    out = []
    for mb in micro_batches:
        half = (mb["mask"].sum(1, keepdim=True) / 2).ceil()
        resp = mb["mask"] * (torch.arange(mb["mask"].shape[1]) >= half)
        out.append({**mb, "response_mask": resp})
    return out


def test_response_only_scoring_matches_full_forward(smol, frozen, micro_batches):
    """With a response_mask the output layer runs on response positions only: same numbers there."""
    masked = _prompt_masked(micro_batches)
    for (lp, ent), (full_lp, full_ent), mb in zip(frozen.compute_logprobs(masked), frozen.compute_logprobs(micro_batches), masked):
        m = mb["response_mask"] > 0
        assert m.any() and (lp[~m] == 0).all() and (ent[~m] == 0).all()
        assert (lp[m] - full_lp[m]).abs().max().item() < 1e-5
        assert (ent[m] - full_ent[m]).abs().max().item() < 1e-5


def test_response_only_gradient_matches_transformers(smol):
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    path, hf, tok = smol
    masked = _prompt_masked(ref.make_micro_batches(tok, ref.TEXTS, per_mb=2))

    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb["response_mask"]).sum()
        return loss, {"loss": loss.detach()}

    hf_norm = ref.hf_grad_norm(hf, masked, loss_fn)
    stats = MegatronPolicy(path, optim=OptimConfig(lr=1e-6)).train_step(masked, loss_fn)
    assert abs(stats["grad_norm"] - hf_norm) <= ref.GRAD_NORM_RTOL * hf_norm, (stats["grad_norm"], hf_norm)


def test_adamw_runs_torchs_fused_kernel_with_adamws_update(world1, tmp_path, monkeypatch):
    """The trainer's AdamW (Megatron-Core's torch fallback) is switched to torch's fused kernel;
    its update equals the per-tensor AdamW's on the same parameters and gradients."""
    import torch.optim.adam as adam_mod

    from yatt.trainer.actor import MegatronPolicy, OptimConfig, _fuse_adam

    calls = []
    fused = adam_mod._fused_adam
    monkeypatch.setattr(adam_mod, "_fused_adam", lambda *a, **k: calls.append(1) or fused(*a, **k))
    ref.save_tiny_hf(tmp_path, "llama", vocab_size=100, tied=True)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-3, weight_decay=0.1))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    assert policy.train_step([{"input_ids": ids, "mask": torch.ones(2, 12)}], ref.sum_logprob_loss)["grad_norm"] > 0
    assert calls, "the policy's optimizer step did not run the fused kernel"

    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(5, 7, generator=gen), torch.randn(11, generator=gen)]
    twins = [[torch.nn.Parameter(p.clone()) for p in params] for _ in range(2)]
    opts = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in twins]
    _fuse_adam(type("Wrapped", (), {"optimizer": opts[1]})())
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for ps, opt in zip(twins, opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(*twins):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opts[1].param_groups[0]["fused"] and not opts[0].param_groups[0]["fused"]


@pytest.mark.parametrize("uses", ["logprob", "entropy", "both"])
def test_vocab_parallel_logprob_entropy_gradients_equal_autograds(world1, uses):
    """Logprobs, entropy and their gradients (yatt.trainer.actor._VocabParallelLogprobEntropy,
    one pass over the logits) equal autograd's through log_softmax, whether the loss uses the
    logprobs, the entropy (a bonus) or both; padded vocabulary ids get probability 0 and no
    gradient. The logits row (11 ids) is not a multiple of the dot product's chunk."""
    from yatt.trainer.actor import vocab_parallel_logprobs_entropy

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen)).requires_grad_(True)
    w_lp, w_ent = torch.rand(2, 5, generator=gen), torch.rand(2, 5, generator=gen)
    targets = torch.randint(0, 9, (2, 5), generator=gen)
    lp, ent = vocab_parallel_logprobs_entropy(logits.clone(), targets, vocab_size=9, entropy_grad=uses != "logprob")
    loss = {"logprob": (lp * w_lp).sum(), "entropy": (ent * w_ent).sum(),
            "both": (lp * w_lp).sum() + (ent * w_ent).sum()}[uses]
    loss.backward()
    ours, logits.grad = logits.grad, None
    logp = torch.log_softmax(logits[..., :9], -1)
    ref_lp, ref_ent = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
    {"logprob": (ref_lp * w_lp).sum(), "entropy": (ref_ent * w_ent).sum(),
     "both": (ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()}[uses].backward()
    torch.testing.assert_close(lp, ref_lp.detach())
    torch.testing.assert_close(ent, ref_ent.detach())
    torch.testing.assert_close(ours, logits.grad)
    assert not vocab_parallel_logprobs_entropy(logits.clone(), targets, 9)[1].requires_grad  # no bonus, no graph


def test_row_dot_is_the_plain_sum_of_products():
    """The chunked dot product over a vocabulary-sized row equals the fp64 sum to fp32 rounding
    (a single 49k-element dot product in fp32 is off by ~4e-5 relative)."""
    from yatt.trainer.actor import _row_dot

    gen = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(4, 49152, generator=gen)
    z -= z.amax(-1, keepdim=True)
    ref = (z.double().exp() * z.double()).sum(-1)
    torch.testing.assert_close(_row_dot(z.exp(), z).double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_full_recompute_gives_the_same_update(world1, tmp_path, model_type):
    """``recompute=True`` (Megatron-Core's full activation recompute, each layer checkpointed):
    the same loss, grad norm and weights after one optimizer step as storing the activations."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    ref.save_tiny_hf(tmp_path, model_type, vocab_size=100, tied=True)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mbs = [{"input_ids": ids, "mask": torch.ones(2, 12)}]
    runs = []
    for recompute in (False, True):
        policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-3), recompute=recompute)
        calls = []
        policy.module.decoder.layers[0].register_forward_hook(lambda *_: calls.append(1))
        stats = policy.train_step(mbs, ref.sum_logprob_loss)
        assert len(calls) == (2 if recompute else 1)  # recomputed in the backward pass
        runs.append((stats, dict(policy.export_hf_weights())))
    (plain, w_plain), (recomputed, w_recomputed) = runs
    assert recomputed["grad_norm"] > 0 and recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    assert max((w_recomputed[k] - w_plain[k]).abs().max().item() for k in w_plain) < 1e-6
