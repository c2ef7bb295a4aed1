"""VLLMEngine on the real SmolLM2-135M (fp32, CPU), one engine for the whole module.

vLLM runs in this pytest process: the fixture builds it once, then restores what it touched
(threads; torch.distributed if it created the world-of-1 group). The engine constructor
itself restores the global RNG states and ``torch.set_num_threads``.
"""
from __future__ import annotations

import gc
import math
import os
import weakref

import pytest
import torch

from yatt.assets.model import SMOLLM2, resolve_model
from yatt.rollout import Completion, SamplingSpec, VLLMEngine

QUESTIONS = ["What is 2+2?", "Say hi."]
SCORE_VS_SAMPLE_ATOL = 5e-5  # measured max 5.7e-6 (prefill vs decode kernels, fp32)
RESTORE_ATOL = 1e-5  # measured 0.0
HF_ATOL = 1e-3  # engine vs transformers logprobs; measured 3e-5 (6e-5 after a push); stale lm_head: ~2


@pytest.fixture(scope="module")
def path():
    return str(resolve_model(SMOLLM2))


@pytest.fixture(scope="module")
def tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def prompts(tok):
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def engine(path):
    import torch.distributed as dist

    from yatt.dist import init_distributed

    created = not dist.is_initialized()
    threads = torch.get_num_threads()
    init_distributed(threads=int(os.environ.get("OMP_NUM_THREADS", 1)))
    gc.freeze()  # as a job does before its engines (yatt.loop.run): the libraries' objects, frozen
    frozen = gc.get_freeze_count()
    eng = VLLMEngine(path, max_model_len=512, kv_cache_memory_bytes=256 << 20, seed=0)
    eng.frozen_by_build = gc.get_freeze_count() - frozen  # for test_shutdown_releases_reloaded_weights
    yield eng
    eng.shutdown()
    gc.unfreeze()
    torch.set_num_threads(threads)
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def state(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _check(comps: list[Completion], n: int, max_tokens: int, eos: int) -> None:
    assert len(comps) == n
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) and 1 <= len(c.token_ids) <= max_tokens
        assert all(isinstance(t, int) for t in c.token_ids)
        assert all(isinstance(x, float) and math.isfinite(x) and x <= 0.0 for x in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == max_tokens


def _same(a: list[list[Completion]], b: list[list[Completion]]) -> bool:
    """Same tokens and finish reasons; logprobs equal up to kernel noise (prefix-cache hits)."""
    flat = [(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return [len(x) for x in a] == [len(y) for y in b] and all(
        x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        and max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < RESTORE_ATOL for x, y in flat)


def test_generate_shapes_and_finish_reasons(engine, prompts, tok):
    out = engine.generate(prompts, SamplingSpec(n=2, max_tokens=6))
    assert len(out) == len(prompts)
    for comps in out:
        _check(comps, 2, 6, tok.eos_token_id)
    assert any(c.finish_reason == "length" for comps in out for c in comps)
    long = engine.generate(prompts, SamplingSpec(n=2, max_tokens=96, temperature=0.0))
    for comps in long:
        _check(comps, 2, 96, tok.eos_token_id)
    assert any(c.finish_reason == "stop" for comps in long for c in comps), "no sample hit EOS"
    assert engine.generate([], SamplingSpec()) == []


def test_greedy_is_deterministic(engine, prompts):
    spec = SamplingSpec(n=3, max_tokens=16, temperature=0.0)
    a, b = engine.generate(prompts, spec), engine.generate(prompts, spec)
    assert _same(a, b)
    assert all(c == comps[0] for comps in a for c in comps)


def test_seeded_sampling_is_reproducible(engine, prompts):
    spec = SamplingSpec(n=2, max_tokens=16, seed=1234)
    a, b = engine.generate(prompts, spec), engine.generate(prompts, spec)
    assert _same(a, b)
    ids = {tuple(c.token_ids) for comps in a for c in comps}
    assert len(ids) == 4, "samples of one call should differ"
    c = engine.generate(prompts, SamplingSpec(n=2, max_tokens=16))
    assert not _same(c, a)


def test_generate_leaves_global_rng_alone(engine, prompts):
    before = torch.get_rng_state()
    engine.generate(prompts, SamplingSpec(n=2, max_tokens=4))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_score_matches_sampled_logprobs(engine, prompts, temperature, top_p):
    # raw_logprobs mode: sampled-token logprobs are the unscaled model's, whatever the temperature
    out = engine.generate(prompts, SamplingSpec(n=2, max_tokens=32, temperature=temperature, top_p=top_p))
    seqs, comps = [], []
    for p, cs in zip(prompts, out):
        for c in cs:
            seqs.append(p + c.token_ids)
            comps.append((len(p), c))
    scores = engine.score(seqs)
    for s, seq, (plen, c) in zip(scores, seqs, comps):
        assert len(s) == len(seq) and s[0] == 0.0
        assert all(isinstance(x, float) and x <= 0.0 for x in s)
        diff = max(abs(a - b) for a, b in zip(s[plen:], c.logprobs))
        assert diff < SCORE_VS_SAMPLE_ATOL, diff


def _hf_logprobs(path: str, state: dict, seq: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(state, strict=False)  # tied lm_head follows embed_tokens
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def test_update_weights_in_place(engine, prompts, state, path):
    llm, core = engine._llm, engine._llm.llm_engine.engine_core
    seq = prompts[0] + engine.generate(prompts[:1], SamplingSpec(max_tokens=24, temperature=0.0))[0][0].token_ids
    base = torch.tensor(engine.score([seq])[0])

    mlp = dict(state)
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.3.mlp.{name}.weight"
        mlp[key] = state[key] * 1.5
    engine.update_weights(mlp.items())
    assert (torch.tensor(engine.score([seq])[0]) - base).abs().max() > 1e-2
    engine.update_weights(state.items())
    assert (torch.tensor(engine.score([seq])[0]) - base).abs().max() < RESTORE_ATOL

    # Tied embedding: the output layer must follow too (stale pre-packed lm_head trap).
    emb = dict(state)
    emb["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 1.1
    engine.update_weights(iter(emb.items()))  # any iterable, consumed once
    got = torch.tensor(engine.score([seq])[0])
    assert (got - base).abs().max() > 1e-2
    ref = _hf_logprobs(path, emb, seq)
    assert (got - ref).abs().max() < HF_ATOL, (got - ref).abs().max()
    engine.update_weights(state.items())
    assert (torch.tensor(engine.score([seq])[0]) - base).abs().max() < RESTORE_ATOL
    assert engine._llm is llm and engine._llm.llm_engine.engine_core is core  # no restart


def test_a_groups_samples_prefill_its_prompt_once(engine, prompts):
    """The n samples of a prompt share its KV blocks through the prefix cache: every whole block
    but the one holding the last prompt token is computed once. On CPU blocks are 32 tokens (vLLM's
    default there, 128, held no whole block of a short prompt, so each sample prefilled it again)."""
    from vllm import SamplingParams

    from yatt.rollout.vllm_engine import CPU_BLOCK_SIZE

    llm = engine._llm
    block = llm.llm_engine.vllm_config.cache_config.block_size
    assert block == CPU_BLOCK_SIZE or torch.cuda.is_available()
    ids = prompts[0] * 3  # a prompt over two whole blocks
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=4, max_tokens=2, seed=0), use_tqdm=False)
    assert len(ids) > 2 * block and out[0].num_cached_tokens == (len(ids) - 1) // block * block


def test_rejects_bad_input(engine):
    with pytest.raises(ValueError):
        engine.generate([[]], SamplingSpec())
    with pytest.raises(ValueError):
        engine.score([[1] * 600])


def test_generate_stream_yields_each_group_once_with_generate_samples(engine, prompts):
    spec = SamplingSpec(n=3, max_tokens=12, seed=42)
    streamed = list(engine.generate_stream(prompts, spec))
    assert sorted(i for i, _ in streamed) == list(range(len(prompts)))
    assert _same([g for _, g in sorted(streamed, key=lambda x: x[0])], engine.generate(prompts, spec))
    assert list(engine.generate_stream([], spec)) == []


def test_progress_bar_counts_every_sample_of_each_call(engine, prompts, capsys):
    import re

    spec = SamplingSpec(n=3, max_tokens=8, seed=5)
    calls = {"generate (vLLM's bar)": lambda: engine.generate(prompts, spec),
             "generate_stream (ours)": lambda: list(engine.generate_stream(prompts, spec)),
             "generate_within (ours)": lambda: engine.generate_within(prompts, spec, timeout_s=60.0)}
    capsys.readouterr()
    try:
        engine.progress = "rollout"
        for name, call in calls.items():  # 2 prompts x 3 samples each time, the bar finishes at 6/6
            call()
            err = capsys.readouterr().err.replace("\r", "\n")
            assert set(re.findall(r"rollout: +(\d+)%\|[^|]*\| (\d+)/(\d+)", err)) >= {("100", "6", "6")}, name
            assert not re.findall(r"\| (\d+)/(?!6\b)\d+", err), name  # no other total
        engine.progress = None
        engine.generate(prompts, spec)
        assert "rollout" not in capsys.readouterr().err
    finally:
        engine.progress = None


def test_shutdown_releases_reloaded_weights(engine, state):
    """Runs last in this module: it shuts the module's engine down.

    vLLM keeps per-layer in-place-reload records (holding the layer's tensors) in a module-level
    table that outlives the engine; without dropping them every rebuilt engine leaked its weights.
    vLLM's own start-up freezes the heap and its teardown unfreezes it for three full collections
    (seconds on CPU); the engine leaves the caller's frozen objects frozen, froze nothing of its
    own, and its one collection at shutdown frees the model.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    engine.update_weights(iter(state.items()))
    assert len(layerwise.LAYERWISE_INFO) > 0
    model = engine._llm.collective_rpc(lambda worker: weakref.ref(worker.model_runner.get_model()))[0]
    frozen = gc.get_freeze_count()
    # freezing raises the count; frozen objects that die lower it (the build let some go)
    assert model() is not None and frozen > 0 and engine.frozen_by_build <= 0
    engine.shutdown()
    assert model() is None and gc.get_freeze_count() > 0.9 * frozen  # not unfrozen (that gives 0)
    gc.collect()
    assert len(layerwise.LAYERWISE_INFO) == 0
