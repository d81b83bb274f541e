"""Autoregressive generation with a kv cache: sampling (greedy, top-k, top-p, min-p,
temperature, repetition penalty), `decode`, speculative decoding (`decode_speculative`: a draft
model proposes, the target verifies with `sample_speculative`), `GenerationMixin.generate`, and
decoding steps replayed from CUDA graphs (cg=True).

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


def _filtered_probs(logits, top_k, top_p, temperature):
    """softmax of logits (..., vocab) after temperature, top-k and top-p: the distribution that
    speculative sampling draws from and compares, for the draft and the target alike."""
    logits = logits.float() / temperature if temperature != 1.0 else logits.float().clone()
    if top_k > 0:
        modify_logits_for_top_k_filtering(logits, top_k)
    modify_logits_for_top_p_filtering(logits, top_p)
    return logits.softmax(dim=-1)


def _check_speculative_args(logits, logits_draft, tokens_draft, top_p):
    if tokens_draft.dim() != 2 or tokens_draft.dtype not in (torch.int32, torch.int64):
        raise ValueError("sample_speculative: tokens_draft must be an int32/int64 tensor (batch, "
                         f"n), got {tokens_draft.dtype} of shape {tuple(tokens_draft.shape)}")
    batch, n = tokens_draft.shape
    if logits.dim() != 3 or logits.shape[:2] != (batch, n + 1):
        raise ValueError(f"sample_speculative: logits must be (batch, n + 1, vocab) = ({batch}, "
                         f"{n + 1}, vocab), got {tuple(logits.shape)}")
    if logits_draft.shape != (batch, n, logits.shape[-1]):
        raise ValueError("sample_speculative: logits_draft must be (batch, n, vocab) = "
                         f"{(batch, n, logits.shape[-1])}, got {tuple(logits_draft.shape)}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"sample_speculative: top_p must be in [0, 1], got {top_p}")


def sample_speculative(logits, logits_draft, tokens_draft, top_k=1, top_p=0.0, temperature=1.0):
    """The target's verdict on n draft tokens (speculative sampling: Leviathan et al. 2023,
    Algorithm 1; Chen et al. 2023).

    logits (batch, n + 1, vocab): the target's logits at the n draft positions and one past them;
    logits_draft (batch, n, vocab): the logits the draft tokens were drawn from; tokens_draft
    (batch, n). With p the target's and q the draft's distribution (both after temperature,
    top-k and top-p), draft token i is accepted with probability min(1, p(x_i) / q(x_i)); the
    first rejected one is replaced by a draw from max(p - q, 0) (normalised), and when all n
    are accepted one more token is drawn from p at position n. Every emitted token is then
    distributed as the target's own sample given the tokens before it. top_k=1 (greedy): draft
    tokens are accepted while they equal the target's argmax, which replaces the first that
    does not.
    Returns tokens (batch, n + 1), in tokens_draft's dtype, and num_generated_tokens (batch,) in
    [1, n + 1]: row b's first num_generated_tokens[b] tokens are the output.
    """
    _check_speculative_args(logits, logits_draft, tokens_draft, top_p)
    if top_k == 1:
        target = logits.argmax(dim=-1).to(tokens_draft.dtype)
        num_accepted = (tokens_draft == target[:, :-1]).int().cumprod(dim=-1).sum(dim=-1)
        return target, num_accepted + 1
    batch = tokens_draft.shape[0]
    rows = torch.arange(batch, device=logits.device)
    probs = _filtered_probs(logits, top_k, top_p, temperature)
    probs_draft = _filtered_probs(logits_draft, top_k, top_p, temperature)
    index = tokens_draft.long().unsqueeze(-1)
    p = probs[:, :-1].gather(-1, index).squeeze(-1)
    q = probs_draft.gather(-1, index).squeeze(-1)
    # u < p / q without the division: q is 0 for a token the draft could not have drawn.
    accepted = torch.rand_like(p) * q < p
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)  # (batch,)
    residual = (probs[:, :-1] - probs_draft).clamp_(min=0.0)
    next_probs = torch.cat([residual, probs[:, -1:]], dim=1)[rows, num_accepted]
    # p equal to q up to rounding leaves no residual mass to draw from; p itself is then right.
    no_mass = next_probs.sum(dim=-1, keepdim=True) <= 0.0
    next_probs = torch.where(no_mass, probs[rows, num_accepted], next_probs)
    next_token = torch.multinomial(next_probs, num_samples=1).squeeze(-1)  # normalises itself
    tokens = torch.cat([tokens_draft, tokens_draft.new_zeros(batch, 1)], dim=1)
    tokens[rows, num_accepted] = next_token.to(tokens.dtype)
    return tokens, num_accepted + 1


# ----------------------------------------------------------------------------------------------
# Decoding loop.
# ----------------------------------------------------------------------------------------------


@dataclass
class DecodeOutput:
    sequences: torch.Tensor
    scores: Optional[tuple] = None


GreedySearchDecoderOnlyOutput = SampleDecoderOnlyOutput = DecodeOutput


def _graph_inference_params(model, batch_size, seqlen_og, max_length, decoding_seqlens,
                            tensor_parallel):
    """cg=True: the model's captured decoding steps (one per number of new tokens in
    decoding_seqlens), and the InferenceParams they read, reset for a new generation."""
    model._decoding_cache = update_graph_cache(
        model, getattr(model, "_decoding_cache", None), batch_size, seqlen_og, max_length,
        decoding_seqlens=decoding_seqlens, tensor_parallel=tensor_parallel)
    inference_params = model._decoding_cache.inference_params
    inference_params.reset(max_length, batch_size)
    return inference_params


def _model_logits(model, tokens, inference_params, num_last_tokens=1, cg=False, vocab_size=None):
    """The model's logits (batch, num_last_tokens, vocab) at the last positions of tokens (batch,
    s), which it reads after the inference_params.seqlen_offset positions its cache holds
    (offset 0: the prefill). The caller moves the offset."""
    offset = inference_params.seqlen_offset
    if offset == 0:
        logits = model(tokens, inference_params=inference_params,
                       num_last_tokens=num_last_tokens).logits
    else:
        batch, seqlen = tokens.shape
        position_ids = offset + torch.arange(seqlen, device=tokens.device).expand(batch, seqlen)
        if cg:
            logits = model._decoding_cache.run(tokens, position_ids, offset)[:, -num_last_tokens:]
        else:
            logits = model(tokens, position_ids=position_ids, inference_params=inference_params,
                           num_last_tokens=num_last_tokens).logits
    return logits[..., :vocab_size] if vocab_size is not None else logits


class _Timer:
    """enable_timing: wall-clock milliseconds of a generation, the GPU (and the other ranks)
    synchronised at both ends."""

    def __init__(self, device, tensor_parallel):
        self.device, self.tensor_parallel = device, tensor_parallel
        self.start = self._now()

    def _now(self):
        if self.tensor_parallel > 1:
            torch.distributed.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def elapsed_ms(self):
        return (self._now() - self.start) * 1000


@torch.inference_mode()
def decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
           repetition_penalty=1.0, eos_token_id=None, teacher_outputs=None, vocab_size=None,
           tensor_parallel=1, cg=False, enable_timing=False, output_scores=False):
    """Generate until max_length tokens (prompt included) or until every sequence's last token
    is eos_token_id. One prefill pass over the prompt, then one token per step from the kv cache.

    teacher_outputs (batch, >= max_length): force those tokens instead of sampling (tests).
    vocab_size: ignore logits past it (the padded part of the vocabulary).
    tensor_parallel: the number of ranks the model is split over (they synchronise for timing).
    cg: replay each decoding step from a CUDA graph captured once per (batch, max_length).
    Returns DecodeOutput(sequences (batch, <= max_length), scores: per-step logits).
    """
    batch_size, seqlen_og = input_ids.shape
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    if cg:
        if not input_ids.is_cuda:
            raise ValueError("decode: cg=True (CUDA graphs) needs a model and inputs on a GPU")
        inference_params = _graph_inference_params(model, batch_size, seqlen_og, max_length, (1,),
                                                    tensor_parallel)
    else:
        inference_params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

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

    timer = _Timer(input_ids.device, tensor_parallel) if enable_timing else None
    sequences, scores = [input_ids], []
    history = input_ids
    while not done(sequences[-1]):
        logits = _model_logits(model, sequences[-1], inference_params, cg=cg,
                               vocab_size=vocab_size).squeeze(1)
        if output_scores:
            scores.append(logits.clone())
        inference_params.seqlen_offset += sequences[-1].shape[1]
        if repetition_penalty != 1.0:
            logits = modify_logit_for_repetition_penalty(logits.clone(), history, repetition_penalty)
        token = next_token(logits).unsqueeze(1)
        history = torch.cat([history, token], dim=1)
        sequences.append(token)
    if timer is not None:
        print(f"decode: {timer.elapsed_ms():.1f} ms")
    return DecodeOutput(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


# ----------------------------------------------------------------------------------------------
# Speculative decoding: the draft model proposes up to speculative_lookahead tokens one at a
# time, the target scores them all in one pass, and sample_speculative keeps a prefix.
# ----------------------------------------------------------------------------------------------


@torch.inference_mode()
def decode_speculative(input_ids, model, model_draft, max_length, speculative_lookahead=3,
                       top_k=1, top_p=0.0, temperature=1.0, eos_token_id=None, vocab_size=None,
                       tensor_parallel=1, cg=False, enable_timing=False, debug=False):
    """Generate as decode() with the target `model` would (greedy: the same tokens; sampling:
    the same distribution), with fewer passes of the target when model_draft guesses well.

    Each round the draft proposes n = min(speculative_lookahead, room left - 1) tokens and the
    target verifies them in one pass of n + 1 positions (sample_speculative), keeping 1 to n + 1
    tokens. In a batch every row keeps as many as the row that keeps fewest: a shorter prefix
    of the target-distributed tokens, so outputs stay exact and rows stay aligned.
    Stops at max_length tokens (prompt included) or when every row's last token is
    eos_token_id, as decode() does. Both models must give logits over the same vocabulary (cut
    both to vocab_size when their padded vocabularies differ).
    cg: replay the steps of both models from CUDA graphs. enable_timing: print the time, the
    target passes and the share of draft tokens accepted; debug: print each round's counts.
    Returns DecodeOutput(sequences (batch, <= max_length), scores: the target's logits for each
    generated token, a tuple of (batch, vocab)).
    """
    if speculative_lookahead < 1:
        raise ValueError(f"decode_speculative: speculative_lookahead must be >= 1, got "
                         f"{speculative_lookahead}")
    batch_size, seqlen_og = input_ids.shape
    if cg:
        if not input_ids.is_cuda:
            raise ValueError("decode_speculative: cg=True (CUDA graphs) needs models and inputs "
                             "on a GPU")
        if model_draft is model:
            raise ValueError("decode_speculative: cg=True needs model_draft to be another module "
                             "than model (each keeps its own captured graphs and kv cache)")
        # The draft reads 1 new token a step, or 2 after the target accepted all its proposals
        # (its last proposal and the target's extra token); the target reads 1 + lookahead.
        params_draft = _graph_inference_params(model_draft, batch_size, seqlen_og, max_length,
                                               (1, 2), tensor_parallel)
        params = _graph_inference_params(model, batch_size, seqlen_og, max_length,
                                         range(1, speculative_lookahead + 2), tensor_parallel)
    else:
        params_draft = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def logits_of(net, tokens, inference_params, num_last_tokens):
        return _model_logits(net, tokens, inference_params, num_last_tokens, cg, vocab_size)

    def draw(logits):
        if top_k == 1:
            return logits.argmax(dim=-1)
        probs = _filtered_probs(logits, top_k, top_p, temperature)
        return torch.multinomial(probs, num_samples=1).squeeze(-1)

    def propose(sequences, draft_cached, num_draft):
        """num_draft tokens from the draft after sequences (batch, L), whose first draft_cached
        positions its cache holds; and the logits each was drawn from."""
        params_draft.seqlen_offset = draft_cached
        tokens, drafted, drafted_logits = sequences[:, draft_cached:], [], []
        for _ in range(num_draft):
            logits = logits_of(model_draft, tokens, params_draft, 1)[:, -1]
            params_draft.seqlen_offset += tokens.shape[1]
            tokens = draw(logits).unsqueeze(1)
            drafted.append(tokens)
            drafted_logits.append(logits)
        return torch.cat(drafted, dim=1), torch.stack(drafted_logits, dim=1)

    timer = _Timer(input_ids.device, tensor_parallel) if enable_timing else None
    sequences, scores = input_ids, []
    # How many leading positions of `sequences` each model's kv cache holds. Positions past
    # them (rejected proposals) are simply overwritten by the next pass.
    cached, draft_cached = 0, 0
    num_target_passes = num_proposed = num_accepted = 0
    while True:
        length = sequences.shape[1]
        num_draft = min(speculative_lookahead, max_length - length - 1)
        params.seqlen_offset = cached
        if num_draft <= 0:  # room for one token only: the target alone
            logits = logits_of(model, sequences[:, cached:], params, 1)
            new_tokens = sample(logits[:, 0], top_k=top_k, top_p=top_p,
                                temperature=temperature).unsqueeze(1)
        else:
            tokens_draft, logits_draft = propose(sequences, draft_cached, num_draft)
            logits = logits_of(model, torch.cat([sequences[:, cached:], tokens_draft], dim=1),
                               params, num_draft + 1)
            if logits.shape[-1] != logits_draft.shape[-1]:
                raise ValueError(f"decode_speculative: model gives {logits.shape[-1]} logits and "
                                 f"model_draft {logits_draft.shape[-1]}; pass vocab_size")
            tokens, num_generated = sample_speculative(logits, logits_draft, tokens_draft,
                                                       top_k=top_k, top_p=top_p,
                                                       temperature=temperature)
            num_kept = int(num_generated.min())
            new_tokens = tokens[:, :num_kept]
            # The draft's cache holds the prompt and its proposals but the last.
            draft_cached = length + min(num_kept, num_draft) - 1
            num_proposed += num_draft
            num_accepted += num_kept - 1
            if debug:
                print(f"decode_speculative: {num_draft} proposed, accepted per row "
                      f"{(num_generated - 1).tolist()}, kept {num_kept}")
        num_target_passes += 1
        stop = False
        if eos_token_id is not None:
            all_eos = (new_tokens == eos_token_id).all(dim=0).nonzero()
            if len(all_eos) > 0:
                new_tokens, stop = new_tokens[:, : int(all_eos[0]) + 1], True
        # The target's cache holds everything but the last token kept, which it has not read.
        cached = length + new_tokens.shape[1] - 1
        scores.extend(logits[:, : new_tokens.shape[1]].unbind(dim=1))
        sequences = torch.cat([sequences, new_tokens.to(sequences.dtype)], dim=1)
        if stop or sequences.shape[1] >= max_length:
            break
    if timer is not None:
        rate = num_accepted / num_proposed if num_proposed else 0.0
        print(f"decode_speculative: {timer.elapsed_ms():.1f} ms, {num_target_passes} passes of "
              f"the target, {rate:.1%} of draft tokens accepted")
    return DecodeOutput(sequences=sequences, scores=tuple(scores))


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


def allocate_inference_cache(max_batch_size, max_seqlen, nheads, headdim, layers, device,
                             dtype=torch.float16):
    """A kv cache for a model that has no allocate_inference_cache of its own: {layer index:
    (max_batch_size, max_seqlen, 2, nheads, headdim)} for layers, a count or the indices."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"allocate_inference_cache: dtype must be float16, bfloat16 or float32, "
                         f"got {dtype}")
    if isinstance(layers, int):
        layers = range(layers)
    shape = (max_batch_size, max_seqlen, 2, nheads, headdim)
    # zeros, not empty: attention's PyTorch path multiplies the masked (probability 0) slots by
    # the cache, and 0 * NaN garbage is NaN.
    return {i: torch.zeros(shape, device=device, dtype=dtype) for i in layers}


def _allocate_model_cache(model, batch_size, max_seqlen, dtype, tensor_parallel):
    """The model's own allocate_inference_cache, else allocate_inference_cache sized from its
    config (this rank's share of the key/value heads)."""
    own = getattr(model, "allocate_inference_cache", None)
    if own is not None:
        try:
            return own(batch_size, max_seqlen, dtype)
        except NotImplementedError:  # GenerationMixin's placeholder
            pass
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    nheads_kv = (getattr(config, "num_key_value_heads", None) or getattr(config, "n_head_kv", None)
                 or config.num_attention_heads)
    return allocate_inference_cache(batch_size, max_seqlen, nheads_kv // tensor_parallel, head_dim,
                                    config.num_hidden_layers, next(iter(model.parameters())).device,
                                    dtype)


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
                       tensor_parallel=1, dtype=None, n_warmups=2):
    """Reuse the captured graphs when they fit (same device/dtype, batch and length within what
    was allocated); otherwise allocate new kv caches and capture again. decoding_seqlens: the
    numbers of new tokens a step reads, one graph each."""
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
            key_value_memory_dict=_allocate_model_cache(model, batch_size, max_seqlen, dtype,
                                                        tensor_parallel),
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
