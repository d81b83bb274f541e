"""Autoregressive generation with a kv cache: sampling (greedy, top-k, top-p, min-p,
temperature, repetition penalty), `decode`, `GenerationMixin.generate`, and decoding steps
replayed from CUDA graphs (cg=True).

A model plugs in by accepting (input_ids, position_ids, inference_params, num_last_tokens),
returning an object with `.logits`, and implementing allocate_inference_cache (for cg=True).
"""

import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from flash_attn.utils.autocast import compute_dtype


@dataclass
class InferenceParams:
    """State of one generation shared by every layer: the caches (layer_idx -> (batch,
    max_seqlen, 2, nheads_kv, head_dim)), how many positions they hold (seqlen_offset), and,
    for CUDA-graph decoding, the same as a per-sample tensor (lengths_per_sample)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        self.max_seqlen, self.max_batch_size = max_seqlen, max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


# ----------------------------------------------------------------------------------------------
# Sampling.
# ----------------------------------------------------------------------------------------------


def modify_logits_for_top_k_filtering(logits, top_k):
    """In place: -inf for every token below the top_k most likely ones (ties at the k-th logit
    stay)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits.masked_fill_(logits < kth_largest, float("-inf"))


def modify_logits_for_top_p_filtering(logits, top_p):
    """In place: -inf outside the smallest set of tokens whose probabilities sum to >= top_p."""
    if top_p <= 0.0 or top_p >= 1.0:
        return
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # A token goes when the tokens below it (itself included) hold at most 1 - top_p of the mass;
    # the most likely token always stays.
    drop_sorted = tail_mass <= 1.0 - top_p
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logits.masked_fill_(drop, float("-inf"))


def modify_logits_for_min_p_filtering(logits, min_p):
    """In place: -inf for tokens less likely than min_p times the most likely one."""
    if min_p <= 0.0 or min_p >= 1.0:
        return
    probs = logits.softmax(dim=-1)
    logits.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def modify_logit_for_repetition_penalty(logits, prev_output_tokens, repetition_penalty=1.0):
    """CTRL's penalty: tokens already produced get logit / penalty (positive) or * penalty."""
    if repetition_penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, prev_output_tokens)
    seen = torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty)
    return logits.scatter(1, prev_output_tokens, seen)


