"""Under mpirun: sampler ranks stream groups to GenRM ranks; every group comes back exactly once.

Usage: mpirun -np N python tests/mpi/stream_exactly_once.py GENRM_RANKS [SLOW_JUDGE]

Each rank draws ``PER_RANK`` prompts; they are routed to the samplers, which "finish" them in
a shuffled order with random delays and stream them to the least-loaded GenRM rank; GenRM
ranks "score" each batch (score = f(gid)) with random delays, and the scored groups are routed
to their training owner. Three steps run back to back on the same communicators (no message
may leak into the next step). With SLOW_JUDGE=1 the first GenRM rank takes 20x longer per
group, and the least-loaded rule must send it fewer groups. Prints ``OK`` on rank 0.
"""
import random
import sys
import time
from collections import defaultdict

from mpi4py import MPI

from yatt.placement.plan import plan_roles, route
from yatt.placement.stream import StreamReceiver, StreamSender

PER_RANK = 6


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    genrm_ranks, slow = int(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "1"
    for mode in ("partial_colocate", "disaggregated"):
        roles = plan_roles(mode, world, genrm_ranks)
        sampler = rank in roles.samplers
        local = comm.Split(color=0 if sampler else 1, key=rank)
        inter = local.Create_intercomm(0, comm, roles.judges[0] if sampler else roles.samplers[0], tag=11)
        sent_to = defaultdict(int)
        for step in range(3):
            rng = random.Random(1000 * step + rank)
            outgoing = defaultdict(list)
            for i in range(PER_RANK):
                gid = rank * PER_RANK + i
                outgoing[roles.sampler_of(gid)].append({"gid": gid, "origin": rank, "step": step,
                                                        "owner": roles.owner_of(gid, rank), "tokens": rng.randint(5, 50)})
            mine = route(outgoing, world)
            scored = []
            if sampler:
                sender = StreamSender(inter)
                rng.shuffle(mine)  # groups finish in any order
                for item in mine:
                    time.sleep(rng.uniform(0, 0.01))
                    sent_to[sender.send(item, item["tokens"])] += 1
                sender.close()
            else:
                receiver = StreamReceiver(inter, tokens_of=lambda it: it["tokens"])
                delay = 0.05 if slow and rank == roles.judges[0] else 0.001
                for batch in receiver:
                    time.sleep(delay * len(batch))
                    for item in batch:
                        assert item["step"] == step, f"item of step {item['step']} leaked into step {step}"
                        item["score"] = item["gid"] * 0.5
                        item["judge"] = rank
                    receiver.scored(batch)
                    scored.extend(batch)
                assert receiver.stats.max_groups >= 1
            back = defaultdict(list)
            for item in scored:
                back[item["owner"]].append(item)
            got = route(back, world)
            for item in got:
                assert item["owner"] == rank and item["score"] == item["gid"] * 0.5
            every = comm.allgather(sorted(item["gid"] for item in got))
            flat = sorted(g for part in every for g in part)
            assert flat == list(range(world * PER_RANK)), f"lost or duplicated groups: {flat}"
            if mode == "partial_colocate":  # every rank trains on exactly the prompts it drew
                assert sorted(item["gid"] for item in got) == [rank * PER_RANK + i for i in range(PER_RANK)]
            else:
                assert (len(got) > 0) == (rank in roles.trainers)
        totals = comm.allgather(dict(sent_to) if sampler else {})
        if slow and genrm_ranks > 1 and rank == 0:
            per_judge = defaultdict(int)
            for d in totals:
                for j, n in d.items():
                    per_judge[j] += n
            assert per_judge[0] < per_judge[1], f"the slow GenRM rank got as many groups: {dict(per_judge)}"
        inter.Free()
        local.Free()
    if rank == 0:
        print("OK", flush=True)


if __name__ == "__main__":
    main()
