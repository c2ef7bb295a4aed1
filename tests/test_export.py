"""``python -m yatt.export``: trainer checkpoint -> self-contained HF folder.

Checkpoints are written here by hand in the format of the trainer's checkpoints (``meta.json``,
``model/tp{t}_pp{p}.pt`` with stage-local names, ``latest``):

* a real ``MegatronPolicy`` (tiny Qwen2, tied embeddings, TP=1) after one optimizer step: the
  export loaded by transformers and by vLLM gives the trainer's logprobs;
* TP=2 x PP=2 shards cut from a tiny HF model with ``hf_to_megatron``: the export is
  bit-identical to the HF tensors (tied / untied, Llama / Qwen2 QKV bias, bf16, sharded output);
* error cases and the CLI.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yatt.checkpoint import files
from yatt.export import export_checkpoint, main

from conftest import trainer_tp as ref


ROOT = Path(__file__).resolve().parents[1]
TRAINER_ATOL = 1e-4  # exported weights in transformers vs the trainer, fp32; measured 2e-6
VLLM_ATOL = 1e-3  # vLLM vs transformers / trainer (as tests/test_rollout.py HF_ATOL); measured 2e-6
TOKENIZER_FILES = ref.TOKENIZER_FILES


def write_checkpoint(root: Path, step: int, shards: dict[tuple[int, int], dict], *, model_path: Path,
                     dtype: str = "float32", latest: bool = True) -> Path:
    """A committed checkpoint ``root/step_{step:06d}`` from ``{(tp_rank, stage): state_dict}``."""
    tp, pp = max(t for t, _ in shards) + 1, max(p for _, p in shards) + 1
    step_dir = root / f"step_{step:06d}"
    (step_dir / "model").mkdir(parents=True)
    for (t, p), state in shards.items():
        torch.save(state, step_dir / "model" / f"tp{t}_pp{p}.pt")
    written = {f"model/{p.name}": dict(zip(("bytes", "crc32"), files.crc32_file(p)))
               for p in (step_dir / "model").iterdir()}  # what the trainer's commit records
    meta = {"format": files.FORMAT, "step": step, "tp": tp, "pp": pp, "dtype": dtype, "model_path": str(model_path),
            "config": {"trainer": {"lr": 1e-3}}, "files": written}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    if latest:
        (root / "latest").write_text(step_dir.name + "\n")
    return step_dir


def split_tp_pp(hf_state: dict, layout, pp: int) -> dict[tuple[int, int], dict]:
    """What each (TP rank, stage) GPTModel holds: hf_to_megatron per rank, layers renumbered
    stage-locally, embedding on stage 0, final norm / output layer on the last stage (tied: a
    copy of the embedding, perturbed here so that reading it instead of skipping it shows),
    plus the None ``_extra_state`` entries that ``state_dict()`` carries."""
    from yatt.trainer.hf_mapping import hf_to_megatron, stage_layers

    out = {}
    for r in range(layout.tp):
        full = dict(hf_to_megatron(hf_state, layout, r))
        for s in range(pp):
            layers, last = stage_layers(layout, pp, s), s == pp - 1
            local = {}
            for name, t in full.items():
                if name.startswith("decoder.layers."):
                    k, rest = name[len("decoder.layers."):].split(".", 1)
                    if int(k) in layers:
                        prefix = f"decoder.layers.{int(k) - layers.start}."
                        local[prefix + rest] = t.clone()
                        if rest.endswith("linear_qkv.weight"):
                            local[prefix + "self_attention.linear_qkv._extra_state"] = None
                elif name == "embedding.word_embeddings.weight":
                    if s == 0:
                        local[name] = t.clone()
                    if last and layout.tied_embeddings and pp > 1:
                        local["output_layer.weight"] = t + 1.0
                elif last:
                    local[name] = t.clone()
            if last:
                local["output_layer._extra_state"] = None
            out[r, s] = local
    return out


# ---------------------------------------------------------------- a trained MegatronPolicy

@pytest.fixture(scope="module")
def trained(world1, tmp_path_factory):
    """(base HF folder, initial HF model, checkpoint root, policy after one step, sequences)."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    base = tmp_path_factory.mktemp("base")
    initial = ref.save_tiny_vllm(base, tied=True)
    policy = MegatronPolicy(base, optim=OptimConfig(lr=1e-3))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (17, 30)]
    mbs = [{"input_ids": torch.tensor([s]), "mask": torch.ones(1, len(s))} for s in seqs]
    stats = policy.train_step(mbs, ref.sum_logprob_loss)
    assert stats["update_skipped"] == 0 and stats["grad_norm"] > 0
    root = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(root, 1, {(0, 0): policy.module.state_dict()}, model_path=base)
    return base, initial, root, policy, seqs


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    return export_checkpoint(trained[2], tmp_path_factory.mktemp("export") / "hf")  # root: follows latest


