"""Multi-rank checks of MegatronPolicy against transformers (fp32).

    mpirun -np 3 python tests/mpi/trainer_tp.py tp   # TP=3 (SmolLM2's 9 heads / 3 KV heads: TP=2 impossible)
    mpirun -np 2 python tests/mpi/trainer_tp.py dp   # TP=1, DP=2

tp: on tiny random models in SmolLM2's attention layout (Llama, tied) and Qwen2's (QKV bias, untied,
    padded vocab): logprobs / entropies equal HF's, exported weights are bit-identical to the
    checkpoint, the grad norm of one step equals HF autograd's on the same loss (Qwen2: also with
    an entropy bonus, whose gradient flows through the vocab-parallel entropy).
    The critic (a value head on the tiny Llama) at TP=3: values and grad norm vs transformers.
dp: each rank holds one micro-batch; after one train_step the grad norm equals HF autograd's on
    the concatenated batch (gradient = SUM over DP ranks) and both ranks hold identical weights.
    The critic at PP=2: values and grad norm vs transformers.
subgroup (mpirun -np 3): the same with ranks 0 and 1 training over their own DP group (tiny
    Qwen2) while rank 2 never builds a trainer (placement.mode=disaggregated's GenRM rank).
Asserts; exits non-zero on failure. Also imported by tests/test_trainer.py for the HF reference.
"""
from __future__ import annotations

import math
import sys
import time

import pytest
import torch

MODEL = "smollm2-135m-instruct"
TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "2 + 2 = 4. 3 * 5 = 15.",
         "def add(a, b):\n    return a + b\n",
         "Once upon a time"]
LOGPROB_ATOL = 1e-4    # measured max |diff| vs HF: 3e-5 (TP=1 and TP=3)
GRAD_NORM_RTOL = 5e-4  # measured relative diff vs HF autograd: 2e-5 (TP=3) to 6e-5 (TP=1)


def make_micro_batches(tokenizer, texts: list[str], per_mb: int) -> list[dict]:
    """Right-padded micro-batches: input_ids [B, T] int64 and mask [B, T] fp32 (1 on scored tokens, t >= 1)."""
    mbs = []
    for i in range(0, len(texts), per_mb):
        ids = [tokenizer(t)["input_ids"] for t in texts[i:i + per_mb]]
        T = max(map(len, ids))
        input_ids = torch.full((len(ids), T), tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros(len(ids), T)
        for b, seq in enumerate(ids):
            input_ids[b, :len(seq)] = torch.tensor(seq)
            mask[b, 1:len(seq)] = 1.0
        mbs.append({"input_ids": input_ids, "mask": mask})
    return mbs


def sum_logprob_loss(logprobs, entropy, mb):
    """loss = -sum of masked logprobs (minimising it raises the sequences' likelihood)."""
    loss = -(logprobs * mb["mask"]).sum()
    return loss, {"loss": loss.detach(), "tokens": mb["mask"].sum()}


class EntropyBonusLoss:
    """:func:`sum_logprob_loss` minus 0.1 x the masked entropy sum; the entropy carries a gradient."""

    entropy_grad = True

    def __call__(self, logprobs, entropy, mb):
        loss, stats = sum_logprob_loss(logprobs, entropy, mb)
        return loss - 0.1 * (entropy * mb["mask"]).sum(), stats


def hf_logprobs_entropy(hf_model, input_ids):
    """HF reference: (logprobs [B, T], entropy [B, T]) aligned like MegatronPolicy (0 at t=0)."""
    logp = torch.log_softmax(hf_model(input_ids).logits.float(), -1)
    lp = logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    ent = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def hf_grad_norm(hf_model, micro_batches, loss_fn) -> float:
    """Global grad norm of sum over micro-batches of loss_fn, by plain autograd on the HF model."""
    hf_model.zero_grad()
    for mb in micro_batches:
        lp, ent = hf_logprobs_entropy(hf_model, mb["input_ids"])
        loss_fn(lp, ent if getattr(loss_fn, "entropy_grad", False) else ent.detach(), mb)[0].backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf_model.parameters() if p.grad is not None))
    hf_model.zero_grad()
    return float(norm)


