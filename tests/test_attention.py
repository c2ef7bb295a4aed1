"""The fused core attention (yatt.trainer.attention) computes Megatron-Core's local attention."""
import pytest
import torch
import torch.nn.functional as F

from yatt.trainer.packing import attention_mask, pack_rows


def _pair(attention_dropout=0.0):
    """(Megatron's DotProductAttention, SdpaAttention) of one config: 4 heads in 2 query groups."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from yatt.trainer.attention import SdpaAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        masked_softmax_fusion=False, attention_dropout=attention_dropout, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32)
    return tuple(cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
                 for cls in (DotProductAttention, SdpaAttention))


def _packed_mask() -> tuple[torch.Tensor, int]:
    """Megatron's dense mask of a shared-prompt row with two documents and branches; (mask, width)."""
    lay = pack_rows([[5, 6, 7], [5, 6, 7], [8, 9]], [[1, 2], [3], [4, 4, 4]], width=5, mode="shared_prompt")
    return attention_mask(lay["packed_segments"], lay["packed_branches"]), lay["packed_ids"].shape[1]


@pytest.mark.parametrize("masked", [False, True])
def test_fused_attention_equals_megatrons_outputs_and_grads(world1, masked):
    """Causal rows (no mask) and a packed row with two documents and branches (an explicit mask):
    outputs and the grads of q, k, v equal Megatron's path to 1e-5, in fp32."""
    local, fused = _pair()
    mask, width = _packed_mask() if masked else (None, 12)
    rows = 2 if mask is None else mask.shape[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(width, rows, h, 16, generator=g) for h in (4, 2, 2))  # [S, B, heads, head_dim]
    assert fused._fused(q, k, None, None)  # the fused kernel runs, not Megatron's path
    out_grad = torch.randn(width, rows, 64, generator=g)
    results = []
    for module in (local, fused):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*inputs, mask)
        out.backward(out_grad)
        results.append([out.detach()] + [x.grad for x in inputs])
    assert results[0][0].abs().max() > 0.1
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_attention_dropout_in_training_takes_megatrons_path(world1):
    """With attention dropout while training, the fused module runs Megatron's own code (its RNG
    stream): same seed, same output; in eval mode it runs the fused kernel."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    local, fused = _pair(attention_dropout=0.5)
    q, k, v = (torch.randn(8, 2, h, 16) for h in (4, 2, 2))
    outs = []
    for module in (local, fused):
        with torch.random.fork_rng(devices=[]):
            model_parallel_cuda_manual_seed(5)
            outs.append(module(q, k, v, None))
    assert torch.equal(outs[0], outs[1]) and (outs[0] == 0).any()  # dropped probabilities
    local.eval(), fused.eval()
    torch.testing.assert_close(fused(q, k, v, None), local(q, k, v, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["packed", "shared_prompt"])
def test_document_attention_equals_megatrons_on_the_dense_mask(world1, mode):
    """A packed row's documents, attended one by one through the plan (trunks causal, branches
    against their trunk; an empty response left out): outputs and the grads of q, k, v equal
    Megatron's attention over the whole row with the dense block mask, to 1e-5 in fp32; so does
    the fallback to Megatron's path (e.g. attention dropout), which builds that mask from the plan."""
    from yatt.trainer.attention import DocumentAttention

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7], [1]]
    lay = pack_rows(prompts, [[1, 2], [3], [4, 4, 4], [], [2, 3, 4, 5]], width=7, mode=mode)
    plan = DocumentAttention.of(lay)
    mask = attention_mask(lay["packed_segments"], lay["packed_branches"])
    local, fused = _pair()
    S = lay["packed_ids"].shape[1]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(S, 1, h, 16, generator=g) for h in (4, 2, 2))
    out_grad = torch.randn(S, 1, 64, generator=g)
    results = []
    for module, kwargs in ((local, {"attention_mask": mask}), (fused, {"attention_mask": None, "packed_seq_params": plan})):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*inputs, **kwargs)
        out.backward(out_grad)
        results.append([out.detach()] + [x.grad for x in inputs])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    fused._fused = lambda *a: False  # a case the fused kernel does not cover: Megatron's path
    torch.testing.assert_close(fused(q, k, v, None, packed_seq_params=plan), results[0][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["packed", "shared_prompt"])
def test_varlen_plan_equals_megatrons_on_the_dense_mask(world1, mode):
    """The variable-length plan (each trunk and each response a query sequence, a response's keys
    its prompt's then its own, causal aligned at the ends) computes Megatron's attention over the
    whole row with the dense block mask: checked through ``flash_varlen.reference``, the function
    the CUDA kernel must equal (``flash_varlen.available`` checks that on the GPU)."""
    from yatt.trainer import flash_varlen

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7], [1]]
    lay = pack_rows(prompts, [[1, 2], [3], [4, 4, 4], [], [2, 3, 4, 5]], width=7, mode=mode)
    mask = attention_mask(lay["packed_segments"], lay["packed_branches"])
    local, _ = _pair()
    S = lay["packed_ids"].shape[1]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(S, 1, h, 16, generator=g) for h in (4, 2, 2))
    want = local(q, k, v, mask)[:, 0].reshape(S, 4, 16)
    keys = lay.get("packed_kv_index", torch.arange(S))
    got = flash_varlen.reference(q[:, 0], k[:, 0, :][keys], v[:, 0][keys], lay["packed_cu_q"], lay["packed_cu_k"],
                                 local.softmax_scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert lay["packed_max_lens"].tolist() == [int(x.diff().max()) for x in (lay["packed_cu_q"], lay["packed_cu_k"])]


def test_varlen_kernel_is_not_used_off_cuda():
    from yatt.trainer import flash_varlen

    q, k = torch.zeros(4, 4, 16, dtype=torch.bfloat16), torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    assert not flash_varlen.available(q, k)