def _hf_logprobs(model, seqs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [ref.hf_logprobs_entropy(model, torch.tensor([s]))[0][0, 1:] for s in seqs]


def test_trained_checkpoint_exports_to_transformers(trained, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, initial, _, policy, seqs = trained
    assert sorted(p.name for p in exported.iterdir()) == sorted(["config.json", "model.safetensors", *TOKENIZER_FILES])
    config = json.loads((exported / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    theirs = _hf_logprobs(model, seqs)
    ours = [lp[0, 1:] for lp, _ in policy.compute_logprobs([{"input_ids": torch.tensor([s])} for s in seqs])]
    err = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    assert err < TRAINER_ATOL, err
    moved = max((a - b).abs().max().item() for a, b in zip(_hf_logprobs(initial, seqs), theirs, strict=True))
    assert moved > 100 * TRAINER_ATOL, f"export equals the untrained model ({moved})"  # a stale export fails
    tok = AutoTokenizer.from_pretrained(exported)  # tokenizer and chat template travel with the weights
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def test_a_trained_critic_exports_as_sequence_classification_and_loads_back(world1, trained, tmp_path):
    """PPO's critic (value head from 0 on the tiny policy) after one step, checkpointed beside the
    actor: ``--role critic`` writes a one-label sequence-classification folder; transformers' hidden
    states x its ``score`` give the critic's values, and a critic built from the export has them."""
    from transformers import AutoModelForSequenceClassification

    from yatt.trainer.actor import OptimConfig
    from yatt.trainer.critic import MegatronCritic

    base, _, _, _, seqs = trained
    critic = MegatronCritic(base, optim=OptimConfig(lr=1e-2))
    mbs = [{"input_ids": torch.tensor([s]), "response_mask": torch.ones(1, len(s)),
            "target": torch.full((1, len(s)), 0.5)} for s in seqs]
    assert all(v.eq(0).all() for v in critic.compute_values(mbs))  # the head starts at zero
    assert critic.train_step(mbs, ref.value_loss)["grad_norm"] > 0
    root = tmp_path / "ckpt"
    step = write_checkpoint(root, 1, {(0, 0): critic.module.state_dict()}, model_path=base)
    (step / "model" / "tp0_pp0.pt").rename(step / "model" / "critic_tp0_pp0.pt")
    meta = json.loads((step / "meta.json").read_text())
    meta["files"] = {k.replace("tp0", "critic_tp0"): v for k, v in meta["files"].items()}
    with pytest.raises(ValueError, match="has no critic"):
        (step / "meta.json").write_text(json.dumps(meta))
        export_checkpoint(root, tmp_path / "none", role="critic")
    (step / "meta.json").write_text(json.dumps({**meta, "critic_model_path": str(base)}))
    assert main([str(root), str(tmp_path / "critic"), "--role", "critic"]) == 0
    out = tmp_path / "critic"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["num_labels"] == 1
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ours = critic.compute_values(mbs)
    with torch.no_grad():
        theirs = [ref.hf_values(hf, hf.score.weight, mb["input_ids"]) for mb in mbs]
    err = max((a[0, 1:] - b[0, 1:]).abs().max().item() for a, b in zip(ours, theirs))
    assert err < TRAINER_ATOL and all(v.abs().max() > 1e-3 for v in ours), err
    again = MegatronCritic(out, head_init_std=0.5)  # the export is a critic's start (critic.model); its head wins
    for a, b in zip(again.compute_values(mbs), ours):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_reward_model_head_starts_random_and_seeded(world1, trained):
    """Stage rm's head (``head_init_std`` > 0) is drawn from N(0, std^2) by ``head_seed``, the same
    on every rank; through a zero head (PPO's critic) the body gets no gradient at all."""
    from yatt.trainer.critic import MegatronCritic

    base = trained[0]
    heads = [MegatronCritic(base, head_init_std=0.02, head_seed=seed).module.output_layer.weight.detach().clone()
             for seed in (3, 3, 4)]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert 0.01 < heads[0].std().item() < 0.03 and heads[0].mean().abs().item() < 0.01

    def body_grad(std):
        critic = MegatronCritic(base, head_init_std=std)
        critic.module.requires_grad_(True)  # built without an optimizer: a bare GPTModel, plain .grad
        ids = torch.tensor([trained[4][0]])
        values = critic.module(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[..., 0]
        values.sum().backward()
        return critic.module.decoder.layers[0].mlp.linear_fc2.weight.grad.abs().max().item()

    assert body_grad(0.0) == 0 and body_grad(0.02) > 0


@pytest.mark.slow
def test_vllm_loads_the_export(world1, trained, exported):
    from transformers import AutoModelForCausalLM

    from yatt.rollout import VLLMEngine

    seqs, threads = trained[4], torch.get_num_threads()
    engine = VLLMEngine(str(exported), max_model_len=128, kv_cache_memory_bytes=32 << 20, seed=0)
    try:
        scored = engine.score(seqs)
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    theirs = _hf_logprobs(AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval(), seqs)
    trainer = [lp[0, 1:] for lp, _ in trained[3].compute_logprobs([{"input_ids": torch.tensor([s])} for s in seqs])]
    for ref_lp in (theirs, trainer):
        err = max((torch.tensor(s[1:]) - t).abs().max().item() for s, t in zip(scored, ref_lp, strict=True))
        assert err < VLLM_ATOL, err


# ---------------------------------------------------------------- TP=2 x PP=2, bit for bit

@pytest.mark.parametrize("model_type,tied,dtype,shard_size", [
    ("llama", False, "float32", None),
    ("llama", True, "bfloat16", None),
    ("qwen2", True, "float32", None),
    ("qwen2", False, "float32", 200_000),  # several safetensors files + index
])
def test_tp2_pp2_merge_is_bit_identical(tmp_path, model_type, tied, dtype, shard_size):
    from safetensors.torch import load_file

    from yatt.trainer.hf_mapping import layout_from_hf
    from yatt.trainer.model import SafetensorsState, read_hf_config

    base = tmp_path / "base"
    ref.save_tiny_hf(base, model_type, vocab_size=101, tied=tied, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)  # vocab padded to 102 at TP=2
    hf_state = {k: v.to(getattr(torch, dtype)) for k, v in load_file(base / "model.safetensors").items()}
    layout = layout_from_hf(read_hf_config(base), tp=2)
    shards = split_tp_pp(hf_state, layout, pp=2)
    emb = "embedding.word_embeddings.weight"
    assert not torch.equal(shards[0, 0][emb], shards[1, 0][emb])  # really split over TP
    assert "decoder.layers.1.mlp.linear_fc2.weight" in shards[0, 1]  # global layer 3, stage-local 1
    assert "decoder.layers.2.mlp.linear_fc2.weight" not in shards[0, 1]
    step = write_checkpoint(tmp_path / "ckpt", 7, shards, model_path=base, dtype=dtype)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    out = export_checkpoint(step, tmp_path / "out", **kwargs)
    assert (out / "model.safetensors.index.json").exists() == (shard_size is not None)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if shard_size is None:
        assert files == ["model.safetensors"]
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    got = SafetensorsState(out)
    assert set(got) == set(hf_state) and ("lm_head.weight" in got) == (not tied)
    bad = [n for n in got if not (got[n].dtype == hf_state[n].dtype and torch.equal(got[n], hf_state[n]))]
    assert not bad, bad
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == dtype and config["tie_word_embeddings"] is tied
    assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in read_hf_config(base).items() if k not in ("dtype", "torch_dtype")}


# ---------------------------------------------------------------- errors and the CLI

@pytest.fixture
def small_ckpt(tmp_path):
    """(root with latest -> step_000003, base folder) of a tiny Llama at TP=1, PP=2."""
    from safetensors.torch import load_file

    from yatt.trainer.hf_mapping import layout_from_hf
    from yatt.trainer.model import read_hf_config

    base = tmp_path / "base"
    ref.save_tiny_hf(base, "llama", vocab_size=100, tied=True)
    shards = split_tp_pp(load_file(base / "model.safetensors"), layout_from_hf(read_hf_config(base), 1), pp=2)
    write_checkpoint(tmp_path / "ckpt", 3, shards, model_path=base)
    return tmp_path / "ckpt", base


def test_uncommitted_and_missing_pieces_are_refused(small_ckpt, tmp_path):
    root, _ = small_ckpt
    step = root / "step_000003"
    tmp_step = root / "step_000004.tmp"
    shutil.copytree(step, tmp_step)  # complete, but not committed
    with pytest.raises(FileNotFoundError, match=r"step_000004\.tmp"):
        export_checkpoint(tmp_step, tmp_path / "a")
    for pointer in ("step_000004.tmp\n", "step_000009\n", None):  # bad or no latest: the newest complete step
        (root / "latest").unlink(missing_ok=True)
        if pointer:
            (root / "latest").write_text(pointer)
        assert files.resolve(root) == step
    (root / "latest").write_text("step_000003\n")
    (step / "model" / "tp0_pp1.pt").rename(tmp_path / "moved.pt")
    with pytest.raises(ValueError, match=r"does not verify: .*tp0_pp1\.pt: missing"):
        export_checkpoint(root, tmp_path / "a")
    (tmp_path / "moved.pt").rename(step / "model" / "tp0_pp1.pt")
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "pp": 1}))  # stage 1's layers and norm are not read
    with pytest.raises(ValueError, match="lacks"):
        export_checkpoint(root, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (step / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        export_checkpoint(step, tmp_path / "a")


def test_out_dir_is_replaced_only_when_asked_and_never_half_written(small_ckpt, tmp_path, monkeypatch):
    import yatt.export

    root, _ = small_ckpt
    out = tmp_path / "out"
    out.mkdir()
    assert export_checkpoint(root, out) == out  # an empty folder is fine
    (out / "stray.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export_checkpoint(root, out)
    assert (out / "stray.txt").exists()
    with pytest.raises(PermissionError, match=r"OUT_DIR: .*stray.txt is a file, so .* cannot be created under it"):
        export_checkpoint(root, out / "stray.txt" / "hf")  # before any weight is read

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(yatt.export, "_write_folder", crash)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(root, out, overwrite=True)
    assert (out / "stray.txt").exists()  # the old folder is untouched by a failed export
    with pytest.raises(OSError):
        export_checkpoint(root, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "out"]  # no temp folders left
    monkeypatch.undo()
    export_checkpoint(root, out, overwrite=True)
    assert not (out / "stray.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "out"]


def test_cli(small_ckpt, tmp_path, capsys):
    root, _ = small_ckpt
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "yatt.export", str(root), str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "out").iterdir()}
    # error path in-process (same code as `python -m`): exit status 2 and the message on stderr
    assert main([str(root / "step_000003.tmp"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("yatt.export: ") and "step_000003.tmp" in err
    assert main([str(root), str(tmp_path / "out")]) == 2 and "not empty" in capsys.readouterr().err
