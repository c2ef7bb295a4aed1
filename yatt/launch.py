"""Entry point of a YATT job: ``python -m yatt.launch --config FILE [key=value ...]``.

Run it under ``mpirun -np N`` (or ``srun``, or torchrun): every process is one rank of the
same program. Without a launcher it stops with a message (``--standalone`` runs one rank, as
``mpirun -np 1`` does). The config is validated before anything heavy is imported or loaded, so a
typo costs a second, not a model load.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import NoReturn

if __name__ == "__main__":  # first: this may restart the process with tcmalloc and Intel OpenMP preloaded
    from yatt.preload import restart_with_preload

    restart_with_preload()

# Before torch's first allocation: its CPU allocator backs buffers of >= 2 MiB with transparent
# huge pages (madvise). Fresh bucket and activation buffers then fault in 2 MiB pages: measured
# on the dev machine, allocating and filling 512 MiB took 0.034 s instead of 0.196 s, and the
# TP=2 weight sync of Qwen2.5-0.5B 2.9 s instead of 6.9 s.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from yatt.checkpoint.triggers import EXIT_INTERRUPTED  # noqa: E402
from yatt.config import ConfigError, load_config  # noqa: E402


def _setup_env(threads: int | None) -> None:
    # vLLM on CPU: in-process engine (multiprocess init is ~10x slower and doubles memory).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _check_output_dir(cfg) -> None:
    """Refuse to mix a new run into an old run's metrics.jsonl: the old run is resumed
    (``resume=auto`` with a complete checkpoint there, or an explicit checkpoint path),
    or replaced (``overwrite=true``), or the job stops here, saying which and how to go on."""
    from yatt.checkpoint.files import checkpoint_root, find_latest, resolve

    if cfg.resume not in ("auto", "none") and not cfg.overwrite:
        try:
            resolve(cfg.resume)
        except FileNotFoundError as e:
            raise ConfigError(f"config key 'resume': {e}") from None
        return
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
    root = checkpoint_root(cfg)
    resumable = cfg.resume == "auto" and find_latest(root) is not None
    if not os.path.exists(metrics) or cfg.overwrite or resumable:
        return
    unfinished = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    how = (f"pass overwrite=true to start it over in {cfg.output_dir} (its metrics and unfinished checkpoints are "
           "deleted), or pick another output_dir")
    if unfinished:
        raise ConfigError(f"output_dir {cfg.output_dir} holds a run that was stopped before its first checkpoint was "
                          f"committed ({unfinished[-1]} is an unfinished save): nothing of it can be resumed; {how}")
    why = "with resume=none" if cfg.resume == "none" else "without a checkpoint to resume from"
    raise ConfigError(f"output_dir {cfg.output_dir} already holds a run ({metrics}) {why}; {how}")


def _check_resume_layout(cfg, world: int) -> None:
    """Refuse, before any model loads, a checkpoint to resume that cannot resume into this job's
    layout: with ``placement.mode=rollout_apart`` another world size; another TP or PP for a
    checkpoint whose optimizer states are not named (``param_names``, written since 2026-12-06);
    LoRA adapters where this job trains whole (and back). The checkpoint is the
    one ``resume`` names, or for ``auto`` the newest complete one;
    :meth:`~yatt.checkpoint.run_state.RunCheckpoints.resume` loads it (resharded for another TP or PP)."""
    from yatt.checkpoint.files import checkpoint_root, find_latest, read_meta, resolve

    if cfg.resume == "none" or cfg.overwrite:
        return
    folder = find_latest(checkpoint_root(cfg)) if cfg.resume == "auto" else resolve(cfg.resume)
    try:
        meta = read_meta(folder) if folder is not None else None
    except (OSError, ValueError):
        return  # a damaged meta.json is named when the checkpoint is verified
    if meta is None:
        return
    saved = {k: meta.get(k) for k in ("world", "tp", "pp")}
    layout = f"world size {saved['world']}, TP {saved['tp']}, PP {saved['pp']}"
    this = f"this job has world size {world}, TP {cfg.trainer.tp}, PP {cfg.trainer.pp}"
    keep = f"run with trainer.tp={saved['tp']} trainer.pp={saved['pp']}, or start a new run (resume=none, or another output_dir)"
    lora = meta.get("lora") or {}
    if (saved["tp"], saved["pp"]) != (cfg.trainer.tp, cfg.trainer.pp):
        if not _names_optimizer_states(folder):
            raise ConfigError(f"config key 'resume': checkpoint {folder} was saved with {layout}; {this}. It was "
                              f"written before checkpoints named their optimizer states, which resharding at resume "
                              f"needs: {keep}")
    saved_mode = (meta.get("config") or {}).get("placement", {}).get("mode")
    if saved["world"] != world and "rollout_apart" in (saved_mode, cfg.placement.mode):
        raise ConfigError(f"config key 'resume': checkpoint {folder} was saved with {layout} and this job has world "
                          f"size {world}; placement.mode=rollout_apart keeps in-flight rollouts on its sampler ranks, "
                          f"so it resumes on the world size it was saved with (mpirun -np {saved['world']})")
    actor_lora = lora.get("actor") is not None
    if "config" in meta and meta["config"].get("stage") == cfg.stage != "rm" and actor_lora != (cfg.trainer.lora is not None):
        what = "LoRA adapters" if actor_lora else "a policy trained whole"
        raise ConfigError(f"config key 'trainer.lora': checkpoint {folder} holds {what}, and this job "
                          f"{'trains whole' if actor_lora else 'trains LoRA adapters'}; set trainer.lora as the run was "
                          "started, or start a new run (resume=none, or another output_dir)")


def _names_optimizer_states(folder) -> bool:
    """Whether checkpoint ``folder``'s optimizer files name their states (``param_names``): the
    first one found is read (memory-mapped) and tells for all. True when it has none (nothing to reshard)."""
    import torch

    files = sorted((Path(folder) / "optim").glob("*.pt"))
    if not files:
        return True
    return "param_names" in torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)


def _lock_output_dir(cfg, info):
    """Rank 0 takes the run folder's lock (:class:`yatt.run_lock.RunLock`) for the job's life;
    every rank learns whether it could (one broadcast). Returns the lock (rank 0) or None.

    Raises:
        ConfigError: another live job holds it (named), or the folder cannot be written.
    """
    import torch
    import torch.distributed as dist

    from yatt.run_lock import RunLock, RunLocked

    lock, problem = None, ""
    if info.rank == 0:
        lock = RunLock(cfg.output_dir)
        try:
            lock.acquire()
        except (RunLocked, OSError) as e:
            lock, problem = None, str(e)
    refused = torch.tensor([bool(problem)], dtype=torch.int32)
    if dist.is_initialized():
        dist.broadcast(refused, src=0)
    if refused.item():
        raise ConfigError(problem or f"output_dir {cfg.output_dir}: rank 0 could not lock it (see rank 0's message)")
    return lock


def _hf_config(model: str) -> dict | None:
    """``config.json`` of a model folder or of a packaged model already materialised; None when
    it is not on disk yet (a packaged model is then checked when it loads)."""
    import json

    from yatt.assets.model import cache_root

    folder = Path(model).expanduser()
    if not folder.is_dir():
        folder = cache_root() / "models" / model
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _check_model_parallel(cfg, world: int) -> None:
    """trainer.tp must split the policy's heads and MLP (the trainer's own mapping check),
    trainer.pp its layers, and trainer.tp * trainer.pp the world; rollout.tp must split the
    policy's and the judge's heads, MLP and padded vocabulary, and the world."""
    from yatt.reshard.plan import check_inference_tp
    from yatt.trainer.hf_mapping import layout_from_hf, stage_layers

    t = cfg.trainer
    hf = _hf_config(cfg.model.path)
    for key, check in (("tp", lambda: layout_from_hf(hf, t.tp)),
                       ("pp", lambda: stage_layers(layout_from_hf(hf, t.tp), t.pp, 0))):
        try:
            if hf is not None:
                check()
        except ValueError as e:
            raise ConfigError(f"config key 'trainer.{key}': {e}") from None
    if world % (t.tp * t.pp):
        raise ConfigError(f"config keys 'trainer.tp', 'trainer.pp': TP*PP={t.tp * t.pp} must divide the "
                          f"world size ({world})")
    k = cfg.rollout.tp
    judge = None if k == 1 or cfg.reward.judge_model is None else _hf_config(cfg.reward.judge_model)
    for name, config in (("policy", hf), ("judge", judge)):
        try:
            layout = None if config is None else layout_from_hf(config)
        except NotImplementedError:  # a judge YATT does not train: vLLM checks its own split
            continue
        try:
            if layout is not None:
                check_inference_tp(layout, k)
        except ValueError as e:
            raise ConfigError(f"config key 'rollout.tp': the {name}'s engine: {e}") from None
    if world % k:
        raise ConfigError(f"config key 'rollout.tp': {k} ranks per rollout engine must divide the world size ({world})")


def _check_estimator(cfg) -> None:
    """A user's ``algo.estimator=module:function`` must load (imported here, after
    :func:`yatt.logs.setup`, not while the config is validated)."""
    from yatt.algos.estimators import get_estimator

    try:
        get_estimator(cfg.algo.estimator)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_env(cfg) -> None:
    """``rollout.env`` must load with ``rollout.env_args`` (:func:`yatt.env.load_env` imports it and
    makes one environment), before any model loads."""
    if cfg.rollout.env is None:
        return
    from yatt.env import load_env

    try:
        load_env(cfg.rollout.env, **cfg.rollout.env_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_placement(cfg, info) -> None:
    """Split placements need MPI (they stream over MPI communicators) and room for the split."""
    from yatt.placement.runner import roles_for

    if cfg.placement.mode == "colocate":
        return
    if info.source != "mpi":
        raise ConfigError(f"config key 'placement.mode': {cfg.placement.mode} streams over MPI; "
                          f"launch with mpirun (this job came from {info.source})")
    try:
        roles_for(cfg, info.world_size)
    except ValueError as e:
        key = "rollout_ranks" if cfg.placement.mode == "rollout_apart" else "genrm_ranks"
        raise ConfigError(f"config key 'placement.{key}': {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m yatt.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML recipe, e.g. configs/grpo_smollm2.yaml")
    ap.add_argument("--standalone", action="store_true",
                    help="run as one rank without a launcher (debugging; same as mpirun -np 1)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=2 output_dir=/tmp/run")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        _report(e)
        return 2
    try:
        return execute(cfg, require_launcher=not args.standalone)[0]
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops after the step's checkpoint)
        _report(RuntimeError("a second Ctrl-C: stopped at once (the newest committed checkpoint is intact)"))
        return EXIT_INTERRUPTED


def _report(e: Exception) -> None:
    rank = next((os.environ[k] for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID")
                 if k in os.environ), "0")
    if rank == "0":  # once per job, not per rank; every line of a multi-line error prefixed
        print("\n".join(f"yatt: {line}" for line in str(e).splitlines()), file=sys.stderr)


def execute(cfg, require_launcher: bool = False, keep_process_group: bool = False) -> tuple[int, list[dict]]:
    """Run the job ``cfg`` describes on this rank (every rank calls it; ``mpirun``, ``srun``,
    torchrun or one plain process; with ``require_launcher`` a plain process is refused). With
    ``keep_process_group`` torch.distributed's world group stays up when the job ends, so that
    the same processes can run another job after it (vLLM's and Megatron-Core's groups refer to
    it); the imports and the process start are then paid once for all of them.

    Returns:
        (exit code: 0 done, 2 config error (a bad path, a run folder locked by another job, a
        checkpoint to resume that does not verify), 75 stopped by SIGTERM/SIGUSR1 and 130 by SIGINT
        (Ctrl-C) (after a checkpoint, or during start-up with nothing to save), 74 the final or a
        signal's checkpoint could not be written; rank 0's metric records, empty elsewhere).
    Raises:
        Whatever the run raises (under MPI a failed rank aborts the whole job first; a second
        Ctrl-C raises KeyboardInterrupt, or under MPI aborts with 130).
    """
    from yatt import logs

    logs.setup(cfg.log.level)  # first: before torch and the libraries are imported
    from yatt.checkpoint.triggers import catch_early, release_early

    catch_early(tuple(cfg.checkpoint.on_signals))  # a SIGTERM (Ctrl-C) while models load: exit 75 (130), not 15
    try:
        return _execute(cfg, require_launcher, keep_process_group)
    finally:
        release_early()


def _execute(cfg, require_launcher: bool, keep_process_group: bool) -> tuple[int, list[dict]]:
    """:func:`execute`'s body, run with the start-up signal latch installed."""
    from yatt.dist import LauncherError, discover
    from yatt.paths import check_job_paths

    from yatt.run_lock import RunLocked, check_free

    try:
        info = discover(require_launcher=require_launcher)
        check_job_paths(cfg)
        check_free(cfg.output_dir)  # another job's folder: said before torch starts (rank 0 locks it below)
        _check_output_dir(cfg)
        _check_resume_layout(cfg, info.world_size)
        _check_model_parallel(cfg, info.world_size)
        _check_placement(cfg, info)
        _check_estimator(cfg)
        _check_env(cfg)
    except (ConfigError, LauncherError, RunLocked) as e:
        _report(e)
        return 2, []

    _setup_env(cfg.threads_per_rank)
    from yatt.dist import init_distributed

    info = init_distributed(threads=cfg.threads_per_rank)
    try:  # one job per run folder (a job that started meanwhile loses here), then again what it holds
        lock = _lock_output_dir(cfg, info)
        _check_output_dir(cfg)
    except ConfigError as e:
        _report(e)
        code, records = 2, []
    else:
        try:
            code, records = _run_locked(cfg, info)
        finally:
            if lock is not None:
                lock.release()
    if not keep_process_group:
        _end_process_group()
    return code, records


