import pytest
import torch
import torch.nn.functional as F

from flash_attn.modules.mlp import GatedMlp, Mlp, fused_mlp_cls


def test_mlp_is_fc_act_fc():
    torch.manual_seed(0)
    mlp = Mlp(16, hidden_features=40, out_features=8, activation=F.relu)
    x = torch.randn(3, 5, 16)
    expected = F.linear(F.relu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)
    assert (mlp(x) - expected).abs().max().item() < 1e-6
    assert Mlp(16).fc1.out_features == 64  # default 4x
    out, residual = Mlp(16, return_residual=True)(x)
    assert residual is x and out.shape == x.shape


@pytest.mark.parametrize("activation", [F.sigmoid, F.silu, F.gelu])
def test_gated_mlp_value_times_gate(activation):
    torch.manual_seed(0)
    mlp = GatedMlp(24, hidden_features=40, activation=activation, multiple_of=16, bias1=False)
    assert mlp.fc1.out_features == 2 * 48 and mlp.fc2.in_features == 48  # 40 rounded up to 16s
    x = torch.randn(2, 3, 24)
    value, gate = F.linear(x, mlp.fc1.weight).chunk(2, dim=-1)
    expected = mlp.fc2(value * activation(gate))
    assert (mlp(x) - expected).abs().max().item() < 1e-6
    assert GatedMlp(24, multiple_of=1).fc2.in_features == 64  # default int(8/3 * 24)


def test_fused_mlp_matches_mlp_on_cpu():
    fused_cls = fused_mlp_cls()
    if fused_cls is None:
        pytest.skip("flash_attn.ops.fused_dense.FusedMLP is not available")
    torch.manual_seed(0)
    mlp = Mlp(16, hidden_features=32, activation=lambda t: F.gelu(t, approximate="tanh"))
    fused = fused_cls(16, hidden_features=32, activation="gelu_approx")
    fused.load_state_dict(mlp.state_dict())  # same parameter names: checkpoints are shared
    x = torch.randn(4, 16)
    assert (fused(x) - mlp(x)).abs().max().item() < 1e-6


@pytest.mark.gpu
def test_fused_mlp_matches_mlp_gpu():
    fused_cls = fused_mlp_cls()
    if fused_cls is None:
        pytest.skip("flash_attn.ops.fused_dense.FusedMLP is not available")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    mlp = Mlp(1024, activation=lambda t: F.gelu(t, approximate="tanh"), device="cuda", dtype=dtype)
    fused = fused_cls(1024, activation="gelu_approx", device="cuda", dtype=dtype)
    fused.load_state_dict(mlp.state_dict())
    x = torch.randn(8, 512, 1024, device="cuda", dtype=dtype)
    ref = mlp.float()(x.float())
    mlp.to(dtype)
    err = (fused(x).float() - ref).abs().max().item()
    base = (mlp(x).float() - ref).abs().max().item()
    assert err <= 2 * base + 1e-3
