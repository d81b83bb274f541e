import pytest
import torch

from flash_attn.bert_padding import (
    IndexFirstAxisResidual,
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def _prefix_mask(lengths, seqlen):
    return torch.arange(seqlen).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def test_unpad_input_known_case():
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])  # 0/1 ints, as HF tokenizers return them
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert indices.tolist() == [0, 1, 4, 5, 6]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5]
    assert isinstance(max_seqlen, int) and max_seqlen == 3
    assert seqused.dtype == torch.int32 and seqused.tolist() == [2, 3]
    torch.testing.assert_close(x_unpad, torch.cat([x[0, :2], x[1, :3]]), rtol=0, atol=0)


def test_unpad_input_unused_mask_keeps_tokens_but_counts_only_used():
    x = torch.randn(2, 5, 2)
    mask = _prefix_mask([2, 1], 5)
    unused = _prefix_mask([3, 4], 5) & ~mask  # reserved slots after the used tokens
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert cu_seqlens.tolist() == [0, 3, 7]
    assert max_seqlen == 4
    assert seqused.tolist() == [2, 1]
    torch.testing.assert_close(x_unpad, x.reshape(10, 2)[indices], rtol=0, atol=0)


@pytest.mark.parametrize("lengths", [[5, 1, 3], [0, 4, 2], [7, 7, 7]])
def test_round_trip_zeroes_padding(lengths):
    torch.manual_seed(0)
    batch, seqlen = len(lengths), 7
    x = torch.randn(batch, seqlen, 3, 4)
    mask = _prefix_mask(lengths, seqlen)
    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
    assert x_unpad.shape == (sum(lengths), 3, 4)
    assert cu_seqlens[-1].item() == sum(lengths) and max_seqlen == max(lengths)
    back = pad_input(x_unpad, indices, batch, seqlen)
    assert back.shape == x.shape
    torch.testing.assert_close(back, x * mask[..., None, None], rtol=0, atol=0)
    # Non-prefix masks work too: the mask, not the position, decides.
    holes = torch.rand(batch, seqlen) > 0.5
    x_unpad, indices, *_ = unpad_input(x, holes)
    torch.testing.assert_close(pad_input(x_unpad, indices, batch, seqlen),
                               x * holes[..., None, None], rtol=0, atol=0)


def test_unpad_pad_gradients_flow_to_valid_tokens_only():
    x = torch.randn(2, 4, 3, requires_grad=True)
    mask = _prefix_mask([3, 1], 4)
    x_unpad, indices, *_ = unpad_input(x, mask)
    out = pad_input(x_unpad * 2.0, indices, 2, 4)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * mask[..., None].float().expand(2, 4, 3),
                               rtol=0, atol=0)


def test_index_first_axis_gradcheck():
    torch.manual_seed(0)
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([4, 0, 2])
    assert torch.autograd.gradcheck(index_first_axis, (x, indices))
    # A repeated index must accumulate both gradients.
    repeated = torch.tensor([1, 1, 5])
    assert torch.autograd.gradcheck(index_first_axis, (x, repeated))
    index_first_axis(x, repeated).sum().backward()
    assert x.grad[1].eq(2).all() and x.grad[5].eq(1).all() and x.grad[0].eq(0).all()


def test_index_put_first_axis_gradcheck():
    torch.manual_seed(0)
    values = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([5, 1, 2])
    out = index_put_first_axis(values, indices, 7)
    assert out.shape == (7, 2)
    assert out[[0, 3, 4, 6]].eq(0).all()
    torch.testing.assert_close(out[indices], values.detach(), rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda v: index_put_first_axis(v, indices, 7), (values,))


def test_unpad_pad_gradcheck_end_to_end():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    mask = _prefix_mask([2, 3], 3)

    def f(x):
        x_unpad, indices, *_ = unpad_input(x, mask)
        return pad_input(x_unpad.sin(), indices, 2, 3)

    assert torch.autograd.gradcheck(f, (x,))


def test_index_first_axis_residual():
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([3, 0])
    gathered, residual = IndexFirstAxisResidual.apply(x, indices)
    torch.testing.assert_close(gathered, x.detach()[indices], rtol=0, atol=0)
    torch.testing.assert_close(residual, x.detach(), rtol=0, atol=0)
    # Gradient = grad through the residual plus the gathered rows' gradient added at indices.
    (3.0 * gathered.sum() + residual.sum()).backward()
    expected = torch.ones(5, 3, dtype=torch.float64)
    expected[indices] += 3.0
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    x.grad = None
    assert torch.autograd.gradcheck(
        lambda t: tuple(o * w for o, w in zip(IndexFirstAxisResidual.apply(t, indices), (1.5, -0.5))),
        (x,))


def test_unpad_input_for_concatenated_sequences():
    x = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 1, 0, 0, 0]])
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 11]
    assert max_seqlen == 3
    torch.testing.assert_close(x_unpad[:, 0], indices.float(), rtol=0, atol=0)
    torch.testing.assert_close(pad_input(x_unpad, indices, 2, 6)[1], x[1], rtol=0, atol=0)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_every_function_takes_int32_and_int64_indices(index_dtype):
    """HF transformers hands int32 indices (cu_seqlens[:-1] when decoding one token): each
    Function gives the int64 result, forward and backward."""
    torch.manual_seed(0)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([6, 0, 3], dtype=index_dtype)
    reference = indices.long()

    gathered = index_first_axis(x, indices)
    torch.testing.assert_close(gathered, x.detach()[reference], rtol=0, atol=0)
    (gathered * torch.arange(1.0, 4.0, dtype=torch.float64)[:, None]).sum().backward()
    expected = torch.zeros(7, 3, dtype=torch.float64)
    expected[reference] = torch.arange(1.0, 4.0, dtype=torch.float64)[:, None].expand(3, 3)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    assert torch.autograd.gradcheck(index_first_axis, (x, indices))

    values = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    scattered = index_put_first_axis(values, indices, 7)
    torch.testing.assert_close(scattered[reference], values.detach(), rtol=0, atol=0)
    assert scattered[[1, 2, 4, 5]].eq(0).all()
    assert torch.autograd.gradcheck(lambda v: index_put_first_axis(v, indices, 7), (values,))

    assert torch.autograd.gradcheck(
        lambda t: tuple(o * w for o, w in zip(IndexFirstAxisResidual.apply(t, indices), (1.5, -0.5))),
        (x,))

    # pad_input / unpad_input round trip with the caller's index dtype.
    hidden = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    mask = _prefix_mask([3, 2], 4)
    unpadded, idx64, *_ = unpad_input(hidden, mask)
    padded = pad_input(unpadded, idx64.to(index_dtype), 2, 4)
    torch.testing.assert_close(padded, hidden.detach() * mask[..., None], rtol=0, atol=0)
    padded.sum().backward()
    torch.testing.assert_close(hidden.grad, mask[..., None].double().expand(2, 4, 5), rtol=0, atol=0)


def test_indices_of_another_dtype_are_rejected_by_name():
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        index_first_axis(torch.randn(4, 2), torch.tensor([0.0, 1.0]))
