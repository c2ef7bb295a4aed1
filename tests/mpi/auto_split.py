"""Under mpirun -np 4: ``placement.genrm_ranks=auto`` re-splits the world step by step.

A Placement (no engines: the phase work is stubbed) walks the ternary search on a synthetic
phase time that is best with 2 GenRM ranks. Every step the current split's intercommunicator
must carry one group from each sampler to a GenRM rank and back, exactly once, and the
search must settle on 2 GenRM ranks. Prints ``OK`` on rank 0.
"""
from types import SimpleNamespace

from mpi4py import MPI

from yatt.placement.runner import Placement
from yatt.placement.stream import StreamReceiver, StreamSender


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    cfg = SimpleNamespace(placement=SimpleNamespace(mode="partial_colocate", genrm_ranks="auto", rollout_ranks=1, auto_repeats=1,
                                                              keep_engines="always"),
                          reward=SimpleNamespace(type="genrm"), seed=0)
    placement = Placement(cfg, rank, world, build_rollout=None, scorer=SimpleNamespace(uses_judge=True), decode=None)
    cost = {1: 9.0, 2: 4.0, 3: 7.0}
    seen = []
    for step in range(6):
        roles = placement.roles
        seen.append(len(roles.judges))
        inter = placement.intercomm()
        if rank in roles.samplers:
            sender = StreamSender(inter)
            sender.send({"from": rank, "step": step}, tokens=10)
            sender.close()
            got = []
        else:
            receiver, got = StreamReceiver(inter, tokens_of=lambda x: 10), []
            for batch in receiver:
                receiver.scored(batch)
                got.extend(batch)
            assert all(x["step"] == step for x in got)
        every = sorted(x["from"] for part in comm.allgather(got) for x in part)
        assert every == list(roles.samplers), (step, every)
        placement.end_step(cost[len(roles.judges)])
    assert placement.search.best == 2 and seen[-1] == 2, seen
    assert set(seen[:3]) == {1, 2, 3}  # each candidate split was measured once
    if rank == 0:
        print("OK", seen, flush=True)


if __name__ == "__main__":
    main()
