"""Padding-free micro-batches (yatt.trainer.packing): the layout, its attention plan, the mask, and
logprobs, values and gradients equal to the padded rows' on a tiny Llama and a tiny Qwen2 (world 1, fp32)."""
from __future__ import annotations

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
    assert lay["packed_ids"].shape == (1, 14)  # 5, 3 and 6 tokens in one row, no padding
    for b, (p, r) in enumerate(SAMPLES[:3]):
        seq = p + r
        assert ids[idx[b, :len(seq)]].tolist() == seq and pos[idx[b, :len(seq)]].tolist() == list(range(len(seq)))
        assert (idx[b, len(seq):] == -1).all()
    assert (idx[3] == -1).all()  # an empty response: nothing to score, left out
    assert lay["packed_segments"].tolist() == [[0] * 5 + [1] * 3 + [2] * 6] and (lay["packed_branches"] == 0).all()


def test_shared_prompt_rows_hold_each_prompt_once():
    lay = pack_rows([p for p, _ in SAMPLES], [r for _, r in SAMPLES], width=6, mode="shared_prompt")
    ids, pos, idx = lay["packed_ids"].flatten(), lay["packed_positions"].flatten(), lay["packed_index"]
    assert lay["packed_ids"].shape == (1, 11)  # P1 + 2 + 3 tokens (8), P2 + 1 (3)
    for b, (p, r) in enumerate(SAMPLES[:3]):
        seq = p + r
        assert ids[idx[b, :len(seq)]].tolist() == seq and pos[idx[b, :len(seq)]].tolist() == list(range(len(seq)))
    assert idx[0, :3].tolist() == idx[2, :3].tolist()  # one prompt copy
    branches = lay["packed_branches"].flatten()
    assert branches[idx[0, 3:5]].tolist() == [1, 1] and branches[idx[2, 3:6]].tolist() == [2, 2, 2]
    assert branches[idx[0, :3]].tolist() == [0, 0, 0]


def test_attention_mask_keeps_each_response_to_its_prompt_and_itself():
    # one row: prompt (2 tokens), response 1 (2), response 2 (1); then a second document (2)
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1]], dtype=torch.int32)
    br = torch.tensor([[0, 0, 1, 1, 2, 0, 0]], dtype=torch.int32)
    allowed = ~attention_mask(seg, br)[0, 0]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],  # response 2 skips response 1
        [0, 0, 0, 0, 0, 1, 0],  # the second document starts afresh
        [0, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, want)


def test_a_micro_batch_without_responses_runs_one_placeholder_token():
    for mode in ("packed", "shared_prompt"):
        lay = pack_rows([P1, P2], [[], []], width=4, mode=mode)
        assert lay["packed_ids"].tolist() == [[0]] and (lay["packed_index"] == -1).all()
        assert lay["packed_trunk"].tolist() == [[0]] and lay["packed_gather"].tolist() == [0]


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="packing mode"):
        pack_rows([P1], [[1]], 4, mode="thd")
    with pytest.raises(ValueError, match="wider than its row"):
        pack_rows([P1], [[1, 2]], 4)


def test_micro_batches_count_the_tokens_the_model_body_runs():
    samples = ref.group_samples(99, seed=3)  # 3 prompts x 3 responses, one empty; a group split in two
    tokens = {mode: [mb["body_tokens"].tolist() for mb in pack_micro_batches(samples, ref.GROUP_SPLIT, 0, mode)]
              for mode in ("padded", "packed", "shared_prompt")}
    assert tokens == {"padded": [[47, 80], [31, 40]],  # padding: 33 and 9
                      "packed": [[40, 40], [31, 31]],  # no padding; the empty response's prompt is left out
                      "shared_prompt": [[30, 30], [23, 23]]}  # each prompt once per micro-batch


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


def test_the_attention_plan_gathers_each_trunk_and_each_branch_with_its_trunk():
    """Shared prompt: two trunks (the prompts, padded to the longer), three branches (the non-empty
    responses) whose keys are their prompt's then their own; every token's output row is its own."""
    lay = pack_rows([p for p, _ in SAMPLES], [r for _, r in SAMPLES], width=6, mode="shared_prompt")
    idx = lay["packed_index"]
    p1, p2 = idx[0, :3].tolist(), idx[1, :2].tolist()
    assert lay["packed_trunk"].tolist() == [p1, p2 + [0]]
    r0, r1, r2 = idx[0, 3:5].tolist(), idx[1, 2:3].tolist(), idx[2, 3:6].tolist()
    assert lay["packed_branch_q"].tolist() == [r0 + [0], r2, r1 + [0, 0]]
    assert lay["packed_branch_k"].tolist() == [p1 + r0 + [0], p1 + r2, p2 + [0] + r1 + [0, 0]]
    assert lay["packed_branch_lens"].tolist() == [[3, 2], [3, 3], [2, 1]]
    rows = torch.cat([lay["packed_trunk"].flatten(), lay["packed_branch_q"].flatten()])
    assert torch.equal(rows[lay["packed_gather"]], torch.arange(11))  # each position reads its own output


def test_packed_documents_hold_whole_samples_and_no_branches():
    lay = pack_rows([p for p, _ in SAMPLES], [r for _, r in SAMPLES], width=6, mode="packed")
    assert lay["packed_trunk"].tolist() == [[0, 1, 2, 3, 4, 0], [5, 6, 7, 0, 0, 0], list(range(8, 14))]
    assert lay["packed_branch_q"].numel() == 0 and torch.equal(lay["packed_gather"], torch.tensor(
        [0, 1, 2, 3, 4, 6, 7, 8, 12, 13, 14, 15, 16, 17]))
