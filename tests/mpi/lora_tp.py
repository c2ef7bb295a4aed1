"""LoRA on the Megatron trainer at TP=2 and at PP=2 against PEFT on transformers (fp32, tiny random Qwen2 with
4 heads / 2 KV heads, QKV bias, untied), and the PEFT reference that tests/test_lora.py uses.

    mpirun -np 2 python tests/mpi/lora_tp.py

On both ranks: each adapter's split matrix is laid out as its layer's weight (``lora_B`` of
linear_qkv / linear_fc1, ``lora_A`` of linear_proj / linear_fc2), the other replicated and equal on
both; the adapters are TP-independent (``A`` gathered = the TP=1 draw); logprobs, the grad norm
of one step and the merged weights of the sync agree with PEFT holding the gathered adapters; the
base weights do not move. Then the same at PP=2 (tied embeddings). Asserts; exits non-zero on failure.
"""
from __future__ import annotations

import math
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import trainer_tp as ref  # noqa: E402  (tiny models, the transformers reference)

LOGPROB_ATOL = 1e-4  # as tests/mpi/trainer_tp.py against transformers
GRAD_NORM_RTOL = 5e-4


def randomise_b(policy, seed: int) -> None:
    """Nonzero ``lora_B`` everywhere (B starts at zero, which would hide a wrong ``B A``)."""
    from yatt.trainer.lora import adapted_layers

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in adapted_layers(policy.module):
            layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape, generator=gen))


def adapter_shard(policy) -> dict[str, torch.Tensor]:
    """This rank's adapters under global Megatron names."""
    from yatt.trainer.hf_mapping import global_param_name

    return {global_param_name(n, policy.layout, policy.pp, policy.stage): p.detach().clone()
            for n, p in policy.module.named_parameters() if n.endswith((".lora_A", ".lora_B"))}


def shared_a_grad_norm(model, micro_batches, loss_fn) -> float:
    """The grad norm of ``loss_fn`` summed over micro-batches in YATT's parametrisation, from the
    PEFT model's autograd: PEFT gives q/k/v (and gate/up) each its own copy of a fused layer's
    shared ``A``, so the shared ``A``'s gradient is the sum of theirs; ``B`` gradients are as they are."""
    from yatt.trainer.lora import HF_MODULES

    fused = {m.rsplit(".", 1)[1]: target for target, modules in HF_MODULES.items() for m in modules}
    model.zero_grad()
    for mb in micro_batches:
        lp, ent = ref.hf_logprobs_entropy(model, mb["input_ids"])
        loss_fn(lp, ent.detach(), mb)[0].backward()
    a_sums, total = {}, 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".lora_A." in name:
            layer, module = name.split(".layers.")[1].split(".")[0], name.split(".lora_A.")[0].rsplit(".", 1)[1]
            key = (layer, fused[module])
            a_sums[key] = a_sums.get(key, 0) + p.grad.double()
        else:
            total += float((p.grad.double() ** 2).sum())
    model.zero_grad()
    return math.sqrt(total + sum(float((g ** 2).sum()) for g in a_sums.values()))