def _end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run_locked(cfg, info) -> tuple[int, list[dict]]:
    """The job on this rank, once rank 0 holds the run folder's lock: the output folder set up,
    the watchdog started, the run, and its end mapped to an exit code (:func:`execute`)."""
    from yatt import logs

    logging.basicConfig(level=logging.INFO if info.rank == 0 else logging.WARNING,
                        format=f"[yatt r{info.rank} %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("yatt")
    log.info("world %d (%s), threads/rank %s, output %s",
             info.world_size, info.source, os.environ.get("OMP_NUM_THREADS"), cfg.output_dir)
    if info.rank == 0:
        log.info("%s", logs.native_runtime())
    if cfg.overwrite:  # a fresh run: the old run's checkpoints must not be resumed later
        cfg.resume = "none"
        if info.rank == 0:
            from yatt.checkpoint.files import checkpoint_root

            shutil.rmtree(checkpoint_root(cfg), ignore_errors=True)
    if info.rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
            import yaml

            yaml.safe_dump(cfg.model_dump(), f, sort_keys=False)

    from yatt.checkpoint.run_state import CheckpointDamaged
    from yatt.checkpoint.saver import CheckpointWriteError
    from yatt.checkpoint.triggers import EXIT_SAVE_FAILED, Preempted
    from yatt.loop import run

    watchdog = None
    if cfg.fault.watchdog:  # a dead or hung rank ends the job within fault.timeout_s, named
        from yatt.watchdog import Watchdog

        watchdog = Watchdog(info.rank, info.world_size, cfg.fault.timeout_s, stall_s=cfg.fault.stall_s)
        watchdog.start()
        watchdog.phase("startup", 0)
    code, records = 0, []
    try:
        records = run(cfg, info, watchdog)
    except Preempted as e:  # every rank: the checkpoint is committed
        if info.rank == 0:
            log.warning("%s; exiting with code %d (run the same command again to resume)", e, e.exit_code)
        code = e.exit_code
    except CheckpointWriteError as e:  # every rank: the failed save is agreed on; the job ends cleanly, not 0
        logging.getLogger("yatt").error("%s; exiting with code %d", e, EXIT_SAVE_FAILED)
        code = EXIT_SAVE_FAILED
    except CheckpointDamaged as e:  # every rank (rank 0 checked, all were told): nothing trained from it
        if info.rank == 0:
            logging.getLogger("yatt").error("%s; exiting with code 2", e)
        code = 2
    except BaseException as e:
        if info.world_size > 1 and info.source == "mpi":
            from yatt.dist import abort_job

            if isinstance(e, KeyboardInterrupt):
                abort_job(f"yatt: rank {info.rank}: a second Ctrl-C, stopping at once (the newest committed "
                          "checkpoint is intact)", EXIT_INTERRUPTED, traceback=False)
            abort_job(f"yatt: rank {info.rank} failed; aborting the job")
        raise
    if watchdog is not None:
        watchdog.stop()  # before the process group (and rank 0's store) goes away
    return code, records if info.rank == 0 else []


def exit_process(code: int) -> NoReturn:
    """End the process with exit code ``code``, skipping the interpreter's teardown.

    After a job, the interpreter's teardown (every module of torch, vLLM, Megatron-Core and
    transformers: ~0.8 M objects) took ~4 s per rank on the dev machine (2026-12-02) and frees
    nothing the OS does not free at exit. What a normal exit does that matters still happens, in
    its order: threading's exit hooks run (a ``concurrent.futures`` pool, which a reward function or
    a tool may leave open, wakes its idle workers to end; joined without that they wait forever)
    and non-daemon threads are joined, the ``atexit`` handlers run (logging's flush), MPI is
    finalized after a clean job (mpi4py would do it at C-level exit; without it MPICH's 2 MB
    ``/dev/shm`` segment stayed behind after every run), stdout and stderr are flushed. Call it
    only after the job's files are closed (:func:`main` returns after that).
    """
    threading._shutdown()  # the interpreter's first exit step: threading's exit hooks, then every non-daemon join
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # mpi4py finalizes at C-level exit, which os._exit skips
    if code == 0 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # else MPICH's /dev/shm segment outlives the job (after a failure: no wait on peers)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
