"""Code written for flash-attn 2.8.3 imports: the module-level names of its public modules that
user code and flash-attn's own tests import, here with the same meaning. Runs on CPU: none of
these imports may need a built extension."""

import importlib
import inspect

import pytest
import torch

NAMES = {
    "flash_attn": ["__version__", "flash_attn_func", "flash_attn_kvpacked_func",
                   "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                   "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                   "flash_attn_with_kvcache"],
    "flash_attn.flash_attn_interface": [
        "USE_TRITON_ROCM", "maybe_contiguous", "round_multiple", "_get_block_size_n",
        "_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward",
        "_flash_attn_varlen_backward", "_wrapped_flash_attn_forward",
        "_wrapped_flash_attn_varlen_forward", "_wrapped_flash_attn_backward",
        "_wrapped_flash_attn_varlen_backward", "_torch_custom_op_wrapper",
        "_torch_register_fake_wrapper", "FlashAttnQKVPackedFunc", "FlashAttnVarlenQKVPackedFunc",
        "FlashAttnKVPackedFunc", "FlashAttnVarlenKVPackedFunc", "FlashAttnFunc",
        "FlashAttnVarlenFunc", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
        "flash_attn_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_func", "flash_attn_with_kvcache"],
    "flash_attn.bert_padding": ["IndexFirstAxis", "index_first_axis", "IndexPutFirstAxis",
                                "index_put_first_axis", "IndexFirstAxisResidual",
                                "index_first_axis_residual", "unpad_input",
                                "unpad_input_for_concatenated_sequences", "pad_input"],
    "flash_attn.layers.rotary": ["rotate_half", "apply_rotary_emb_torch", "ApplyRotaryEmb",
                                 "apply_rotary_emb", "apply_rotary_emb_func", "ApplyRotaryEmbQKV_",
                                 "apply_rotary_emb_qkv_", "ApplyRotaryEmbKV_",
                                 "apply_rotary_emb_kv_", "RotaryEmbedding"],
    "flash_attn.layers.patch_embed": ["PatchEmbed"],
    "flash_attn.ops.triton.rotary": ["apply_rotary", "rotary_kernel"],
    "flash_attn.ops.triton.layer_norm": ["layer_norm_ref", "rms_norm_ref", "layer_norm_fn",
                                         "rms_norm_fn", "LayerNormFn", "RMSNorm",
                                         "LayerNormLinearFn", "layer_norm_linear_fn",
                                         "triton_autotune_configs", "maybe_contiguous",
                                         "maybe_contiguous_lastdim"],
    "flash_attn.ops.triton.cross_entropy": ["cross_entropy_loss", "CrossEntropyLoss"],
    "flash_attn.losses.cross_entropy": ["CrossEntropyLoss"],
    "flash_attn.ops.activations": ["bias_gelu", "bias_gelu_back", "gelu_fwd", "gelu_bwd",
                                   "bias_gelu_impl", "relu_bwd", "sqrelu_fwd", "sqrelu_bwd",
                                   "swiglu", "swiglu_fwd", "swiglu_bwd", "SwiGLUFunction",
                                   "GeLUFunction", "FastGeLUFunction", "fast_gelu_impl"],
    "flash_attn.ops.fused_dense": ["FusedDenseFunc", "fused_dense_func", "FusedDense",
                                   "ColumnParallelLinear", "RowParallelLinear", "FusedMLPFunc",
                                   "fused_mlp_func", "FusedMLP", "ParallelFusedMLP"],
    "flash_attn.ops.layer_norm": ["DropoutAddLayerNormFn", "DropoutAddLayerNormSubsetFn",
                                  "DropoutAddLayerNormParallelResidualFn",
                                  "layer_norm", "dropout_add_layer_norm",
                                  "dropout_add_layer_norm_subset",
                                  "dropout_add_layer_norm_parallel_residual",
                                  "DropoutAddLayerNorm"],
    "flash_attn.ops.rms_norm": ["rms_norm", "dropout_add_rms_norm", "dropout_add_rms_norm_subset",
                                "dropout_add_rms_norm_parallel_residual", "RMSNorm",
                                "DropoutAddRMSNorm"],
    "flash_attn.modules.mha": ["FlashSelfAttention", "FlashCrossAttention", "SelfAttention",
                               "CrossAttention", "LinearResidual", "MHA", "ParallelMHA",
                               "get_alibi_slopes", "_update_kv_cache"],
    "flash_attn.modules.mlp": ["Mlp", "ParallelMLP", "GatedMlp", "ParallelGatedMlp"],
    "flash_attn.modules.block": ["Block", "ParallelBlock"],
    "flash_attn.modules.embedding": ["GPT2Embeddings", "BertEmbeddings", "VocabParallelEmbedding",
                                     "ColumnParallelEmbedding", "ParallelGPT2Embeddings"],
    "flash_attn.models.gpt": ["GPTPreTrainedModel", "GPTModel", "GPTLMHeadModel",
                              "create_mixer_cls", "create_mlp_cls", "create_block",
                              "remap_state_dict_hf_gpt2", "shard_state_dict_tp",
                              "combine_state_dicts_tp", "remap_state_dict_megatron"],
    "flash_attn.models.bert": ["BertModel", "BertForPreTraining", "BertPreTrainedModel",
                               "remap_state_dict", "inv_remap_state_dict", "create_mixer_cls",
                               "create_mlp_cls", "create_block"],
    "flash_attn.models.vit": ["VisionTransformer", "vit_base_patch16_224", "create_mixer_cls",
                              "create_mlp_cls", "init_weights_vit_timm"],
    "flash_attn.models.llama": ["remap_state_dict_hf_llama", "inv_remap_state_dict_hf_llama",
                                "llama_config_to_gpt2_config", "config_from_meta_checkpoint",
                                "config_from_hf_checkpoint", "config_from_checkpoint",
                                "state_dicts_from_checkpoint", "remap_state_dict_meta_llama"],
    "flash_attn.models.falcon": ["falcon_config_to_gpt2_config", "remap_state_dict_hf_falcon"],
    "flash_attn.models.bigcode": ["bigcode_config_to_gpt2_config", "remap_state_dict_hf_bigcode",
                                  "inv_remap_state_dict_hf_bigcode"],
    "flash_attn.models.baichuan": ["baichuan_config_to_gpt2_config",
                                   "remap_state_dict_hf_baichuan"],
    "flash_attn.models.btlm": ["btlm_config_to_gpt2_config", "remap_state_dict_hf_btlm"],
    "flash_attn.models.gpt_neox": ["remap_state_dict_hf_gpt_neox", "gpt_neox_config_to_gpt2_config"],
    "flash_attn.models.gptj": ["remap_state_dict_hf_gptj", "gptj_config_to_gpt2_config"],
    "flash_attn.models.opt": ["remap_state_dict_hf_opt", "opt_config_to_gpt2_config"],
    "flash_attn.utils.generation": ["InferenceParams", "modify_logits_for_min_p_filtering",
                                    "modify_logits_for_top_k_filtering",
                                    "modify_logits_for_top_p_filtering",
                                    "modify_logit_for_repetition_penalty", "sample", "decode",
                                    "GenerationMixin", "DecodingCGCache", "update_graph_cache",
                                    "capture_graph", "GreedySearchDecoderOnlyOutput",
                                    "SampleDecoderOnlyOutput", "decode_speculative",
                                    "sample_speculative", "allocate_inference_cache"],
    "flash_attn.utils.testing": ["construct_chunk_mask"],
    "flash_attn.ops.triton.linear": ["triton_linear_act", "triton_dgrad_act"],
    "flash_attn.ops.triton.k_activations": ["gelu", "gelu_grad", "gelu_approx", "gelu_approx_grad",
                                            "squared_relu", "squared_relu_grad"],
    "flash_attn.ops.triton.mlp": ["FusedDenseSqreluDense", "FusedDenseSqreluDenseFunc",
                                  "fused_dense_sqrelu_dense_function"],
    "flash_attn.utils.distributed": ["all_gather_raw", "all_gather", "reduce_scatter_raw",
                                     "reduce_scatter", "all_reduce_raw", "all_reduce",
                                     "sync_shared_params", "allreduce_sequence_parallel_grad",
                                     "get_dim_for_local_rank", "AllGatherFunc",
                                     "ReduceScatterFunc", "AllReduceFunc"],
    "flash_attn.utils.benchmark": ["benchmark_forward", "benchmark_backward", "benchmark_combined",
                                   "benchmark_fwd_bwd", "benchmark_all", "pytorch_profiler",
                                   "benchmark_memory"],
    "flash_attn.utils.pretrained": ["state_dict_from_pretrained"],
}