def save_tiny_hf(path, model_type: str = "qwen2", *, vocab_size: int = 100, tied: bool = False, seed: int = 0,
                 **config):
    """Write a tiny random HF model (2 layers, 6 heads / 3 KV heads, head dim 16) to ``path``.

    ``config`` overrides fields of the HF config (heads, layers, sizes).
    Every parameter gets N(0, 0.1) noise (norm weights ~1, q/k/v biases non-zero for Qwen2) so a
    swapped tensor in the mapping shows. Returns the HF model (fp32, eval).
    """
    from transformers import LlamaConfig, Qwen2Config, AutoModelForCausalLM

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[model_type]
    fields = dict(vocab_size=vocab_size, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=tied,
                  max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    config = cls(**(fields | config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    # Not save_pretrained: transformers 5 writes only on torch.distributed rank 0.
    from pathlib import Path

    from safetensors.torch import save_file

    config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    return model.eval()


# vLLM's CPU attention needs head dim >= 32: 4 heads / 2 KV heads of 32; SmolLM2's tokenizer (49152)
TINY_VLLM = {"vocab_size": 49155, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
             "intermediate_size": 192, "max_position_embeddings": 256}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_tiny_vllm(path, model_type: str = "qwen2", **config):
    """:func:`save_tiny_hf` of a Qwen2 (or ``model_type``) that vLLM's CPU backend serves
    (:data:`TINY_VLLM`, then ``config``), with SmolLM2's tokenizer files (:data:`TOKENIZER_FILES`)
    beside it. Returns the HF model."""
    import shutil

    from yatt.assets.model import resolve_model

    model = save_tiny_hf(path, model_type, **(TINY_VLLM | config))
    for f in resolve_model(MODEL).iterdir():
        if f.name in TOKENIZER_FILES:
            shutil.copy(f, path / f.name)
    return model


def save_tiny_reward_model(path, num_labels: int = 1, seed: int = 0):
    """A tiny random ``Qwen2ForSequenceClassification`` (:func:`save_tiny_vllm`'s body, a score
    head of ``num_labels`` from ``seed``) with SmolLM2's tokenizer, saved to ``path``."""
    import torch
    from transformers import AutoModelForSequenceClassification

    save_tiny_vllm(path, tied=False, max_position_embeddings=2048)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(path)


def tiny_model_dir(rank: int, tag: str, **config):
    """:func:`save_tiny_vllm` (4 layers, then ``config``) written by rank 0 to a temp folder named by
    ``tag`` and the job's MASTER_PORT; every rank returns the folder after a barrier. Rank 0
    removes it when its process exits (each folder is ~54 MB; a suite run made six)."""
    import atexit
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    path = Path(tempfile.gettempdir()) / f"yatt_{tag}_{os.environ.get('MASTER_PORT', '0')}"
    if rank == 0:
        save_tiny_vllm(path, **({"num_hidden_layers": 4} | config))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    dist.barrier()
    return path


# SmolLM2's attention layout (9 heads / 3 KV heads, tied embeddings, vocab divisible by 3), tiny
SMOL_SHAPE = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 144, "intermediate_size": 192}


def padded_micro_batches(lengths: list[list[int]], vocab: int, seed: int) -> list[dict]:
    """Random right-padded micro-batches, one per inner list of sequence lengths: input_ids
    [B, max len] int64 (pad 0) and mask [B, max len] fp32 (1 on scored tokens, 1 <= t < len)."""
    gen, mbs = torch.Generator().manual_seed(seed), []
    for lens in lengths:
        T = max(lens)
        ids, mask = torch.zeros(len(lens), T, dtype=torch.long), torch.zeros(len(lens), T)
        for b, n in enumerate(lens):
            ids[b, :n], mask[b, 1:n] = torch.randint(1, vocab, (n,), generator=gen), 1.0
        mbs.append({"input_ids": ids, "mask": mask})
    return mbs


def group_samples(vocab: int, seed: int) -> list:
    """3 prompts x 3 responses (one empty), random ids, lengths 1-9, advantages +-1: samples
    (:class:`yatt.controller.batch.Sample`) for packed micro-batches; split them as
    :data:`GROUP_SPLIT` to put one group's samples into two micro-batches."""
    from yatt.controller.batch import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for g, (plen, rlens) in enumerate([(5, (2, 6, 1)), (7, (9, 0, 3)), (4, (3, 5, 1))]):
        prompt = torch.randint(1, vocab, (plen,), generator=gen).tolist()
        for k, rlen in enumerate(rlens):
            r = torch.randint(1, vocab, (rlen,), generator=gen).tolist()
            out.append(Sample(prompt, r, [0.0] * rlen, "stop", 1.0, 1.0 if (g + k) % 2 else -1.0))
    return out


GROUP_SPLIT = [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
PACKING_ATOL = 2e-5  # packed vs padded rows, fp32 (measured max |diff|: see the jobs' lines)


def pg_loss(logprobs, entropy, mb):
    """A policy-gradient-like loss on response tokens (advantages +-1) with an entropy term."""
    mask = mb["response_mask"]
    loss = -(logprobs * mask * mb["advantages"]).sum() + 0.1 * (entropy * mask).sum()
    return loss, {"loss": loss.detach()}


def packed_vs_padded(model, rank: int, what: str) -> float:
    """Every ``trainer.packing`` layout gives the padded rows' outputs (a policy: logprobs,
    entropies and the grad norm of :func:`pg_loss`, the update skipped; a critic: values).
    Returns the largest difference."""
    from yatt.controller.batch import pack_micro_batches
    from yatt.trainer.packing import MODES

    samples = group_samples(99, seed=7)
    out = {}
    for mode in MODES:
        mbs = pack_micro_batches(samples, GROUP_SPLIT, pad_id=0, packing=mode)
        if hasattr(model, "compute_values"):
            out[mode] = ([v for v in model.compute_values(mbs)], None)
        else:
            norm = model.train_step(mbs, pg_loss, skip_update=lambda n: True)["grad_norm"]
            out[mode] = ([t for pair in model.compute_logprobs(mbs) for t in pair], norm)
    ref, ref_norm = out["padded"]
    for mode in MODES[1:]:
        diff = max((a - b).abs().max().item() for a, b in zip(out[mode][0], ref))
        print(f"[rank {rank}] {what} {mode} vs padded: max|diff| {diff:.1e}"
              + (f", grad_norm {out[mode][1]:.6f} vs {ref_norm:.6f}" if ref_norm else ""), flush=True)
        assert diff < PACKING_ATOL, (mode, diff)
        assert ref_norm is None or abs(out[mode][1] - ref_norm) <= 1e-5 * ref_norm, (mode, out[mode][1], ref_norm)
    return max(max((a - b).abs().max().item() for a, b in zip(out[mode][0], ref)) for mode in MODES[1:])


def check_tp(rank: int) -> None:
    """TP=3 on a tiny Llama in SmolLM2's layout (test_trainer checks SmolLM2 itself at TP=1)."""
    import tempfile

    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.model import SafetensorsState

    with tempfile.TemporaryDirectory() as tmp:
        hf = save_tiny_hf(tmp, "llama", vocab_size=99, tied=True, **SMOL_SHAPE)
        policy = MegatronPolicy(tmp, tp=3, optim=OptimConfig(lr=1e-5, total_steps=2))
        assert policy.layout.padded_vocab_size == 99  # divisible by TP=3, as SmolLM2's 49152: no padding
        ckpt = SafetensorsState(tmp)
        exported = dict(policy.export_hf_weights())
        assert set(exported) == set(ckpt) - {"lm_head.weight"}, set(exported) ^ set(ckpt)
        for name, t in exported.items():
            assert torch.equal(t, ckpt[name]), name
    mbs = padded_micro_batches([[14, 9], [11, 6]], vocab=99, seed=2)
    with torch.no_grad():
        for (lp, ent), mb in zip(policy.compute_logprobs(mbs), mbs):
            ref_lp, ref_ent = hf_logprobs_entropy(hf, mb["input_ids"])
            d_lp, d_ent = (lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item()
            print(f"[rank {rank}] TP=3 logprob max|diff| {d_lp:.2e}, entropy {d_ent:.2e}", flush=True)
            assert d_lp < LOGPROB_ATOL and d_ent < LOGPROB_ATOL, (d_lp, d_ent)
    ref = hf_grad_norm(hf, mbs, sum_logprob_loss)
    stats = policy.train_step(mbs, sum_logprob_loss)
    print(f"[rank {rank}] TP=3 grad_norm {stats['grad_norm']:.6f} vs HF {ref:.6f}", flush=True)
    assert abs(stats["grad_norm"] - ref) <= GRAD_NORM_RTOL * ref, (stats["grad_norm"], ref)
    packed_vs_padded(policy, rank, "TP=3 policy")
    check_tiny_qwen2_tp(rank)


def check_tiny_qwen2_tp(rank: int) -> None:
    """TP=3 on a tiny Qwen2: QKV bias, untied output layer, vocab 100 padded to 102."""
    import tempfile

    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.model import SafetensorsState

    with tempfile.TemporaryDirectory() as tmp:
        hf = save_tiny_hf(tmp, "qwen2", vocab_size=100, tied=False)
        policy = MegatronPolicy(tmp, tp=3, optim=OptimConfig(lr=1e-3))
        recomputed = MegatronPolicy(tmp, tp=3, optim=OptimConfig(lr=1e-3), recompute=True)  # trainer.recompute=full
        assert policy.layout.padded_vocab_size == 102
        exported = dict(policy.export_hf_weights())
        ckpt = SafetensorsState(tmp)
        assert set(exported) == set(ckpt) and all(torch.equal(t, ckpt[n]) for n, t in exported.items())
    gen = torch.Generator().manual_seed(1)
    mbs = [{"input_ids": torch.randint(0, 100, (2, 12), generator=gen), "mask": torch.ones(2, 12)}]
    mbs[0]["mask"][:, 0] = 0
    (lp, ent), = policy.compute_logprobs(mbs)
    with torch.no_grad():
        ref_lp, ref_ent = hf_logprobs_entropy(hf, mbs[0]["input_ids"])
    d_lp, d_ent = (lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item()
    ref = hf_grad_norm(hf, mbs, sum_logprob_loss)
    stats = policy.train_step(mbs, sum_logprob_loss)
    re_norm = recomputed.train_step(mbs, sum_logprob_loss)["grad_norm"]
    print(f"[rank {rank}] tiny Qwen2 TP=3: logprob max|diff| {d_lp:.1e}, entropy {d_ent:.1e}, "
          f"grad_norm {stats['grad_norm']:.6f} (recomputed {re_norm:.6f}) vs HF {ref:.6f}", flush=True)
    assert d_lp < LOGPROB_ATOL and d_ent < LOGPROB_ATOL, (d_lp, d_ent)
    assert abs(stats["grad_norm"] - ref) <= GRAD_NORM_RTOL * ref, (stats["grad_norm"], ref)
    assert abs(re_norm - ref) <= GRAD_NORM_RTOL * ref, (re_norm, ref)
    assert max((a - b).abs().max().item() for (_, a), (_, b)
               in zip(policy.export_hf_weights(), recomputed.export_hf_weights())) < 1e-6  # the same update
    # an entropy bonus: the vocab-parallel entropy's gradient, at the weights after the step
    hf.load_state_dict(dict(policy.export_hf_weights()))
    ref = hf_grad_norm(hf, mbs, EntropyBonusLoss())
    stats = policy.train_step(mbs, EntropyBonusLoss())
    print(f"[rank {rank}] tiny Qwen2 TP=3 entropy bonus: grad_norm {stats['grad_norm']:.6f} vs HF {ref:.6f}", flush=True)
    assert abs(stats["grad_norm"] - ref) <= GRAD_NORM_RTOL * ref, (stats["grad_norm"], ref)


VALUE_ATOL = 1e-4  # critic values vs HF's hidden states x head, fp32 (measured: see the job's lines)


def save_tiny_critic(path, seed: int = 5):
    """:func:`save_tiny_hf` (tiny Llama in SmolLM2's layout, tied) plus a random value head
    ``score.weight`` ``[1, H]`` in its safetensors (a sequence-classification model's head).
    Returns (the HF causal LM, the head)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    hf = save_tiny_hf(path, "llama", vocab_size=99, tied=True, **SMOL_SHAPE)
    head = torch.randn(1, SMOL_SHAPE["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 0.3
    file = str(Path(path) / "model.safetensors")
    save_file({**load_file(file), "score.weight": head}, file, metadata={"format": "pt"})
    return hf, head


def hf_values(hf, head, input_ids):
    """The reference values: HF's final hidden states x head, at the token they value (0 at t = 0)."""
    v = (hf.model(input_ids).last_hidden_state @ head.T)[..., 0]
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)


def value_loss(values, mb):
    """0.5 x the squared error to fixed targets over the masked tokens."""
    loss = 0.5 * (((values - mb["target"]) ** 2) * mb["response_mask"]).sum()
    return loss, {"loss": loss.detach()}


def check_critic(rank: int, tp: int, pp: int) -> None:
    """MegatronCritic at TP=tp, PP=pp against a single-process reference (transformers): values
    within VALUE_ATOL, and the grad norm of one step of a squared-error loss within GRAD_NORM_RTOL
    of HF autograd's (each rank holds the same micro-batches: the DP ranks' gradients add up)."""
    import tempfile

    from yatt.trainer.actor import OptimConfig, init_parallel_state
    from yatt.trainer.critic import MegatronCritic

    init_parallel_state(tp, pp)
    with tempfile.TemporaryDirectory() as tmp:  # every rank writes the same seeded model
        hf, head = save_tiny_critic(tmp)
        critic = MegatronCritic(tmp, tp=tp, pp=pp, optim=OptimConfig(lr=1e-3, total_steps=2))
    mbs = padded_micro_batches([[14, 9], [11, 6]], vocab=99, seed=4)
    gen = torch.Generator().manual_seed(6)
    for mb in mbs:
        mb["response_mask"] = mb["mask"] * (torch.arange(mb["mask"].shape[1]) >= 3)  # "prompt": the first 3 tokens
        mb["target"] = torch.randn(mb["mask"].shape, generator=gen)
    with torch.no_grad():
        refs = [hf_values(hf, head, mb["input_ids"]) * mb["response_mask"] for mb in mbs]
    diff = max((v - r).abs().max().item() for v, r in zip(critic.compute_values(mbs), refs))
    hf.zero_grad()
    head_ref = head.clone().requires_grad_(True)
    ref_loss = sum(value_loss(hf_values(hf, head_ref, mb["input_ids"]), mb)[0] for mb in mbs)
    (ref_loss * critic.dp).backward()  # every DP rank trains on the same micro-batches
    ref = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in [*hf.model.parameters(), head_ref]
                         if p.grad is not None)).item()
    stats = critic.train_step(mbs, value_loss)
    print(f"[rank {rank}] critic TP={tp} PP={pp}: values max|diff| {diff:.1e}, grad_norm {stats['grad_norm']:.6f} "
          f"vs HF {ref:.6f}", flush=True)
    assert diff < VALUE_ATOL, diff
    assert abs(stats["grad_norm"] - ref) <= GRAD_NORM_RTOL * ref, (stats["grad_norm"], ref)
    packed_vs_padded(critic, rank, f"critic TP={tp} PP={pp}")


def check_shared_sum_equals_all_reduce(policy, rank: int, group) -> None:
    """The policy's shared-memory DP sum (yatt.trainer.grad_sum) gives gloo's all-reduce bit for
    bit on random gradients, in the buffers the parameters' ``main_grad`` views read."""
    import torch.distributed as dist

    buffers = policy.model.buffers
    gen = torch.Generator().manual_seed(100 + rank)
    for b in buffers:
        b.grad_data.copy_(torch.randn(b.grad_data.shape, generator=gen))
    expect = [b.grad_data.clone() for b in buffers]
    for e in expect:
        dist.all_reduce(e, group=group)
    policy.grad_sum()
    for b, e in zip(buffers, expect):
        assert torch.equal(b.grad_data, e), "shared-memory sum differs from the all-reduce"
    param = next(p for p in policy.module.parameters() if p.requires_grad)
    start = buffers[0].param_index_map[param][0]
    assert param.main_grad.data_ptr() == buffers[0].grad_data[start:].data_ptr(), "main_grad left the buffer"
    policy.model.zero_grad_buffer()
    print(f"[rank {rank}] DP shared-memory gradient sum equals gloo's all-reduce", flush=True)


def check_dp(rank: int) -> None:
    """DP=2 over the world on a tiny Llama in SmolLM2's layout."""
    import tempfile

    import torch.distributed as dist

    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    with tempfile.TemporaryDirectory() as tmp:
        hf = save_tiny_hf(tmp, "llama", vocab_size=99, tied=True, **SMOL_SHAPE)  # same seed: same model on both
        policy = MegatronPolicy(tmp, tp=1, optim=OptimConfig(lr=1e-5, total_steps=2))
    assert policy.dp == 2
    assert policy.grad_sum is not None, "DP ranks on one machine under mpirun: the shared-memory sum"
    check_shared_sum_equals_all_reduce(policy, rank, None)
    mbs = padded_micro_batches([[14, 9], [11, 6]], vocab=99, seed=2)  # rank r trains on mbs[r] only
    ref = hf_grad_norm(hf, mbs, sum_logprob_loss)
    t0 = time.time()
    stats = policy.train_step([mbs[rank]], sum_logprob_loss)
    print(f"[rank {rank}] DP=2 grad_norm {stats['grad_norm']:.6f} vs HF on both micro-batches {ref:.6f}; "
          f"train_step {time.time() - t0:.1f}s", flush=True)
    assert abs(stats["grad_norm"] - ref) <= GRAD_NORM_RTOL * ref, (stats["grad_norm"], ref)
    local_loss = sum_logprob_loss(*hf_logprobs_entropy(hf, mbs[rank]["input_ids"]), mbs[rank])[0].item()
    assert abs(stats["loss"] - local_loss) <= 1e-4 * abs(local_loss), (stats["loss"], local_loss)
    for name, p in policy.module.named_parameters():
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=0)
        assert torch.equal(theirs, p.detach()), f"DP ranks differ on {name}"
    embed = dict(policy.export_hf_weights())["model.embed_tokens.weight"]
    assert not torch.equal(embed, hf.model.embed_tokens.weight), "train_step did not change the weights"
    print(f"[rank {rank}] DP=2 parameters identical on both ranks", flush=True)
    check_overlapped_grad_reduce(rank)


def check_overlapped_grad_reduce(rank: int) -> None:
    """Megatron's overlapped DP gradient reduction (buckets all-reduced during the last
    micro-batch's backward, what a GPU job runs) gives the update of the summed reduction after the
    backward pass, over two micro-batches per rank and two steps, the second without data on rank 1."""
    import tempfile

    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    mbs = padded_micro_batches([[14, 9], [11, 6], [7, 12], [5, 8]], vocab=99, seed=4)
    params = []
    for overlap in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            save_tiny_hf(tmp, "llama", vocab_size=99, tied=True, **SMOL_SHAPE)
            policy = MegatronPolicy(tmp, optim=OptimConfig(lr=1e-3, total_steps=3), overlap_grad_reduce=overlap)
        assert policy.overlap_grad_reduce == overlap and (policy.grad_sum is None) == overlap
        norms = [policy.train_step(mbs[2 * rank:2 * rank + 2], sum_logprob_loss)["grad_norm"],
                 policy.train_step(mbs[:2] if rank == 0 else [], sum_logprob_loss)["grad_norm"]]
        params.append(([p.detach().clone() for p in policy.module.parameters()], norms))
    (plain, plain_norms), (overlapped, overlapped_norms) = params
    assert overlapped_norms == pytest.approx(plain_norms, rel=1e-6), (overlapped_norms, plain_norms)
    for a, b in zip(plain, overlapped):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    print(f"[rank {rank}] DP=2 overlapped gradient reduction gives the same update (grad norms {plain_norms})",
          flush=True)


def check_dp_subgroup(rank: int) -> None:
    import tempfile

    import torch.distributed as dist

    from yatt.trainer.actor import MegatronPolicy, OptimConfig, init_parallel_state

    init_parallel_state(1)
    group = dist.new_group([0, 1])  # collective over the world, rank 2 included
    if rank < 2:
        with tempfile.TemporaryDirectory() as tmp:
            hf = save_tiny_hf(tmp, "qwen2", vocab_size=100, tied=False)  # same seed: same model on both
            policy = MegatronPolicy(tmp, tp=1, optim=OptimConfig(lr=1e-3), dp_group=group)
        assert policy.dp == 2 and policy.grad_sum is not None
        check_shared_sum_equals_all_reduce(policy, rank, group)
        gen = torch.Generator().manual_seed(3)
        mbs = [{"input_ids": torch.randint(0, 100, (2, 10), generator=gen), "mask": torch.ones(2, 10)} for _ in range(2)]
        ref = hf_grad_norm(hf, mbs, sum_logprob_loss)
        stats = policy.train_step([mbs[rank]], sum_logprob_loss)
        print(f"[rank {rank}] trainer subgroup grad_norm {stats['grad_norm']:.6f} vs HF on both {ref:.6f}", flush=True)
        assert abs(stats["grad_norm"] - ref) <= GRAD_NORM_RTOL * ref, (stats["grad_norm"], ref)
        for name, p in policy.module.named_parameters():
            theirs = p.detach().clone()
            dist.broadcast(theirs, src=0, group=group)
            assert torch.equal(theirs, p.detach()), f"trainers differ on {name}"
    dist.barrier()  # the rank that never trained is still in step with the world


def check_cpu_layer_pp_and_distributed_optimizer(rank: int) -> None:
    """Smoke test of the CPU layer's remaining redirects on a tiny GPT (2 ranks).

    PP=2 with tied embeddings (Tensor.cuda, synchronize) and DP=2 with the distributed
    optimizer (its CUDA type checks): one step each, finite loss, same grad norm on both ranks.
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    for pp, dist_opt in ((2, False), (1, True)):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, pp)
        model_parallel_cuda_manual_seed(7)
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=pp, finalize_model_grads_func=finalize_model_grads)
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128,
                         max_sequence_length=32, position_embedding_type="rope",
                         share_embeddings_and_output_weights=True,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [model])
        ids = torch.randint(0, 128, (2, 2, 16), generator=torch.Generator().manual_seed(rank if dist_opt else 0))

        def step(data, m):
            x = next(data)
            out = m(x, torch.arange(16).expand_as(x), None, labels=x)
            return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

        model.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(ids), model=[model],
                                          num_microbatches=2, seq_length=16, micro_batch_size=2)
        ok, grad_norm, _ = opt.step()
        norms = [None, None]
        dist.all_gather_object(norms, grad_norm)
        loss = out[0]["loss"].item() if out else None
        print(f"[rank {rank}] tiny GPT PP={pp} distributed_optimizer={dist_opt}: loss {loss}, grad_norm {grad_norm:.6f}", flush=True)
        assert ok and norms[0] == norms[1] and math.isfinite(grad_norm) and grad_norm > 0, norms
        assert loss is None or math.isfinite(loss)
        if pp == 2:  # tied embedding and output layer stay equal across the two stages
            w = (model.module.embedding.word_embeddings.weight if rank == 0 else model.module.output_layer.weight)
            first = w.detach().clone()
            dist.broadcast(first, src=0)
            assert torch.equal(first, w.detach())
    parallel_state.destroy_model_parallel()


def main(mode: str = "tp") -> int:
    from yatt.dist import init_distributed

    info = init_distributed(threads=1)
    expected = {"tp": 3, "dp": 2, "subgroup": 3}[mode]
    assert info.world_size == expected, f"mode {mode} needs mpirun -np {expected}, got {info.world_size}"
    t0 = time.time()
    if mode == "tp":
        check_tp(info.rank)
        check_critic(info.rank, tp=3, pp=1)
    elif mode == "subgroup":
        check_dp_subgroup(info.rank)
    else:
        check_dp(info.rank)
        check_cpu_layer_pp_and_distributed_optimizer(info.rank)  # leaves no parallel state
        check_critic(info.rank, tp=1, pp=2)
    print(f"[rank {info.rank}] {mode} OK in {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `import yatt`
    sys.exit(main(*sys.argv[1:2]))
