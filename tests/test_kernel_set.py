"""csrc/flash_attn/generate_kernels.selected_kernel_set: the one reading of FLASH_ATTN_HDIMS /
FLASH_ATTN_DTYPES that setup.py and scripts/prebuild_kernels.py share."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("generate_kernels", ROOT / "csrc" / "flash_attn" / "generate_kernels.py")
generate_kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate_kernels)
select = generate_kernels.selected_kernel_set


def test_defaults_follow_the_archs():
    assert select(["90"], {}) == ([64, 128, 192, 256], ["fp16", "bf16"])
    assert select(["80", "90"], {}) == (list(generate_kernels.HEAD_DIMS), ["fp16", "bf16"])


@pytest.mark.parametrize("raw", ["256,64", "64;256", " 256  64 "])
def test_lists_take_any_separator_and_come_back_sorted(raw):
    assert select(["90"], {"FLASH_ATTN_HDIMS": raw, "FLASH_ATTN_DTYPES": "bf16"}) == ([64, 256], ["bf16"])


def test_all_is_every_head_dim():
    assert select(["90"], {"FLASH_ATTN_HDIMS": "all"})[0] == list(generate_kernels.HEAD_DIMS)


@pytest.mark.parametrize("env,bad", [({"FLASH_ATTN_HDIMS": "48"}, "48"), ({"FLASH_ATTN_HDIMS": "x"}, "x"),
                                     ({"FLASH_ATTN_DTYPES": "fp8"}, "fp8")])
def test_unknown_values_are_named(env, bad):
    with pytest.raises(ValueError, match=f"unknown values \\['{bad}'\\]"):
        select(["90"], env)