def peft_model(hf_path, spec, shards, layout):
    """transformers' model of ``hf_path`` under PEFT LoRA holding the policy's adapters."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from yatt.trainer.lora import peft_config, peft_state

    c = peft_config(spec.rank, spec.alpha, 0.0, spec.targets, str(hf_path))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32),
                           LoraConfig(r=c["r"], lora_alpha=c["lora_alpha"], target_modules=c["target_modules"]))
    result = set_peft_model_state_dict(model, peft_state(shards, layout))
    assert not result.unexpected_keys
    return model


def _assert_logprobs(policy, model, mbs) -> None:
    for (lp, _), mb in zip(policy.compute_logprobs(mbs), mbs):
        with torch.no_grad():
            hf_lp, _ = ref.hf_logprobs_entropy(model, mb["input_ids"])
        assert (lp - hf_lp).abs().max().item() < LOGPROB_ATOL


def check_against_peft(policy, path, spec, shards) -> None:
    """The LoRA ``policy`` (nonzero ``B``) against PEFT holding its adapters (``shards``: every TP
    rank's :func:`adapter_shard`): logprobs; the grad norm of one step; only the adapters move;
    the weight sync's tensors are ``W + s B A`` (transformers loads them and agrees with the
    trainer), written into temporaries, not the weights."""
    from transformers import AutoModelForCausalLM

    mbs = ref.padded_micro_batches([[7, 12], [9]], 100, seed=1)
    hf = peft_model(path, spec, shards, policy.layout)
    _assert_logprobs(policy, hf, mbs)
    hf_norm = shared_a_grad_norm(hf, mbs, ref.sum_logprob_loss)
    base = {n: p.detach().clone() for n, p in policy.module.named_parameters() if not p.requires_grad}
    adapters = adapter_shard(policy)
    stats = policy.train_step(mbs, ref.sum_logprob_loss)
    assert math.isclose(stats["grad_norm"], hf_norm, rel_tol=GRAD_NORM_RTOL), (stats["grad_norm"], hf_norm)
    assert all(not torch.equal(a, adapters[n]) for n, a in adapter_shard(policy).items())
    merged = {n: t.clone() for n, t in policy.export_hf_weights(bucket_bytes=64 << 10)}
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    plain.load_state_dict(merged, strict=False)
    _assert_logprobs(policy, plain, mbs)
    assert all(torch.equal(p, base[n]) for n, p in policy.module.named_parameters() if not p.requires_grad)


def check_tp2(rank: int) -> None:
    import torch.distributed as dist

    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import LoraSpec, _init_a

    path = ref.tiny_model_dir(rank, "lora_tp", vocab_size=100, num_hidden_layers=2)
    spec = LoraSpec(rank=4, alpha=8.0, seed=3)
    policy = MegatronPolicy(path, tp=2, optim=OptimConfig(lr=1e-2, total_steps=2), lora=spec)
    for name, p in policy.module.named_parameters():
        if name.endswith((".lora_A", ".lora_B")):
            split = name.endswith(".lora_A") == ("linear_proj" in name or "linear_fc2" in name)
            assert getattr(p, "tensor_model_parallel", False) == split, name
    randomise_b(policy, seed=4)
    shards = [None, None]
    dist.all_gather_object(shards, adapter_shard(policy))
    for name in (n for n in shards[0] if n.endswith(".lora_A")):
        layer, target = int(name.split(".")[2]), name.split(".")[-2]
        if target in ("linear_proj", "linear_fc2"):  # split by input columns
            whole = torch.cat([shards[0][name], shards[1][name]], 1)
        else:
            assert torch.equal(shards[0][name], shards[1][name]), name
            whole = shards[0][name]
        assert torch.equal(whole, _init_a(spec, layer, target, whole.shape[1])), name  # the TP=1 draw
    check_against_peft(policy, path, spec, shards)


def check_pp2(rank: int) -> None:
    """PP=2 (one layer per stage, tied embeddings: the last stage's frozen copy of the embedding):
    the same checks against PEFT, with both stages' adapters gathered."""
    import torch.distributed as dist

    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import LoraSpec

    path = ref.tiny_model_dir(rank, "lora_pp", vocab_size=100, num_hidden_layers=2, tied=True)
    spec = LoraSpec(rank=4, alpha=8.0, seed=5)
    policy = MegatronPolicy(path, pp=2, optim=OptimConfig(lr=1e-2, total_steps=2), lora=spec)
    randomise_b(policy, seed=6 + rank)
    stages = [None, None]
    dist.all_gather_object(stages, adapter_shard(policy))
    assert not stages[0].keys() & stages[1].keys()  # each stage holds its own layer's adapters
    check_against_peft(policy, path, spec, [{**stages[0], **stages[1]}])


def main() -> int:
    from megatron.core import parallel_state

    from yatt.dist import init_distributed

    info = init_distributed(threads=1)
    assert info.world_size == 2, f"needs mpirun -np 2, got {info.world_size}"
    t0 = time.time()
    check_tp2(info.rank)
    print(f"[rank {info.rank}] lora tp=2 OK in {time.time() - t0:.1f}s", flush=True)
    parallel_state.destroy_model_parallel()
    t0 = time.time()
    check_pp2(info.rank)
    print(f"[rank {info.rank}] lora pp=2 OK in {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `import yatt`
    from in_one_job import or_abort

    or_abort(main)
