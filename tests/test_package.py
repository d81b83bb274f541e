import importlib.metadata

import pytest
import torch

import flash_attn
from flash_attn._native import MissingExtensionError, extension_available, load_extension


def test_version_matches_distribution():
    assert flash_attn.__version__ == importlib.metadata.version("flash_attn")
    major, minor, patch = (int(x) for x in flash_attn.__version__.split(".")[:3])
    assert major == 2 and (minor, patch) >= (3, 3)


def test_public_functions_exported():
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"):
        assert callable(getattr(flash_attn, name))


def test_missing_extension_error_says_how_to_build():
    with pytest.raises(MissingExtensionError, match="pip install --no-build-isolation"):
        load_extension("flash_attn_no_such_extension")
    assert not extension_available("flash_attn_no_such_extension")


@pytest.mark.skipif(torch.cuda.is_available() and extension_available("flash_attn_2_cuda"),
                    reason="the extension is built here")
def test_attention_without_extension_raises_clear_error():
    # Validation passes for a CUDA-like call only on a GPU; on CPU the device check speaks first.
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises((MissingExtensionError, ValueError), match="CUDA"):
        flash_attn.flash_attn_func(q, q, q)
