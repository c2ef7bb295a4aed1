"""Resharding kernels and plans: bit-equality with plain torch slicing and with HF tensors.

Every parameter kind (embedding, QKV weight and Qwen2 bias, o_proj, norms, gate/up, down,
untied output layer, tied embeddings) for every (t, i) in {1, 2, 4}^2 on small random models,
and on the real SmolLM2 (Llama, tied) and Qwen2.5 judge (Qwen2, QKV bias) for the (t, i) their
head counts allow.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from yatt.reshard import BucketedSync, megatron_params, plan_buckets, run_copies
from yatt.reshard.plan import copy_blocks, target_shape
from yatt.trainer.hf_mapping import hf_to_megatron, layout_from_hf, megatron_to_hf

SIZES = (1, 2, 4)
ROOT = Path(__file__).resolve().parents[1]


def _config(model_type: str, tied: bool, vocab: int = 203) -> dict:
    # 8 heads / 4 KV heads, head dim 8, MLP 96: every t, i in {1, 2, 4} divides them. The
    # vocabulary is padded for t = 2, 4 and is not a multiple of vLLM's 64.
    return dict(model_type=model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=vocab,
                tie_word_embeddings=tied)


def _random_hf(cfg: dict, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, F, V, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    nq, ng = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    for k in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{k}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nq, H), p + "self_attn.k_proj.weight": (ng, H),
                       p + "self_attn.v_proj.weight": (ng, H), p + "self_attn.o_proj.weight": (H, nq),
                       p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                       p + "mlp.down_proj.weight": (H, F)})
        if cfg["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (ng,),
                           p + "self_attn.v_proj.bias": (ng,)})
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def _expected(hf: torch.Tensor, name: str, vocab: int, i: int, j: int) -> torch.Tensor:
    """Inference shard j of i, written out independently of the planner."""
    if name.endswith("norm.weight"):
        return hf
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vLLM: pad to 64, P/i rows each
        per = -(-vocab // 64) * 64 // i
        return hf[j * per:(j + 1) * per]
    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
    return hf.chunk(i, dim)[j]


def _kernel_shards(spec, shards, layout, i, j) -> dict[str, torch.Tensor]:
    outs = {n: torch.full(target_shape(n, s, layout, i, j), float("nan"), dtype=shards[0].dtype)
            for n, s in spec.targets}
    flat = [s.reshape(-1) for s in shards]
    run_copies([(flat, outs[n], blocks) for (n, _), blocks in zip(spec.targets, copy_blocks(spec, layout, i, j))],
               threads=2)
    return outs


def _check_model(cfg: dict, hf: dict[str, torch.Tensor], t: int, i: int) -> int:
    layout = layout_from_hf(cfg, t)
    by_rank = [dict(hf_to_megatron(hf, layout, r)) for r in range(t)]
    seen = set()
    for spec in megatron_params(layout):
        shards = [by_rank[r][spec.name] for r in range(t)] if spec.dim is not None else [by_rank[0][spec.name]]
        reference = dict(megatron_to_hf(spec.name, shards, layout))  # plain torch slicing / cat
        for j in range(i):
            for name, got in _kernel_shards(spec, shards, layout, i, j).items():
                want = _expected(hf[name], name, cfg["vocab_size"], i, j)
                assert torch.equal(got, want), f"{spec.name} -> {name} (t={t}, i={i}, j={j}) differs from HF"
                assert torch.equal(got, _expected(reference[name], name, cfg["vocab_size"], i, j))
                seen.add(name)
    expected_names = set(hf) - ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    assert seen == expected_names, f"HF tensors never produced: {expected_names - seen}"
    return len(seen)


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("t,i", list(itertools.product(SIZES, SIZES)))
def test_every_kind_bit_equal(model_type, tied, t, i):
    cfg = _config(model_type, tied)
    _check_model(cfg, _random_hf(cfg), t, i)


def test_bf16_and_vocab_smaller_than_tp_padding():
    cfg = _config("qwen2", False, vocab=61)  # one padded vLLM shard per rank at i=4 is mostly empty
    _check_model(cfg, _random_hf(cfg, torch.bfloat16), 4, 4)


def test_an_inference_tp_that_does_not_split_the_model_is_refused_by_name():
    from yatt.reshard.plan import check_inference_tp

    layout = layout_from_hf(_config("llama", False), 1)  # 8 heads, 4 KV heads, MLP 96, vocab 203 -> 256
    for i in (1, 2, 4):
        check_inference_tp(layout, i)
    with pytest.raises(ValueError, match=r"TP=3 must divide the model's heads \(8\), KV heads \(4\), padded vocabulary \(256\)$"):
        check_inference_tp(layout, 3)
    odd = layout_from_hf(_config("llama", False) | dict(num_attention_heads=6, num_key_value_heads=3,
                                                        intermediate_size=48, vocab_size=100), 1)
    with pytest.raises(ValueError, match=r"TP=3 must divide the model's padded vocabulary \(128\)$"):
        check_inference_tp(odd, 3)  # heads, KV heads and MLP split; vLLM's padded vocabulary does not
    with pytest.raises(ValueError, match="padded vocabulary"):
        target_shape("model.embed_tokens.weight", (100, 64), odd, 3, 0)


def _real(name: str):
    from yatt.assets.model import resolve_model
    from yatt.trainer.model import SafetensorsState, read_hf_config

    path = resolve_model(name)
    state = SafetensorsState(path)
    return read_hf_config(path), {n: state[n] for n in state}


@pytest.mark.parametrize("t,i", [(1, 1), (1, 3), (3, 1), (3, 3)])
def test_real_smollm2(t, i):
    """SmolLM2-135M (Llama, tied, 9 heads / 3 KV heads): t, i must divide 3."""
    cfg, hf = _real("smollm2-135m-instruct")
    assert _check_model(cfg, hf, t, i) == len(hf)


@pytest.mark.parametrize("t,i", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_real_qwen2_judge(t, i):
    """Qwen2.5-Coder-0.5B (Qwen2, QKV bias, 2 KV heads): t, i in {1, 2}."""
    from yatt.config import GenRMConfig

    cfg, hf = _real(GenRMConfig().model)
    assert _check_model(cfg, hf, t, i) == len(hf) - ("lm_head.weight" in hf and cfg["tie_word_embeddings"])


def test_kernel_strided_blocks_and_bounds():
    src = torch.arange(60, dtype=torch.float32)
    dst = torch.zeros(20)
    run_copies([([src], dst, np.array([[0, 2, 10, 1, 5, 3, 4]]))], threads=2)  # 3 rows of 4
    assert dst.tolist()[1:5] == [2, 3, 4, 5] and dst.tolist()[6:10] == [12, 13, 14, 15] and dst[0] == 0
    with pytest.raises(ValueError, match="outside its source"):
        run_copies([([src], dst, np.array([[0, 58, 4, 0, 4, 1, 4]]))])
    with pytest.raises(ValueError, match="outside its destination"):
        run_copies([([src], dst, np.array([[0, 0, 10, 0, 10, 3, 10]]))])
    with pytest.raises(ValueError, match="need a contiguous torch.float32"):
        run_copies([([src], dst.double(), np.array([[0, 0, 4, 0, 4, 1, 4]]))])


def test_kernel_many_threads_large_block():
    """One block shared by several threads, and many tiny blocks, give the same bytes as torch."""
    src = torch.randn(3 << 20)
    dst = torch.empty_like(src)
    run_copies([([src], dst, np.array([[0, 0, src.numel(), 0, src.numel(), 1, src.numel()]]))], threads=4)
    assert torch.equal(src, dst)
    n = 4096
    blocks = np.array([[0, k * 7, 7, (n - 1 - k) * 7, 7, 1, 7] for k in range(n)])
    dst = torch.empty(n * 7)
    run_copies([([src], dst, blocks)], threads=3)
    assert torch.equal(dst.view(n, 7), src[:n * 7].view(n, 7).flip(0))


def test_kernel_streams_the_strided_rows_of_a_large_plan():
    """A plan of >= 64 MiB writes its strided rows with non-temporal stores (AVX2 CPUs): rows of
    1004 bytes at destinations off 32-byte alignment (the unaligned head, the 32-byte body and the
    tail all run) give the same bytes as torch, and bytes between the rows stay untouched."""
    rows, width, src_stride, dst_stride = 70_000, 251, 300, 257  # 70.3 MB moved
    src = torch.randn(rows * src_stride)
    dst = torch.zeros(rows * dst_stride + 3)
    run_copies([([src], dst, np.array([[0, 5, src_stride, 3, dst_stride, rows, width]]))], threads=3)
    want = torch.zeros_like(dst)
    want[3:].view(rows, dst_stride)[:, :width] = src.view(rows, src_stride)[:, 5:5 + width]
    assert torch.equal(dst, want)


class _Module:
    """Stand-in holder of named parameters (what BucketedSync reads from a GPTModel)."""

    def __init__(self, named):
        self.named = named

    def named_parameters(self):
        return iter(self.named)


@pytest.mark.parametrize("bucket_bytes", [1, 20_000, 1 << 30])
def test_bucketed_sync_tp1_all_tensors_once(bucket_bytes):
    cfg = _config("qwen2", True)
    hf = _random_hf(cfg)
    layout = layout_from_hf(cfg, 1)
    module = _Module([("module." + n, p) for n, p in hf_to_megatron(hf, layout, 0)])
    sync = BucketedSync(module, layout, bucket_bytes=bucket_bytes)
    got = list(sync)
    assert sorted(n for n, _ in got) == sorted(set(hf))
    for name, tensor in got:
        assert torch.equal(tensor, hf[name]), name
    specs = megatron_params(layout)
    expect_buckets = {1: len(specs), 1 << 30: 1}.get(bucket_bytes)
    if expect_buckets:
        assert len(sync.buckets) == expect_buckets
    for bucket in sync.buckets[:-1]:  # full: the next parameter would not have fitted
        size = sum(4 * int(np.prod(s)) for spec in bucket for _, s in spec.targets)
        assert size <= bucket_bytes or len(bucket) == 1


def test_buckets_follow_pipeline_stages():
    layout = layout_from_hf(_config("llama", False) | {"num_hidden_layers": 4}, 2)
    specs = megatron_params(layout, pp=2)
    assert {s.stage for s in specs if s.name.startswith("embedding")} == {0}
    assert {s.stage for s in specs if s.name.startswith(("output_layer", "decoder.final"))} == {1}
    assert {s.stage for s in specs if ".layers.1." in s.name} == {0}
    assert {s.stage for s in specs if ".layers.2." in s.name} == {1}
    buckets = plan_buckets(specs, layout, 1 << 30, 4)
    assert len(buckets) == 2 and [{s.stage for s in b} for b in buckets] == [{0}, {1}]
    with pytest.raises(ValueError, match="PP=3"):
        megatron_params(layout, pp=3)


def test_tp1_sync_keeps_its_copies_and_views_between_runs_and_reads_the_live_weights():
    """TP=1: gate and up (contiguous rows) are views of fc1, q/k/v copies in a buffer the bucket keeps;
    a second sync hands out the same tensors, refreshed from the parameters as they are now."""
    cfg = _config("qwen2", True)
    hf = _random_hf(cfg)
    layout = layout_from_hf(cfg, 1)
    named = [(n, p.clone()) for n, p in hf_to_megatron(hf, layout, 0)]
    sync = BucketedSync(_Module(named), layout)
    first = dict(sync)
    fc1 = dict(named)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert first["model.layers.0.mlp.gate_proj.weight"].data_ptr() == fc1.data_ptr()  # a view, no copy
    qkv = dict(named)["decoder.layers.0.self_attention.linear_qkv.weight"]
    qkv.add_(1.0)  # an optimizer step writes in place
    second = dict(sync)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert second[q] is first[q]  # the kept buffer's tensor, written again
    assert torch.equal(second[q], hf[q] + 1.0) and torch.equal(second["model.layers.0.self_attn.k_proj.weight"],
                                                                 hf["model.layers.0.self_attn.k_proj.weight"] + 1.0)


def test_sync_rejects_a_module_of_another_shape():
    cfg = _config("llama", False)
    layout = layout_from_hf(cfg, 2)
    module = _Module(list(hf_to_megatron(_random_hf(cfg), layout_from_hf(cfg, 1), 0)))
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight: expected"):
        BucketedSync(module, layout)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_sources_compile(tmp_path):
    """csrc/*.cu builds into yatt._C with YATT_WITH_CUDA=ON (compile and link only: no GPU here)."""
    import pybind11

    search = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    cmake, ninja = shutil.which("cmake", path=search), shutil.which("ninja", path=search)
    build = tmp_path / "build"
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                    "-DYATT_WITH_CUDA=ON", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build / 'out'}"],
                   check=True, capture_output=True)
    proc = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list((build / "out").glob("_C*.so"))
