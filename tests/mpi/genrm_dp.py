"""GenRM judges on data-parallel ranks under ``mpirun -np 2``: time-outs never hang a rank.

SmolLM2 stands in as the judge (one engine per rank on 2 cores). The ranks alternate between
judging requests that time out (600-token verdicts, 0.5 s deadline: each scores the defined
``unparsable_score``) and having nothing to judge; each rank's engine runs on its own and
finishes, within 20 s a round. Prints ``rank R: genrm_dp OK`` per rank.

    mpirun -np 2 python tests/mpi/genrm_dp.py
"""
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from yatt.assets.model import SMOLLM2, resolve_model
    from yatt.dist import init_distributed
    from yatt.reward.genrm import GenRMJudge, JudgeItem
    from yatt.rollout import VLLMEngine

    init_distributed(threads=1)
    rank = dist.get_rank()
    path = str(resolve_model(SMOLLM2))
    tok = AutoTokenizer.from_pretrained(path)
    eng = VLLMEngine(path, max_model_len=1024, kv_cache_memory_bytes=128 << 20, seed=0)
    items = [JudgeItem("What is 7 + 5?", "7 + 5 = 12.", "12")] * 3
    slow = GenRMJudge(eng, tok, template="correctness_verdict", mode="verdict", k=2, max_tokens=600,
                      temperature=1.0, timeout_s=0.5, unparsable_score=0.25)
    fast = GenRMJudge(eng, tok, template="correctness_yesno", mode="prob", max_tokens=1,
                      temperature=0.0, timeout_s=60.0)
    for mine, theirs in [(items, []), ([], items), (items, items[:1])]:
        a, b = (mine, theirs) if rank == 0 else (theirs, mine)
        t0 = time.perf_counter()
        res = slow.score(a)
        assert len(res) == len(a) and all(r.timed_out == 2 and r.score == 0.25 for r in res), res
        assert time.perf_counter() - t0 < 20.0
        res = fast.score(b)
        assert len(res) == len(b) and all(r.timed_out == 0 and 0.0 < r.score < 1.0 for r in res), res
    eng.shutdown()
    print(f"rank {rank}: genrm_dp OK", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch.distributed as dist

    main()
    dist.destroy_process_group()
