"""Evaluate a policy without training: ``python -m yatt.eval --config FILE [options] [key=value ...]``.

The model is a YATT checkpoint (``--checkpoint``: its policy weights are pushed into an engine of its
base model, as the weight sync of a run does), an HF folder or packaged model name (``--model``), or
the config's ``model.path``. Each eval set (``eval.sets``, ``--sets``; by default the data section's
eval split, named ``eval``) is prompted as the data section says and scored by ``reward.accuracy``'s
source, with the code of a run's evals (:func:`yatt.controller.evaluate.evaluate`): the greedy
answer's accuracy and, with ``--k``/``eval.k`` > 1, mean@k and pass@j of k sampled answers.

Runs as one process or under ``mpirun``/``srun``/torchrun: each rank evaluates its shard of every set
(the split a run's evals use) and the metrics are reduced. Rank 0 prints a table and writes
``--json``. A bad path (checkpoint, model, eval file, JSON folder) stops it before any model loads
with a message naming the option, exit status 2.
"""
from __future__ import annotations

import os

if __name__ == "__main__":  # first: this may restart the process with tcmalloc and Intel OpenMP preloaded
    from yatt.preload import restart_with_preload

    restart_with_preload()

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as yatt.launch: before torch's first allocation

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from yatt.config import Config, ConfigError, load_config  # noqa: E402
from yatt.controller.eval_sets import EvalSet, resolve_sets, shard_sets  # noqa: E402

log = logging.getLogger("yatt")


