"""Speculative decoding: greedy output identical to decode() with the target, sampled output
distributed as the target's (total-variation bounds on many independent rows), and
sample_speculative's accept / reject rule on hand-made distributions."""

import math

import pytest
import torch
from transformers import GPT2Config

from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.utils.generation import (
    _allocate_model_cache,
    allocate_inference_cache,
    decode,
    decode_speculative,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample_speculative,
)


def _config(**kwargs):
    # initializer_range 0.2: a random model's greedy choices are clear-cut and vary step to step.
    base = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, bos_token_id=0,
                eos_token_id=1)
    base.update(kwargs)
    return GPT2Config(**base)


def _model(seed, **kwargs):
    torch.manual_seed(seed)
    return GPTLMHeadModel(_config(**kwargs)).eval()


def _noisy_copy(model, scale, seed=123):
    """A draft that agrees with the target on some tokens and not on others."""
    draft = GPTLMHeadModel(model.config).eval()
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return draft


class _CountingModel(torch.nn.Module):
    """Counts the forward passes of the model it wraps."""

    def __init__(self, model):
        super().__init__()
        self.model, self.passes = model, 0

    def forward(self, *args, **kwargs):
        self.passes += 1
        return self.model(*args, **kwargs)


def _tv_bound(num_cells, num_samples, false_alarm=1e-6):
    """eps with P(TV(empirical, true) >= eps) <= false_alarm for num_samples draws over num_cells
    outcomes (P(||p_hat - p||_1 >= 2 eps) <= 2^cells exp(-2 n eps^2), Weissman et al. 2003)."""
    return math.sqrt((num_cells * math.log(2) + math.log(1 / false_alarm)) / (2 * num_samples))


def _tv(tokens, probs):
    """Total variation between the empirical distribution of tokens (n,) and probs (cells,)."""
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def _filtered(logits, top_k, top_p, temperature):
    logits = logits.float() / temperature
    if top_k > 0:
        modify_logits_for_top_k_filtering(logits, top_k)
    modify_logits_for_top_p_filtering(logits, top_p)
    return logits.softmax(-1)


# ----------------------------------------------------------------------------------------------
# Greedy: exactly decode()'s tokens.
# ----------------------------------------------------------------------------------------------


TARGET = _model(0)
DRAFTS = {"unrelated": _model(1, n_layer=1), "noisy copy": _noisy_copy(TARGET, 0.03),
          "same weights": _noisy_copy(TARGET, 0.0)}
PROMPT = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("lookahead", [1, 2, 3, 5])
def test_greedy_matches_decode_of_the_target(draft, lookahead):
    max_length = 24
    ref = decode(PROMPT, TARGET, max_length, output_scores=True)
    target = _CountingModel(TARGET)
    out = decode_speculative(PROMPT, target, DRAFTS[draft], max_length,
                             speculative_lookahead=lookahead)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == max_length - PROMPT.shape[1]
    for got, want in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    generated = max_length - PROMPT.shape[1]
    if draft == "same weights":  # every proposal accepted: lookahead + 1 tokens a pass
        assert target.passes == math.ceil(generated / (lookahead + 1))
    elif draft == "noisy copy":  # some accepted, not all
        assert math.ceil(generated / (lookahead + 1)) < target.passes < generated


def test_greedy_with_rotary_and_a_batch_that_disagrees():
    target = _model(3, rotary_emb_fraction=0.5, n_head=2)
    draft = _noisy_copy(target, 0.1, seed=5)
    prompt = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(8))
    ref = decode(prompt, target, 20)
    out = decode_speculative(prompt, target, draft, 20, speculative_lookahead=3)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("prompt_len", [23, 24])  # room for one token, for none
def test_greedy_at_max_length(prompt_len):
    prompt = torch.randint(0, 50, (1, prompt_len), generator=torch.Generator().manual_seed(9))
    ref = decode(prompt, TARGET, 24)
    out = decode_speculative(prompt, TARGET, DRAFTS["noisy copy"], 24, speculative_lookahead=3)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.sequences.shape[1] == prompt_len + 1


def test_greedy_stops_at_eos_like_decode():
    prompt = PROMPT[:1]
    full = decode(prompt, TARGET, 24).sequences
    eos = int(full[0, prompt.shape[1] + 6])  # a token the target produces mid-sequence
    ref = decode(prompt, TARGET, 24, eos_token_id=eos)
    assert ref.sequences.shape[1] < 24 and int(ref.sequences[0, -1]) == eos
    for lookahead in (2, 4):
        out = decode_speculative(prompt, TARGET, DRAFTS["same weights"], 24,
                                 speculative_lookahead=lookahead, eos_token_id=eos)
        assert torch.equal(out.sequences, ref.sequences)
        assert len(out.scores) == ref.sequences.shape[1] - prompt.shape[1]


