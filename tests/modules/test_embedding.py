import torch

from flash_attn.modules.embedding import BertEmbeddings, GPT2Embeddings


def test_gpt2_embeddings():
    torch.manual_seed(0)
    emb = GPT2Embeddings(16, 50, 20)
    ids = torch.randint(0, 50, (2, 7))
    expected = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:7]
    assert torch.allclose(emb(ids), expected)
    position_ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]] * 2)
    expected = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[position_ids]
    assert torch.allclose(emb(ids, position_ids=position_ids), expected)


def test_gpt2_embeddings_projection_and_no_positions():
    emb = GPT2Embeddings(16, 50, 0, word_embed_proj_dim=8)
    ids = torch.randint(0, 50, (2, 7))
    assert not hasattr(emb, "position_embeddings")
    assert torch.allclose(emb(ids), emb.project_in(emb.word_embeddings.weight[ids]))


def test_bert_embeddings():
    torch.manual_seed(0)
    emb = BertEmbeddings(16, 50, 20, 2, padding_idx=0)
    ids = torch.randint(0, 50, (2, 7))
    token_type_ids = torch.randint(0, 2, (2, 7))
    expected = (emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:7]
                + emb.token_type_embeddings.weight[token_type_ids])
    assert torch.allclose(emb(ids, token_type_ids=token_type_ids), expected)
    expected = (emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:7]
                + emb.token_type_embeddings.weight[0])
    assert torch.allclose(emb(ids), expected)