@dataclass(frozen=True)
class ModelSource:
    """What is evaluated: ``base`` (a packaged name or HF folder: the engine's model, config and
    tokenizer) and, for a checkpoint, its step folder (the policy weights pushed into the engine)."""

    base: str
    checkpoint: Path | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m yatt.eval", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML recipe, e.g. configs/grpo_smollm2.yaml")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="YATT checkpoint: a step folder (step_000020) or a checkpoint root")
    src.add_argument("--model", help="HF folder (e.g. from python -m yatt.export) or packaged model name")
    ap.add_argument("--k", type=int, help="sampled answers per prompt for mean@k / pass@k (eval.k; 1: greedy only)")
    ap.add_argument("--temperature", type=float, help="sampling temperature of the k answers (eval.temperature)")
    ap.add_argument("--sets", help="comma-separated sets: names of eval.sets, 'eval' (the data section's eval "
                                   "split), reasoning-gym task names or jsonl/parquet files (default: eval.sets, "
                                   "else 'eval')")
    ap.add_argument("--limit", type=int, help="evaluate only the first N rows of each set")
    ap.add_argument("--json", help="also write the results to this JSON file (rank 0)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.max_tokens=64 data.eval_size=32")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (every rank runs it); returns the exit status: 0, or 2 for a bad config,
    option or path (the message on stderr, from rank 0)."""
    from yatt.launch import _report

    args = parse_args(argv)
    cli = {"eval.k": args.k, "eval.temperature": args.temperature}
    try:
        cfg = load_config(args.config, args.overrides, values={k: v for k, v in cli.items() if v is not None})
        from yatt import logs

        logs.setup(cfg.log.level)  # before torch is imported (the checkpoint's checks import it)
        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"--limit: must be >= 1, got {args.limit}")
        source = model_source(cfg, args.checkpoint, args.model)
        sets = resolve_sets(cfg, args.sets)
        if args.json:
            from yatt.paths import writable_dir

            if problem := writable_dir(Path(args.json).expanduser().absolute().parent, "--json", option=True):
                raise ConfigError(problem)
    except ConfigError as e:
        _report(e)
        return 2
    try:
        run(cfg, source, sets, args.limit, args.json)
    except BaseException:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
            from yatt.dist import abort_job

            abort_job(f"yatt.eval: rank {mpi.COMM_WORLD.Get_rank()} failed; aborting the job")
        raise
    return 0


def model_source(cfg: Config, checkpoint: str | None, model: str | None) -> ModelSource:
    """The model to evaluate, checked (no weights are read beyond the checkpoint's checksums).

    Raises:
        ConfigError: naming ``--checkpoint``, ``--model`` or ``model.path``: no complete checkpoint
            there, one that does not verify or has no policy (stage rm), a folder without
            ``config.json``, or a name that is neither a folder nor a packaged model.
    """
    from yatt.assets.model import _PACKAGED  # the packaged model names

    def check_model(name: str, key: str) -> str:
        path = Path(name).expanduser()
        if path.is_dir() and not (path / "config.json").is_file():
            raise ConfigError(f"{key}: {name} is not a Hugging Face model folder (no config.json)")
        if not path.is_dir() and name not in _PACKAGED:
            raise ConfigError(f"{key}: {name} is neither a folder nor a packaged model ({', '.join(_PACKAGED)})")
        return name

    if model is not None:
        return ModelSource(check_model(model, "--model"))
    if checkpoint is None:
        return ModelSource(check_model(cfg.model.path, "config key 'model.path'"))
    from yatt.checkpoint import files
    from yatt.export import read_meta

    try:
        step = files.resolve(checkpoint)
        meta = read_meta(step)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--checkpoint: {e}") from None
    if meta.get("config", {}).get("stage") == "rm":
        raise ConfigError(f"--checkpoint: {step} is a reward model's (stage rm trains no policy)")
    if damaged := files.verify(step, under="model/"):
        raise ConfigError(f"--checkpoint: {step} does not verify: {'; '.join(damaged)}")
    base = meta["model_path"]  # the folder the run loaded; on another machine, the config's model.path
    if not (Path(base) / "config.json").is_file():
        base = check_model(cfg.model.path, f"config key 'model.path' (the base model of {step}, {base}, is gone)")
    return ModelSource(base, step)


def checkpoint_weights(step: Path, base: Path):
    """``(HF name, full tensor)`` of the policy in checkpoint ``step`` (its model shards merged
    with the mapping the weight sync uses, or a LoRA checkpoint's adapters merged into the base
    weights: :func:`yatt.export.full_state_dict`), for ``VLLMEngine.update_weights``; ``base``
    holds the model's ``config.json`` (and, for LoRA, its weights)."""
    from yatt.export import full_state_dict, read_meta

    return iter(full_state_dict(step, read_meta(step), json.loads((base / "config.json").read_text()), base).items())


def run(cfg: Config, source: ModelSource, sets: list[EvalSet], limit: int | None = None,
        json_path: str | None = None) -> dict:
    """Evaluate ``source`` on ``sets`` on this rank (collective: every rank calls it). Rank 0
    prints the table and writes ``json_path``.

    Returns:
        The report (every rank): ``model``, ``checkpoint``, ``world_size``, the eval settings, and
        ``sets``: ``{name: {"rows": int, "accuracy": float, ...}}``, the metrics of
        :func:`yatt.controller.evaluate.evaluate` without prefix (none for a set without rows).
    """
    from yatt import logs
    from yatt.launch import _setup_env

    logs.setup(cfg.log.level)  # before torch and the libraries are imported (main did it already)
    _setup_env(cfg.threads_per_rank)
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from yatt.assets.model import resolve_model_once
    from yatt.controller.evaluate import evaluate
    from yatt.controller.metrics import global_means
    from yatt.dist import init_distributed
    from yatt.rollout.vllm_engine import VLLMEngine

    info = init_distributed(threads=cfg.threads_per_rank)
    logging.basicConfig(level=logging.INFO if info.rank == 0 else logging.WARNING,
                        format=f"[yatt r{info.rank} %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    base = resolve_model_once(source.base, info.rank)
    log.info("eval: %s%s on %s over %d rank(s), k=%d", base, f" with the weights of {source.checkpoint}"
             if source.checkpoint else "", ", ".join(s.name for s in sets), info.world_size, cfg.eval.k)
    tokenizer = AutoTokenizer.from_pretrained(base)
    shards = shard_sets(cfg, sets, tokenizer, info.rank, info.world_size, limit)
    # the engine of a run's rollout (yatt.job.build_job), so that greedy answers are the same
    engine = VLLMEngine(str(base), tp=cfg.rollout.tp, max_model_len=cfg.rollout.max_model_len,
                        kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes, seed=cfg.seed * 7919 + info.rank,
                        dtype=cfg.model.dtype, progress="eval" if info.rank == 0 and cfg.log.progress else None)
    results = {}
    try:
        if source.checkpoint is not None:  # as the weight sync does after a step
            engine.update_weights(checkpoint_weights(source.checkpoint, base))
        for s, rows, score in shards:
            n = round(global_means({"rows": (float(len(rows)), 1.0)}, op_sum=("rows",))["rows"])
            if not n:
                log.warning("eval set %s: no rows (all skipped, or none there): no metrics", s.name)
            results[s.name] = {"rows": n, **(evaluate(engine, rows, score, tokenizer, cfg.eval.max_tokens, k=cfg.eval.k,
                                                      temperature=cfg.eval.temperature, seed=cfg.seed * 1_000_003,
                                                      prefix="") if n else {})}
    finally:
        engine.shutdown()
    report = {"model": str(base), "checkpoint": str(source.checkpoint) if source.checkpoint else None,
              "world_size": info.world_size, "k": cfg.eval.k, "temperature": cfg.eval.temperature,
              "max_tokens": cfg.eval.max_tokens, "limit": limit, "sets": results}
    if info.rank == 0:
        print(format_table(results), flush=True)
        if json_path:
            out = Path(json_path).expanduser()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
            log.info("eval: wrote %s", json_path)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return report


def format_table(results: dict[str, dict]) -> str:
    """``results`` (set -> metrics) as a plain-text table: a row per set, a column per metric
    (``-`` where a set has none)."""
    def order(c: str) -> tuple:  # the greedy metrics by name, then mean_at_k, then pass_at_j by j
        return ("_at_" in c, c.startswith("pass_at_"), int(c.rsplit("_", 1)[1]) if "_at_" in c else 0, c)

    cols = ["rows"] + sorted({k for m in results.values() for k in m} - {"rows"}, key=order)
    cells = [["set", *cols]] + [[name, *(_cell(m.get(c)) for c in cols)] for name, m in results.items()]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


def _cell(v) -> str:
    return "-" if v is None else str(v) if isinstance(v, int) else f"{v:.4f}"


if __name__ == "__main__":
    from yatt.launch import exit_process

    exit_process(main())