def test_vocab_size_cuts_padded_vocabularies():
    target = _model(0, pad_vocab_size_multiple=16)  # 64 logits, 50 real
    draft = _model(1, n_layer=1, pad_vocab_size_multiple=8)  # 56 logits
    with pytest.raises(ValueError, match="vocab_size"):
        decode_speculative(PROMPT, target, draft, 12)
    ref = decode(PROMPT, target, 16, vocab_size=50)
    out = decode_speculative(PROMPT, target, draft, 16, vocab_size=50)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.scores[0].shape == (2, 50)


def test_bad_arguments():
    with pytest.raises(ValueError, match="speculative_lookahead"):
        decode_speculative(PROMPT, TARGET, TARGET, 12, speculative_lookahead=0)
    with pytest.raises(ValueError, match="GPU"):
        decode_speculative(PROMPT, TARGET, DRAFTS["unrelated"], 12, cg=True)


# ----------------------------------------------------------------------------------------------
# sample_speculative's rule.
# ----------------------------------------------------------------------------------------------


def test_sample_speculative_greedy():
    target_choice = torch.tensor([[2, 3, 1, 4], [0, 0, 0, 0], [1, 2, 3, 4]])
    logits = torch.nn.functional.one_hot(target_choice, 5).float()
    tokens_draft = torch.tensor([[2, 3, 0], [1, 0, 0], [1, 2, 3]])
    tokens, num_generated = sample_speculative(logits, torch.randn(3, 3, 5), tokens_draft)
    assert num_generated.tolist() == [3, 1, 4]
    assert tokens.tolist()[0][:3] == [2, 3, 1] and tokens.tolist()[1][:1] == [0]
    assert tokens.tolist()[2] == [1, 2, 3, 4]
    assert tokens.dtype == tokens_draft.dtype


def test_sample_speculative_checks_shapes():
    logits, logits_draft = torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="tokens_draft"):
        sample_speculative(logits, logits_draft, tokens.float())
    with pytest.raises(ValueError, match="logits must be"):
        sample_speculative(logits[:, :3], logits_draft, tokens)
    with pytest.raises(ValueError, match="logits_draft"):
        sample_speculative(logits, logits_draft[..., :4], tokens)
    with pytest.raises(ValueError, match="top_p"):
        sample_speculative(logits, logits_draft, tokens, top_k=0, top_p=2.0)


def test_sample_speculative_rejects_what_the_target_cannot_say():
    # The draft always says 0, which the target never does: rejected at once, and the
    # replacement comes from max(p - q, 0) = p.
    torch.manual_seed(0)
    n = 20000
    p = torch.tensor([0.0, 0.5, 0.3, 0.2])
    logits = p.log().expand(n, 3, 4)
    logits_draft = torch.tensor([0.0, -1e9, -1e9, -1e9]).expand(n, 2, 4)
    tokens, num_generated = sample_speculative(logits, logits_draft,
                                               torch.zeros(n, 2, dtype=torch.long), top_k=0)
    assert (num_generated == 1).all()
    assert _tv(tokens[:, 0], p) < _tv_bound(4, n)


def test_sample_speculative_accepts_all_when_draft_and_target_agree():
    torch.manual_seed(0)
    logits = torch.randn(500, 4, 7)
    tokens_draft = torch.multinomial(logits[:, :3].softmax(-1).flatten(0, 1), 1).view(500, 3)
    tokens, num_generated = sample_speculative(logits, logits[:, :3], tokens_draft, top_k=0)
    assert (num_generated == 4).all()
    assert torch.equal(tokens[:, :3], tokens_draft)


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 0.0, 1.0), (3, 0.0, 0.7),
                                                       (0, 0.8, 1.3)])
def test_sample_speculative_is_distributed_as_the_target(top_k, top_p, temperature):
    """Each emitted token follows the target's (filtered) distribution at its position, given
    that it is emitted; the first draft is accepted with probability sum min(p, q)."""
    torch.manual_seed(0)
    n, vocab = 40000, 6
    target_logits = torch.randn(3, vocab) * 1.5
    draft_logits = torch.randn(2, vocab) * 1.5
    p = _filtered(target_logits, top_k, top_p, temperature)
    q = _filtered(draft_logits, top_k, top_p, temperature)
    tokens_draft = torch.stack([torch.multinomial(q[i], n, replacement=True) for i in range(2)], 1)
    tokens, num_generated = sample_speculative(
        target_logits.expand(n, 3, vocab), draft_logits.expand(n, 2, vocab), tokens_draft,
        top_k=top_k, top_p=top_p, temperature=temperature)
    # The test can tell: emitting the draft's tokens unchecked would be far off.
    assert 0.5 * (p[0] - q[0]).abs().sum() > 3 * _tv_bound(vocab, n)
    for pos in range(3):
        emitted = num_generated > pos
        assert _tv(tokens[emitted, pos], p[pos]) < _tv_bound(vocab, int(emitted.sum())), pos
    acceptance = (num_generated > 1).double().mean().item()
    hoeffding = math.sqrt(math.log(2 / 1e-6) / (2 * n))
    assert abs(acceptance - torch.minimum(p[0], q[0]).sum().item()) < hoeffding