def sample(logits, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0):
    """logits (batch, vocab) -> token ids (batch,). top_k=1 is greedy; top_k=0 means no top-k
    cut; top_p / min_p filter what remains; temperature divides the logits first."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    else:
        logits = logits.clone()
    if top_k > 0:
        top_k = min(top_k, logits.shape[-1])
        logits, indices = torch.topk(logits, top_k, dim=-1)
    else:
        indices = None
    modify_logits_for_top_p_filtering(logits, top_p)
    modify_logits_for_min_p_filtering(logits, min_p)
    choice = torch.multinomial(logits.softmax(dim=-1), num_samples=1)
    if indices is not None:
        choice = torch.gather(indices, -1, choice)
    return choice.squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Decoding loop.
# ----------------------------------------------------------------------------------------------


@dataclass
class DecodeOutput:
    sequences: torch.Tensor
    scores: Optional[tuple] = None


GreedySearchDecoderOnlyOutput = SampleDecoderOnlyOutput = DecodeOutput


@torch.inference_mode()
def decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
           repetition_penalty=1.0, eos_token_id=None, teacher_outputs=None, vocab_size=None,
           cg=False, enable_timing=False, output_scores=False):
    """Generate until max_length tokens (prompt included) or until every sequence's last token
    is eos_token_id. One prefill pass over the prompt, then one token per step from the kv cache.

    teacher_outputs (batch, >= max_length): force those tokens instead of sampling (tests).
    vocab_size: ignore logits past it (the padded part of the vocabulary).
    cg: replay each decoding step from a CUDA graph captured once per (batch, max_length).
    Returns DecodeOutput(sequences (batch, <= max_length), scores: per-step logits).
    """
    batch_size, seqlen_og = input_ids.shape
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    if cg:
        if not input_ids.is_cuda:
            raise ValueError("decode: cg=True (CUDA graphs) needs a model and inputs on a GPU")
        model._decoding_cache = update_graph_cache(
            model, getattr(model, "_decoding_cache", None), batch_size, seqlen_og, max_length)
        inference_params = model._decoding_cache.inference_params
        inference_params.reset(max_length, batch_size)
    else:
        inference_params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def get_logits(tokens):
        offset = inference_params.seqlen_offset
        if offset == 0:
            logits = model(tokens, inference_params=inference_params, num_last_tokens=1).logits
        else:
            position_ids = torch.full((batch_size, 1), offset, dtype=torch.long,
                                      device=tokens.device)
            if cg:
                logits = model._decoding_cache.run(tokens, position_ids, offset)
            else:
                logits = model(tokens, position_ids=position_ids,
                               inference_params=inference_params, num_last_tokens=1).logits
        logits = logits.squeeze(1)
        return logits[..., :vocab_size] if vocab_size is not None else logits

    def next_token(logits):
        if inference_params.seqlen_offset < teacher_len:
            return teacher_outputs[:, inference_params.seqlen_offset]
        return sample(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)

    def done(last):
        if inference_params.seqlen_offset == 0:
            return False
        if eos_token_id is not None and bool((last == eos_token_id).all()):
            return True
        return inference_params.seqlen_offset >= max_length - 1

    if enable_timing:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
    sequences, scores = [input_ids], []
    history = input_ids
    while not done(sequences[-1]):
        logits = get_logits(sequences[-1])
        if output_scores:
            scores.append(logits.clone())
        inference_params.seqlen_offset += sequences[-1].shape[1]
        if repetition_penalty != 1.0:
            logits = modify_logit_for_repetition_penalty(logits.clone(), history, repetition_penalty)
        token = next_token(logits).unsqueeze(1)
        history = torch.cat([history, token], dim=1)
        sequences.append(token)
    if enable_timing:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        print(f"decode: {(time.perf_counter() - start) * 1000:.1f} ms")
    return DecodeOutput(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


class GenerationMixin:
    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        raise NotImplementedError

    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, **kwargs):
        """decode() on this model: the sequences, or DecodeOutput with return_dict_in_generate."""
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p,
                        temperature=temperature, output_scores=output_scores, **kwargs)
        if not output_scores:
            output.scores = None
        return output if return_dict_in_generate else output.sequences


# ----------------------------------------------------------------------------------------------
# CUDA graphs: one captured decoding step per (batch size, tokens per step).
# ----------------------------------------------------------------------------------------------


@dataclass
class DecodingCGCache:
    max_batch_size: int = 0
    max_seqlen: int = 0
    device: Optional[torch.device] = None
    dtype: Optional[torch.dtype] = None
    callables: dict = field(default_factory=dict)
    mempool: Optional[tuple] = None
    inference_params: Optional[InferenceParams] = None
    run: Optional[Callable] = None


@torch.inference_mode()
def update_graph_cache(model, cache, batch_size, seqlen_og, max_seqlen, decoding_seqlens=(1,),
                       dtype=None, n_warmups=2):
    """Reuse the captured graphs when they fit (same device/dtype, batch and length within what
    was allocated); otherwise allocate new kv caches and capture again."""
    cache = cache if cache is not None else DecodingCGCache()
    param = next(iter(model.parameters()))
    # The kv cache holds what attention sees: autocast's dtype when it is on, not the weights'.
    device = param.device
    dtype = dtype if dtype is not None else compute_dtype(device.type, param.dtype)
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size
            or max_seqlen > cache.max_seqlen):
        cache.callables, cache.mempool, cache.inference_params = {}, None, None
        gc.collect()
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        cache.inference_params = InferenceParams(
            max_seqlen=max_seqlen, max_batch_size=batch_size, seqlen_offset=seqlen_og,
            key_value_memory_dict=model.allocate_inference_cache(batch_size, max_seqlen, dtype),
            lengths_per_sample=torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device))
        cache.mempool = torch.cuda.graphs.graph_pool_handle()
    for decoding_seqlen in decoding_seqlens:
        if (batch_size, decoding_seqlen) not in cache.callables:
            cache.callables[batch_size, decoding_seqlen] = capture_graph(
                model, cache.inference_params, batch_size, max_seqlen, decoding_seqlen,
                cache.mempool, n_warmups)

    def dispatch(input_ids, position_ids, seqlen):
        return cache.callables[input_ids.shape[0], input_ids.shape[1]](input_ids, position_ids, seqlen)

    cache.run = dispatch
    cache.inference_params.seqlen_offset = 0
    return cache


def _autocast_without_cache(device_type):
    """The caller's autocast state with its weight-cast cache off: a graph captured with cached
    casts would keep reading their memory after autocast exits and frees them, so the casts must
    be captured as kernels of the graph."""
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                          enabled=torch.is_autocast_enabled(device_type), cache_enabled=False)


def capture_graph(model, inference_params, batch_size, max_seqlen, decoding_seqlen=1,
                  mempool=None, n_warmups=2):
    """Capture one decoding step. Inside the graph the cache position comes from the tensor
    inference_params.lengths_per_sample (a Python int would be frozen into the graph)."""
    device = next(iter(model.parameters())).device
    input_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    position_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    saved_offset = inference_params.seqlen_offset
    # Any offset > 0 selects the decoding path; the largest one exercises the whole cache.
    inference_params.seqlen_offset = max_seqlen - decoding_seqlen
    inference_params.lengths_per_sample[:] = inference_params.seqlen_offset

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params,
                     num_last_tokens=decoding_seqlen).logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _autocast_without_cache("cuda"):
        for _ in range(n_warmups):
            step()
        side.synchronize()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool), _autocast_without_cache("cuda"):
        logits = step()

    def run(new_input_ids, new_position_ids, seqlen):
        inference_params.lengths_per_sample[:] = seqlen
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        graph.replay()
        return logits.clone()

    inference_params.seqlen_offset = saved_offset
    return run
