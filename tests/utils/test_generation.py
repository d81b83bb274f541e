import pytest
import torch

from flash_attn.utils.generation import (
    InferenceParams,
    decode,
    modify_logit_for_repetition_penalty,
    modify_logits_for_min_p_filtering,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits), logits.argmax(-1))


def test_top_k_only_samples_from_the_k_best():
    torch.manual_seed(0)
    logits = torch.randn(2, 50).repeat(500, 1)
    tokens = sample(logits, top_k=3)
    allowed = logits.topk(3, dim=-1).indices
    assert (tokens.unsqueeze(-1) == allowed).any(-1).all()
    assert len(tokens[0::2].unique()) == 3  # all three do come up


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = logits.clone()
    modify_logits_for_top_p_filtering(kept, 0.7)  # 0.5 + 0.3 >= 0.7: two tokens
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = logits.clone()
    modify_logits_for_top_p_filtering(kept, 0.85)  # needs the third
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    kept = logits.clone()
    modify_logits_for_top_p_filtering(kept, 0.1)  # the best token always stays
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]
    torch.manual_seed(0)
    tokens = sample(logits.repeat(1000, 1), top_k=0, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.5 / 0.8) < 0.05


def test_min_p_and_temperature():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = logits.clone()
    modify_logits_for_min_p_filtering(kept, 0.5)  # keep p >= 0.25
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    torch.manual_seed(0)
    cold = sample(logits.repeat(2000, 1), top_k=0, temperature=0.1)
    assert (cold == 0).float().mean().item() > 0.99


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = modify_logit_for_repetition_penalty(logits.clone(), torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_inference_params_reset():
    params = InferenceParams(max_seqlen=10, max_batch_size=2, seqlen_offset=7,
                             lengths_per_sample=torch.full((2,), 7))
    params.reset(20, 3)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (20, 3, 0)
    assert params.lengths_per_sample.tolist() == [0, 0]


class _CountingModel(torch.nn.Module):
    """Logits that make token (last + 1) % vocab the greedy choice; records what it was fed."""

    def __init__(self, vocab=10):
        super().__init__()
        self.vocab, self.calls = vocab, []

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        self.calls.append((input_ids.shape[1], inference_params.seqlen_offset))
        nxt = (input_ids[:, -1:] + 1) % self.vocab
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float()
        return type("Out", (), {"logits": logits})()


def test_decode_prefills_once_then_steps_one_token():
    model = _CountingModel()
    out = decode(torch.tensor([[3, 4, 5]]), model, max_length=8, output_scores=True)
    assert out.sequences.tolist() == [[3, 4, 5, 6, 7, 8, 9, 0]]
    assert model.calls == [(3, 0), (1, 3), (1, 4), (1, 5), (1, 6)]
    assert len(out.scores) == 5
    out = decode(torch.tensor([[3, 4, 5]]), _CountingModel(), max_length=8, eos_token_id=7)
    assert out.sequences.tolist() == [[3, 4, 5, 6, 7]]
    out = decode(torch.tensor([[3, 4, 5]]), _CountingModel(), max_length=8, vocab_size=7)
    # 7 is past vocab_size: the cut logits are all zero, argmax 0, then counting resumes.
    assert out.sequences.tolist() == [[3, 4, 5, 6, 0, 1, 2, 3]]


def test_cg_needs_a_gpu():
    with pytest.raises(ValueError, match="GPU"):
        decode(torch.tensor([[1, 2]]), _CountingModel(), max_length=4, cg=True)


# ----------------------------------------------------------------------------------------------
# The logit filters' edge cases.
# ----------------------------------------------------------------------------------------------


def test_top_k_filter_edge_cases():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0]])
    for top_k in (0, 5, 9):  # no cut: 0 (off), the vocabulary size or more
        kept = logits.clone()
        modify_logits_for_top_k_filtering(kept, top_k)
        assert torch.equal(kept, logits)
    kept = logits.clone()
    assert modify_logits_for_top_k_filtering(kept, 1) is None  # in place
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, False]]  # a tie stays
    kept = logits.clone()
    modify_logits_for_top_k_filtering(kept, 3)
    assert torch.isfinite(kept).tolist() == [[False, True, True, True, False]]
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])


def test_filters_work_row_by_row_on_any_leading_shape():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    for modify, arg in ((modify_logits_for_top_k_filtering, 2),
                        (modify_logits_for_top_p_filtering, 0.6)):
        batched = logits.clone()
        modify(batched, arg)
        for i in range(2):
            for j in range(3):
                row = logits[i, j].clone().unsqueeze(0)
                modify(row, arg)
                assert torch.equal(batched[i, j], row[0])


def test_top_p_filter_edge_cases():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p in (0.0, 1.0):  # off
        kept = logits.clone()
        modify_logits_for_top_p_filtering(kept, top_p)
        assert torch.equal(kept, logits)
    # Tokens already cut (-inf, e.g. by top-k) hold no mass and stay cut.
    cut = torch.tensor([[0.5, 0.3, float("-inf"), float("-inf")]]).log_softmax(-1)
    kept = cut.clone()
    modify_logits_for_top_p_filtering(kept, 0.5)  # 0.625 alone reaches 0.5
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]
    kept = cut.clone()
    modify_logits_for_top_p_filtering(kept, 0.9)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, top_k=0, top_p=1.5)
