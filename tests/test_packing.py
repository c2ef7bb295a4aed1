"""Padding-free micro-batches (yatt.trainer.packing): the layout, the mask, and logprobs, values
and gradients equal to the padded rows' on a tiny Llama and a tiny Qwen2 (world 1, fp32)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import trainer_tp as ref
from yatt.controller.batch import Sample, pack_micro_batches
from yatt.trainer.packing import attention_mask, pack_rows

P1, P2 = [5, 6, 7], [8, 9]
SAMPLES = [(P1, [1, 2]), (P2, [3]), (P1, [4, 4, 4]), (P1, [])]


def test_packed_rows_hold_every_token_at_its_position():
    lay = pack_rows([p for p, _ in SAMPLES], [r for _, r in SAMPLES], width=6, mode="packed")
    ids, pos, idx = lay["packed_ids"].flatten(), lay["packed_positions"].flatten(), lay["packed_index"]
    assert lay["packed_ids"].shape == (3, 6)  # 5, 3 and 6 tokens in rows of 6 (first-fit decreasing)
    for b, (p, r) in enumerate(SAMPLES[:3]):
        seq = p + r
        assert ids[idx[b, :len(seq)]].tolist() == seq and pos[idx[b, :len(seq)]].tolist() == list(range(len(seq)))
        assert (idx[b, len(seq):] == -1).all()
    assert (idx[3] == -1).all()  # an empty response: nothing to score, left out
    assert int((lay["packed_segments"] >= 0).sum()) == 14 and (lay["packed_branches"] == 0).all()


def test_shared_prompt_rows_hold_each_prompt_once():
    lay = pack_rows([p for p, _ in SAMPLES], [r for _, r in SAMPLES], width=6, mode="shared_prompt")
    ids, pos, idx = lay["packed_ids"].flatten(), lay["packed_positions"].flatten(), lay["packed_index"]
    assert lay["packed_ids"].shape == (2, 8)  # P1 + 2 + 3 tokens (8), P2 + 1 (3)
    assert int((lay["packed_segments"] >= 0).sum()) == 11
    for b, (p, r) in enumerate(SAMPLES[:3]):
        seq = p + r
        assert ids[idx[b, :len(seq)]].tolist() == seq and pos[idx[b, :len(seq)]].tolist() == list(range(len(seq)))
    assert idx[0, :3].tolist() == idx[2, :3].tolist()  # one prompt copy
    branches = lay["packed_branches"].flatten()
    assert branches[idx[0, 3:5]].tolist() == [1, 1] and branches[idx[2, 3:6]].tolist() == [2, 2, 2]
    assert branches[idx[0, :3]].tolist() == [0, 0, 0]


def test_attention_mask_keeps_each_response_to_its_prompt_and_itself():
    # one row: prompt (2 tokens), response 1 (2), response 2 (1); then a second document (2), padding (1)
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1]], dtype=torch.int32)
    br = torch.tensor([[0, 0, 1, 1, 2, 0, 0, 0]], dtype=torch.int32)
    allowed = ~attention_mask(seg, br)[0, 0]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # response 2 skips response 1
        [0, 0, 0, 0, 0, 1, 0, 0],  # the second document starts afresh
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding attends to itself only (no fully masked query)
    ], dtype=torch.bool)
    assert torch.equal(allowed, want)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="packing mode"):
        pack_rows([P1], [[1]], 4, mode="thd")
    with pytest.raises(ValueError, match="wider than its row"):
        pack_rows([P1], [[1, 2]], 4)


def test_micro_batches_count_the_tokens_the_model_body_runs():
    samples = ref.group_samples(99, seed=3)  # 3 prompts x 3 responses, one empty; a group split in two
    tokens = {mode: [mb["body_tokens"].tolist() for mb in pack_micro_batches(samples, ref.GROUP_SPLIT, 0, mode)]
              for mode in ("padded", "packed", "shared_prompt")}
    assert tokens == {"padded": [[47, 80], [31, 40]],
                      "packed": [[40, 48], [31, 40]],  # the empty response's prompt is left out
                      "shared_prompt": [[30, 32], [23, 26]]}  # each prompt once per micro-batch


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packed_logprobs_grads_and_values_equal_padded(world1, tmp_path, model_type):
    """Every layout's logprobs, entropies and grad norm (tiny Llama, tied; tiny Qwen2, QKV bias) and
    a critic's values equal the padded rows' (fp32); at TP=3 and PP=2: tests/mpi/trainer_tp.py."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.critic import MegatronCritic

    ref.save_tiny_hf(tmp_path, model_type, vocab_size=99, tied=model_type == "llama")
    ref.packed_vs_padded(MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-3, total_steps=2)), 0, model_type)
    ref.save_tiny_critic(tmp_path / "critic")  # a Llama sequence classifier: the head is not 0
    ref.packed_vs_padded(MegatronCritic(tmp_path / "critic"), 0, "critic")


def test_a_short_group_is_one_document():
    """Responses short against ATTENTION_WIDTH: the whole group in one row, its prompt once, though
    the row is wider than twice the padded width."""
    prompt, responses = [7] * 4, [[1] * 6, [2] * 5, [3] * 6, [4] * 2]  # padded width 10
    lay = pack_rows([prompt] * 4, responses, width=10, mode="shared_prompt")
    assert tuple(lay["packed_ids"].shape) == (1, 4 + 6 + 5 + 6 + 2)
    ids, idx = lay["packed_ids"].flatten(), lay["packed_index"]
    for b, r in enumerate(responses):
        assert ids[idx[b, :4 + len(r)]].tolist() == prompt + r
    assert len(set(idx[:, 0].tolist())) == 1


def test_a_long_group_starts_another_copy_of_its_prompt():
    """Responses long against ATTENTION_WIDTH: one wide row would cost more attention than the
    prompt's copies, so each response gets its own (4 rows of 1004, not 1 of 4004)."""
    prompt, responses = [7] * 4, [[b + 1] * 1000 for b in range(4)]
    lay = pack_rows([prompt] * 4, responses, width=1004, mode="shared_prompt")
    assert tuple(lay["packed_ids"].shape) == (4, 1004)
    ids, idx = lay["packed_ids"].flatten(), lay["packed_index"]
    for b, r in enumerate(responses):
        assert ids[idx[b, :1004]].tolist() == prompt + r
    assert len(set(idx[:, 0].tolist())) == 4


def test_the_layout_costs_no_more_than_twice_the_padded_width():
    """Among its candidate widths the layout keeps the cheapest, so never a costlier one than the
    fixed cap of twice the padded width that packing used before."""
    from yatt.trainer.packing import ATTENTION_WIDTH, _layout

    rng = random.Random(5)
    for _ in range(50):
        p_len, n, groups = rng.randint(5, 200), rng.randint(1, 16), rng.randint(1, 4)
        prompts = [[g] * p_len for g in range(groups) for _ in range(n)]
        responses = [[1] * rng.randint(1, 600) for _ in prompts]
        width = p_len + max(map(len, responses))
        lay = pack_rows(prompts, responses, width, mode="shared_prompt")
        cost = lay["packed_ids"].numel() * (1 + lay["packed_ids"].shape[1] / ATTENTION_WIDTH)
        members = [(prompts[g * n], sorted(range(g * n, g * n + n), key=lambda b: -len(responses[b])))
                   for g in range(groups)]
        _, _, rows, W = _layout(members, [len(r) for r in responses], 2 * width)
        assert cost <= len(rows) * W * (1 + W / ATTENTION_WIDTH) + 1e-9