# ----------------------------------------------------------------------------------------------
# Sampled decode_speculative on small GPTs: rows of one prompt are independent generations.
# ----------------------------------------------------------------------------------------------


VOCAB = 6
SAMPLE_TARGET = _model(10, vocab_size=VOCAB)
SAMPLE_DRAFTS = {"other model": _model(11, vocab_size=VOCAB, n_layer=1),
                 "same weights": _noisy_copy(SAMPLE_TARGET, 0.0)}


def _target_first_two(prompt, top_k, top_p, temperature):
    """The target's distribution of the first two tokens after prompt (1, s): (vocab, vocab)."""
    with torch.no_grad():
        first = _filtered(SAMPLE_TARGET(prompt).logits[0, -1], top_k, top_p, temperature)
        seconds = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB).view(-1, 1)], 1)
        second = _filtered(SAMPLE_TARGET(seconds).logits[:, -1], top_k, top_p, temperature)
    return first, first[:, None] * second


@pytest.mark.parametrize("draft", list(SAMPLE_DRAFTS))
@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 0.0, 1.0), (4, 0.9, 0.8)])
def test_sampled_tokens_follow_the_target(draft, top_k, top_p, temperature):
    torch.manual_seed(0)
    n = 20000
    prompt = torch.tensor([[2, 5, 3]])
    first, joint = _target_first_two(prompt, top_k, top_p, temperature)
    out = decode_speculative(prompt.expand(n, -1), SAMPLE_TARGET, SAMPLE_DRAFTS[draft],
                             max_length=7, speculative_lookahead=3, top_k=top_k, top_p=top_p,
                             temperature=temperature)
    assert out.sequences.shape == (n, 7)
    generated = out.sequences[:, 3:]
    assert _tv(generated[:, 0], first) < _tv_bound(VOCAB, n)
    pairs = generated[:, 0] * VOCAB + generated[:, 1]
    assert _tv(pairs, joint.flatten()) < _tv_bound(VOCAB ** 2, n)
    if draft == "other model":  # the test can tell the draft's distribution from the target's
        with torch.no_grad():
            draft_first = _filtered(SAMPLE_DRAFTS[draft](prompt).logits[0, -1], top_k, top_p,
                                    temperature)
        assert 0.5 * (first - draft_first).abs().sum() > 3 * _tv_bound(VOCAB, n)


# ----------------------------------------------------------------------------------------------
# The kv cache of models without their own allocate_inference_cache.
# ----------------------------------------------------------------------------------------------


def test_allocate_inference_cache():
    cache = allocate_inference_cache(3, 10, 4, 16, 2, "cpu", dtype=torch.float32)
    assert list(cache) == [0, 1]
    assert all(c.shape == (3, 10, 2, 4, 16) and c.dtype == torch.float32 and not c.any()
               for c in cache.values())
    assert list(allocate_inference_cache(1, 4, 2, 8, [3, 5], "cpu")) == [3, 5]
    assert allocate_inference_cache(1, 4, 2, 8, 1, "cpu")[0].dtype == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        allocate_inference_cache(1, 4, 2, 8, 1, "cpu", dtype=torch.int8)


def test_graph_cache_falls_back_to_the_config():
    class NoCacheOfItsOwn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = GPT2Config(n_embd=64, n_head=8, n_layer=3)
            self.weight = torch.nn.Parameter(torch.zeros(1))

    cache = _allocate_model_cache(NoCacheOfItsOwn(), 2, 12, torch.float32, tensor_parallel=2)
    assert sorted(cache) == [0, 1, 2] and cache[0].shape == (2, 12, 2, 4, 8)
    own = _allocate_model_cache(TARGET, 2, 12, torch.float32, tensor_parallel=1)
    assert own[0].shape == (2, 12, 2, 4, 8)  # GPTLMHeadModel's own: 4 heads of 8


# ----------------------------------------------------------------------------------------------
# GPU: both models' steps replayed from CUDA graphs.
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lookahead", [1, 3])
def test_cuda_graph_greedy_matches_decode_gpu(lookahead):
    target = _model(0).cuda()
    draft = _noisy_copy(_model(0), 0.08).cuda()
    prompt = PROMPT.cuda()
    ref = decode(prompt, target, 24)
    out = decode_speculative(prompt, target, draft, 24, speculative_lookahead=lookahead, cg=True)
    assert torch.equal(out.sequences, ref.sequences)
    again = decode_speculative(prompt, target, draft, 24, speculative_lookahead=lookahead, cg=True)
    assert torch.equal(again.sequences, ref.sequences)  # the captured graphs are reused
