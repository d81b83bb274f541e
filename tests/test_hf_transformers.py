"""HF transformers' `flash_attention_2` backend running on this package, the way users run it.

Llama (GQA) and GPT-2, small configs trained for a few hundred steps on a repeat task (token i
equals token i - PERIOD), so that attention matters and greedy choices are clear-cut rather than
near-ties of a random model. Against `attn_implementation="sdpa"` on the same weights:
- logits on the valid positions of left- and right-padded batches, and of packed sequences
  (batch 1, restarting position_ids), within the bf16 error rule: flash's error against the fp32
  sdpa model at most twice the bf16 sdpa model's, plus a small slack;
- greedy generate() from left-padded prompts, token for token;
- a training step on a padded batch: loss and gradients finite and within the same rule.
"""

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

VOCAB, PERIOD, REPEATS = 64, 12, 3
SLACK = 1e-3


def _configs():
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "llama": transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128,
                                          **common),
        "gpt2": transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, n_positions=128,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common),
    }


def repeat_batch(batch, generator, device="cuda"):
    """(batch, PERIOD * REPEATS) tokens in [3, VOCAB): a random PERIOD-token block, repeated."""
    block = torch.randint(3, VOCAB, (batch, PERIOD), generator=generator)
    return block.repeat(1, REPEATS).to(device)


@torch.enable_grad()  # the first test to ask may do so under no_grad
def train_on_repeat_task(config, steps=300, device="cuda"):
    """A model that has learnt the repeat task (fp32 weights, bf16 autocast, sdpa); returns its
    state dict and its accuracy on the repeated part of fresh sequences."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    for _ in range(steps):
        ids = repeat_batch(32, generator, device)
        labels = ids.clone()
        labels[:, :PERIOD] = -100  # the first block is random: nothing to learn there
        with autocast:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    ids = repeat_batch(64, generator, device)
    with torch.no_grad(), autocast:
        predicted = model(input_ids=ids).logits.argmax(-1)
    accuracy = (predicted[:, PERIOD - 1:-1] == ids[:, PERIOD:]).float().mean().item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, accuracy


@functools.lru_cache(maxsize=None)
def trained(name):
    config = _configs()[name]
    state, accuracy = train_on_repeat_task(config)
    assert accuracy > 0.98, f"{name}: the fixture model did not learn the repeat task ({accuracy})"
    return config, state


def model_for(name, attn_implementation, dtype):
    config, state = trained(name)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation)
    model.load_state_dict(state)
    return model.to("cuda", dtype).eval()


def padded_batch(lengths, side, generator):
    """Repeat-task rows cut to `lengths`, padded on `side` to the longest; (ids, mask,
    position_ids counting only real tokens)."""
    full = repeat_batch(len(lengths), generator)
    seqlen = max(lengths)
    ids = torch.zeros(len(lengths), seqlen, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        cols = slice(seqlen - n, seqlen) if side == "left" else slice(0, n)
        ids[row, cols] = full[row, :n]
        mask[row, cols] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


def relative_error(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_within_bf16_rule(flash, sdpa_bf16, ref, what):
    err, base = relative_error(flash, ref), relative_error(sdpa_bf16, ref)
    assert torch.isfinite(flash).all(), f"{what}: non-finite values"
    print(f"{what}: flash error {err:.2e}, bf16 sdpa error {base:.2e}, bound {2 * base + SLACK:.2e}")
    assert err <= 2 * base + SLACK, f"{what}: flash error {err:.2e} vs bf16 sdpa error {base:.2e}"


NAMES = ["llama", "gpt2"]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_logits_match_sdpa(name, side):
    ids, mask, position_ids = padded_batch([36, 17, 29, 5], side, torch.Generator().manual_seed(1))
    logits = {}
    for impl, dtype in (("flash_attention_2", torch.bfloat16), ("sdpa", torch.bfloat16),
                        ("sdpa", torch.float32)):
        with torch.no_grad():
            logits[impl, dtype] = model_for(name, impl, dtype)(
                input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    valid = mask.bool()
    assert_within_bf16_rule(logits["flash_attention_2", torch.bfloat16][valid],
                            logits["sdpa", torch.bfloat16][valid],
                            logits["sdpa", torch.float32][valid], f"{name} {side}-padded logits")


@pytest.mark.parametrize("name", NAMES)
def test_packed_sequences_logits_match_separate_sequences(name):
    """One row holding three sequences, position_ids restarting at each: flash attends within
    each sequence only, as the separately run sequences do."""
    generator = torch.Generator().manual_seed(2)
    pieces = [repeat_batch(1, generator)[:, :n] for n in (30, 14, 23)]
    packed = torch.cat(pieces, dim=1)
    position_ids = torch.cat([torch.arange(p.shape[1], device="cuda") for p in pieces])[None]
    with torch.no_grad():
        flash = model_for(name, "flash_attention_2", torch.bfloat16)(
            input_ids=packed, position_ids=position_ids).logits[0]
        separate = {dtype: torch.cat([model_for(name, "sdpa", dtype)(input_ids=p).logits[0]
                                      for p in pieces]) for dtype in (torch.bfloat16, torch.float32)}
    assert_within_bf16_rule(flash, separate[torch.bfloat16], separate[torch.float32],
                            f"{name} packed logits")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_is_token_identical_to_sdpa(name):
    ids, mask, _ = padded_batch([20, 14, 26, 13], "left", torch.Generator().manual_seed(3))
    outputs = {}
    for impl in ("flash_attention_2", "sdpa"):
        model = model_for(name, impl, torch.bfloat16)
        outputs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16,
                                       do_sample=False, pad_token_id=0)
    assert outputs["flash_attention_2"].shape == (4, ids.shape[1] + 16)
    assert torch.equal(outputs["flash_attention_2"], outputs["sdpa"])
    # The continuation is the repeat the models learnt: generation really used the prompt.
    new = outputs["sdpa"][:, ids.shape[1]:]
    expected = outputs["sdpa"][:, ids.shape[1] - PERIOD: ids.shape[1] - PERIOD + 16]
    assert (new == expected).float().mean().item() > 0.9


@pytest.mark.parametrize("name", NAMES)
def test_training_step_on_padded_batch(name):
    """fp32 weights under bf16 autocast, as training runs: loss and gradients of flash against
    sdpa under the same autocast and against fp32 sdpa."""
    ids, mask, position_ids = padded_batch([36, 25, 31, 18], "right",
                                           torch.Generator().manual_seed(4))
    labels = ids.masked_fill(mask == 0, -100)
    results = {}
    for impl, autocast in (("flash_attention_2", True), ("sdpa", True), ("sdpa", False)):
        model = model_for(name, impl, torch.float32).train()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                         labels=labels).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[impl, autocast] = (loss.detach(), grads)
    (loss_flash, grad_flash), (loss_sdpa, grad_sdpa), (loss_ref, grad_ref) = (
        results["flash_attention_2", True], results["sdpa", True], results["sdpa", False])
    assert torch.isfinite(loss_flash) and torch.isfinite(grad_flash).all()
    print(f"{name} loss: fp32 {loss_ref.item():.5f}, flash {loss_flash.item():.5f}, "
          f"bf16 sdpa {loss_sdpa.item():.5f}")
    assert (loss_flash - loss_ref).abs() <= 2 * (loss_sdpa - loss_ref).abs() + SLACK
    assert_within_bf16_rule(grad_flash, grad_sdpa, grad_ref, f"{name} gradients")
