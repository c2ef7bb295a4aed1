"""Bucketed weight sync from a model-parallel trainer into TP=1 vLLM engines, ``mpirun -np 2``.

    mpirun -np 2 python tests/mpi/reshard_sync.py tp      # trainer TP=2, one engine per rank
    mpirun -np 2 python tests/mpi/reshard_sync.py pp      # trainer PP=2 (2 layers per stage)
    mpirun -np 2 python tests/mpi/in_one_job.py reshard_sync:tp reshard_sync:pp   # one after the other

Model: a small random Qwen2 (4 heads / 2 KV heads of dim 32, QKV bias, vocabulary 49155, padded
to 49156 at TP=2; 4 layers; tp: untied, pp: tied embeddings, so the last stage holds a copy of
the embedding as its output layer) with SmolLM2's tokenizer files. Checks, for two consecutive
optimizer steps (the first step's grad norm equals HF autograd's on the same loss):
the synced tensors are bit-equal to a plain all-gather + torch slicing export of the live
parameters (a stale or mis-sliced bucket shows), and the engine's logprobs of fixed sequences
equal the trainer's within SYNC_TOL and have moved since the previous step. The bucket size
(256 KiB) forces many buckets. At step 2 the export also runs over torch.distributed instead of
MPI (the transport of launchers without MPI). Prints "reshard sync OK" per rank.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
SYNC_TOL = 1e-4  # as tests/mpi/sync_onpolicy.py (fp32 CPU kernels of trainer and engine)
BUCKET_BYTES = 256 << 10


def _model_dir(rank: int, tied: bool) -> Path:
    from trainer_tp import tiny_model_dir

    return tiny_model_dir(rank, f"reshard_sync_{'tied' if tied else 'untied'}", tied=tied)


def _reference_export(actor) -> dict:
    """Plain torch: all-gather each parameter over TP, megatron_to_hf, every stage to every stage."""
    from yatt.reshard.reference import per_tensor_hf_weights

    return {n: t.clone() for n, t in per_tensor_hf_weights(actor)}


def main(mode: str) -> None:
    import torch

    from transformers import AutoModelForCausalLM

    from trainer_tp import GRAD_NORM_RTOL, hf_grad_norm, sum_logprob_loss
    from yatt.dist import init_distributed
    from yatt.rollout import VLLMEngine
    from yatt.trainer import MegatronPolicy, OptimConfig

    info = init_distributed(threads=1)
    path = _model_dir(info.rank, tied=mode == "pp")
    sizes = {"tp": dict(tp=2), "pp": dict(pp=2)}[mode]
    actor = MegatronPolicy(path, **sizes, optim=OptimConfig(lr=3e-3, total_steps=4))
    engine = VLLMEngine(str(path), max_model_len=128, kv_cache_memory_bytes=32 << 20, seed=info.rank)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (20, 33)]
    mbs = [{"input_ids": torch.tensor([s]), "mask": torch.ones(1, len(s))} for s in seqs]

    def trainer_logprobs():
        return [lp[0, 1:] for lp, _ in actor.compute_logprobs([{"input_ids": torch.tensor([s])} for s in seqs])]

    def engine_err():
        scored = engine.score(seqs)
        return max(float((torch.tensor(e[1:]) - t).abs().max()) for e, t in zip(scored, trainer_logprobs()))

    err0 = engine_err()
    assert err0 < SYNC_TOL, f"engine vs trainer before any step: {err0}"
    before = engine.score(seqs)
    want = hf_grad_norm(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mbs, sum_logprob_loss)
    for step in (1, 2):
        stats = actor.train_step(mbs, sum_logprob_loss)
        if step == 1:  # the model-parallel gradient (tied embedding: summed over both stages) is HF's
            assert abs(stats["grad_norm"] - want) <= GRAD_NORM_RTOL * want, (stats["grad_norm"], want)
            assert stats["tokens"] == sum(len(s) for s in seqs), stats
        synced = {n: t.clone() for n, t in actor.export_hf_weights(BUCKET_BYTES)}
        reference = _reference_export(actor)
        assert synced.keys() == reference.keys(), sorted(synced.keys() ^ reference.keys())
        bad = [n for n in synced if not torch.equal(synced[n], reference[n])]
        assert not bad, f"step {step}: synced tensors differ from the live parameters: {bad[:5]}"
        if step == 2:  # the same through torch.distributed instead of MPI (launchers without MPI)
            sync = actor._syncs[BUCKET_BYTES, 1, 0]
            transports = sync.tp_mpi, sync.pp_mpi
            assert any(c is not None for c in transports), "expected MPI transports under mpirun"
            sync.tp_mpi = sync.pp_mpi = None
            bad = [n for n, t in sync if not torch.equal(t, reference[n])]
            sync.tp_mpi, sync.pp_mpi = transports
            assert not bad, f"torch.distributed transport: {bad[:5]}"
        engine.update_weights(actor.export_hf_weights(BUCKET_BYTES))
        err = engine_err()
        after = engine.score(seqs)
        moved = max(abs(a - b) for x, y in zip(after, before) for a, b in zip(x, y))
        assert err < SYNC_TOL, f"step {step}: engine vs trainer after sync: {err}"
        assert moved > 1e-3, f"step {step}: engine logprobs did not move ({moved})"
        print(f"rank {info.rank} {mode} step {step}: sync_err {err:.2e} moved {moved:.3f}", flush=True)
        before = after
    engine.shutdown()
    print("reshard sync OK", flush=True)


if __name__ == "__main__":
    from in_one_job import or_abort

    or_abort(main, sys.argv[1] if len(sys.argv) > 1 else "tp")
