"""VLLMEngine under ``mpirun -np 2``: one engine per rank, data parallel, uneven prompt counts; on
a tiny random Llama in SmolLM2's architecture with SmolLM2's tokenizer (test_rollout serves SmolLM2).

Run: ``.venv/bin/mpirun -np 2 .venv/bin/python tests/mpi/rollout_dp.py``. Exits non-zero (MPI
Abort) on any failed check; a watchdog aborts after ``ROLLOUT_DP_TIMEOUT`` s (default 600) so a
hang fails instead of blocking.
"""
from __future__ import annotations

import faulthandler
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def check_completions(out, prompts, n, max_tokens, eos):
    assert len(out) == len(prompts), (len(out), len(prompts))
    for comps in out:
        assert len(comps) == n
        for c in comps:
            assert len(c.token_ids) == len(c.logprobs) and 0 < len(c.token_ids) <= max_tokens
            assert all(isinstance(x, float) and math.isfinite(x) and x <= 0.0 for x in c.logprobs)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == max_tokens


def _same_tokens(a, b) -> bool:
    return [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]


def main() -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from yatt.dist import init_distributed
    from yatt.rollout import SamplingSpec, VLLMEngine

    from trainer_tp import tiny_model_dir

    info = init_distributed(threads=int(os.environ["OMP_NUM_THREADS"]))
    rank = info.rank
    assert info.world_size == 2, "run with mpirun -np 2"
    path = str(tiny_model_dir(rank, "rollout_dp", model_type="llama", tied=True, max_position_embeddings=512))
    tok = AutoTokenizer.from_pretrained(path)
    questions = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to three."]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]) for q in questions]
    eos = tok.eos_token_id

    t = time.perf_counter()
    engine = VLLMEngine(path, max_model_len=512, kv_cache_memory_bytes=256 << 20, seed=0)
    timings = {"build_s": time.perf_counter() - t}

    # Round 1: uneven counts (rank 0: 3 prompts, rank 1: 1 prompt).
    mine = prompts[:3] if rank == 0 else prompts[3:]
    spec = SamplingSpec(n=2, max_tokens=16, temperature=1.0)
    t = time.perf_counter()
    out = engine.generate(mine, spec)
    timings["generate_uneven_s"] = time.perf_counter() - t
    check_completions(out, mine, 2, 16, eos)

    # Round 2: one rank has nothing (both ways round), for generate and score.
    for idle in (1, 0):
        mine = [] if rank == idle else prompts[:2]
        out = engine.generate(mine, SamplingSpec(n=2, max_tokens=8))
        check_completions(out, mine, 2, 8, eos)
        scores = engine.score([] if rank == idle else [prompts[0]])
        assert len(scores) == (0 if rank == idle else 1)

    # Greedy is identical across ranks (same weights); the same user seed differs per DP rank.
    greedy = engine.generate([prompts[0]], SamplingSpec(n=1, max_tokens=16, temperature=0.0))[0][0]
    seeded = engine.generate([prompts[0]], SamplingSpec(n=1, max_tokens=16, seed=123))[0][0]
    both = [None, None]
    dist.all_gather_object(both, (greedy.token_ids, seeded.token_ids))
    assert both[0][0] == both[1][0], "greedy differs across ranks"
    assert both[0][1] != both[1][1], "same seed gave identical samples on two DP ranks"

    # One call whose prompts hold more tokens than an engine step takes (4096): with chunked
    # prefill a seeded request's prompt was split over steps and vLLM's CPU runner crashed
    # ("CPU Generator does not use offset"). Seeded, so the call repeats exactly.
    long_prompts = [p + tok(f"padding {i} words " * 30)["input_ids"] for i, p in enumerate(prompts * 12)]
    assert sum(map(len, long_prompts)) > 2 * 4096, sum(map(len, long_prompts))
    spec = SamplingSpec(n=2, max_tokens=4, seed=7)
    out = engine.generate(long_prompts, spec)
    check_completions(out, long_prompts, 2, 4, eos)
    assert _same_tokens(out, engine.generate(long_prompts, spec)), "a seeded call over many steps did not repeat"

    # Weight sync on both ranks: perturb the tied embedding, then restore.
    seq = prompts[0] + greedy.token_ids
    base = torch.tensor(engine.score([seq])[0])
    state = load_file(os.path.join(path, "model.safetensors"))
    perturbed = dict(state)
    perturbed["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * (1.05 + 0.05 * rank)
    t = time.perf_counter()
    engine.update_weights(perturbed.items())
    timings["update_weights_s"] = time.perf_counter() - t
    changed = torch.tensor(engine.score([seq])[0])
    assert (changed - base).abs().max() > 1e-2, "update_weights had no effect"
    engine.update_weights(state.items())
    restored = torch.tensor(engine.score([seq])[0])
    assert (restored - base).abs().max() < 1e-5, (restored - base).abs().max()
    gathered = [None, None]
    dist.all_gather_object(gathered, restored)
    assert (gathered[0] - gathered[1]).abs().max() < 1e-5, "ranks disagree after restore"

    # CPU colocation releases memory by shutdown + rebuild: the process groups must survive it.
    engine.shutdown()
    t = time.perf_counter()
    engine = VLLMEngine(path, max_model_len=512, kv_cache_memory_bytes=256 << 20, seed=0)
    timings["rebuild_s"] = time.perf_counter() - t
    mine = prompts[:1] if rank == 0 else prompts[1:3]
    check_completions(engine.generate(mine, SamplingSpec(n=2, max_tokens=8)), mine, 2, 8, eos)
    engine.shutdown()
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)  # the trainer's process group survives the engine
    assert x.item() == 3.0
    if rank == 0:
        print("rollout_dp timings:", {k: round(v, 2) for k, v in timings.items()}, flush=True)
    dist.barrier()
    print(f"rank {rank}: OK", flush=True)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("ROLLOUT_DP_TIMEOUT", 600)), exit=True)
    from in_one_job import or_abort

    or_abort(main)