@pytest.mark.parametrize("module", list(NAMES))
def test_flash_attn_2_8_names_import(module):
    imported = importlib.import_module(module)
    missing = [name for name in NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


# flash-attn 2.8.3's private ops, as (parameter names, defaults of the trailing ones).
PRIVATE_OP_SIGNATURES = {
    "_flash_attn_forward": (
        "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
        "alibi_slopes return_softmax", {}),
    "_flash_attn_varlen_forward": (
        "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale causal "
        "window_size_left window_size_right softcap alibi_slopes return_softmax block_table "
        "leftpad_k seqused_k zero_tensors",
        dict(window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
             return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
             zero_tensors=False)),
    "_flash_attn_backward": (
        "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left "
        "window_size_right softcap alibi_slopes deterministic rng_state", dict(rng_state=None)),
    "_flash_attn_varlen_backward": (
        "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k "
        "dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
        "deterministic rng_state zero_tensors", dict(rng_state=None, zero_tensors=False)),
}


@pytest.mark.parametrize("name", list(PRIVATE_OP_SIGNATURES))
def test_private_ops_have_flash_attn_2_8_signatures(name):
    import flash_attn.flash_attn_interface as fai

    params, defaults = PRIVATE_OP_SIGNATURES[name]
    assert callable(getattr(fai, name))
    schema = getattr(torch.ops.flash_attn, name).default._schema
    assert [a.name for a in schema.arguments] == params.split(), name
    got = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    assert got == defaults, name


def test_interface_flags_and_helpers():
    import flash_attn.flash_attn_interface as fai

    assert fai.USE_TRITON_ROCM is False  # CUDA kernels only: the ROCm Triton backend is not here
    assert fai.round_multiple(130, 128) == 256 and fai.round_multiple(128, 128) == 128
    x = torch.randn(4, 6)[:, ::2]
    assert fai.maybe_contiguous(x).is_contiguous() and fai.maybe_contiguous(None) is None
    y = torch.randn(4, 6)
    assert fai.maybe_contiguous(y) is y
    for name in ("forward", "varlen_forward", "backward", "varlen_backward"):
        wrapped = getattr(fai, f"_wrapped_flash_attn_{name}")
        assert wrapped._qualified_op_name == f"flash_attn::_flash_attn_{name}"
    assert inspect.isclass(fai.FlashAttnFunc)


def test_flash_attn_gpu_is_the_extension_or_the_clear_error():
    import flash_attn.flash_attn_interface as fai
    from flash_attn._native import MissingExtensionError, extension_available

    if extension_available("flash_attn_2_cuda"):
        assert fai.flash_attn_gpu.__name__ == "flash_attn_2_cuda"
    else:
        with pytest.raises(MissingExtensionError, match="flash_attn_2_cuda"):
            fai.flash_attn_gpu  # noqa: B018


def test_flash_attn_2_8_test_module_imports():
    """flash-attn's own tests/test_flash_attn.py starts with these imports."""
    from flash_attn.bert_padding import pad_input, unpad_input  # noqa: F401
    from flash_attn.flash_attn_interface import USE_TRITON_ROCM, _get_block_size_n  # noqa: F401
    from flash_attn.layers.rotary import apply_rotary_emb  # noqa: F401


@pytest.mark.gpu
def test_private_ops_called_as_ring_attention_libraries_do():
    """The forward/backward ops with keyword arguments and their defaults give flash_attn_func's
    results (what context-parallel libraries build on)."""
    import flash_attn.flash_attn_interface as fai

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out, lse, _, rng_state = fai._flash_attn_forward(
        q, k, v, dropout_p=0.0, softmax_scale=0.125, causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0, alibi_slopes=None, return_softmax=False)
    ref = fai.flash_attn_func(q, k, v, softmax_scale=0.125, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.125, True, -1, 0, 0.0,
                             None, False)
    ref.backward(dout)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    cu = torch.tensor([0, 128, 256], device="cuda", dtype=torch.int32)
    flat = [t.detach().reshape(256, 4, 64) for t in (q, k, v)]
    out_varlen, *_ = fai._flash_attn_varlen_forward(*flat, cu, cu, 128, 128, 0.0, 0.125, True)
    torch.testing.assert_close(out_varlen.reshape_as(out), out, rtol=0, atol=0)


def test_triton_layer_norm_helpers():
    import triton

    from flash_attn.ops.triton.layer_norm import triton_autotune_configs

    configs = triton_autotune_configs()
    assert configs and all(isinstance(c, triton.Config) for c in configs)
    assert [c.num_warps for c in configs] == [1, 2, 4, 8, 16, 32]


@pytest.mark.gpu
def test_subset_fn_under_flash_attn_argument_order():
    from flash_attn.ops.layer_norm import DropoutAddLayerNormSubsetFn, dropout_add_layer_norm_subset

    torch.manual_seed(0)
    x0 = torch.randn(6, 64, device="cuda", dtype=torch.float16)
    residual = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    gamma, beta = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    x0_subset = torch.tensor([1, 0, 6, 3], device="cuda", dtype=torch.int32)
    out_subset = torch.tensor([2, 1, 0, 3], device="cuda", dtype=torch.int32)
    ours = DropoutAddLayerNormSubsetFn.apply(x0, residual, gamma, beta, None, x0_subset, out_subset,
                                             0.0, 1e-5, 0.5, 3)
    theirs = dropout_add_layer_norm_subset(x0, residual, gamma, beta, 0.0, 1e-5, x0_subset=x0_subset,
                                           out_subset=out_subset, rowscale_const=0.5, out_numrows=3)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
