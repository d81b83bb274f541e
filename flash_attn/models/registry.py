"""Model families: which config converter and state-dict remap serve a checkpoint.

Each family module (llama.py, falcon.py, ...) calls register_family() when it is imported. This
module knows only their names (FAMILY_MODULES) and imports them on the first lookup, so a family
imports nothing from gpt.py and gpt.py imports no family.

A checkpoint is matched by the HF `model_type` of its config.json when it has one that a family
registered; otherwise (a bare state dict, or a model_type no family claims) by key markers: each
family's `matches(state_dict)`, tried in FAMILY_MODULES order, so a layout that contains another
family's marker (BTLM and GPTBigCode use GPT-2's key names) is listed before it.

Adding a family: write flash_attn/models/<family>.py with its config converter and remap, ending
in register_family(ModelFamily(...)); add the module's name to FAMILY_MODULES; add
tests/models/test_<family>.py.
"""

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

FAMILY_MODULES = (
    "flash_attn.models.btlm",
    "flash_attn.models.bigcode",
    "flash_attn.models.gpt",  # GPT-2 and Megatron
    "flash_attn.models.opt",
    "flash_attn.models.llama",
    "flash_attn.models.baichuan",
    "flash_attn.models.falcon",
    "flash_attn.models.gpt_neox",
    "flash_attn.models.gptj",
)


@dataclass(frozen=True)
class ModelFamily:
    """name: for messages. model_types: the HF config.json `model_type`s it serves.
    config_to_gpt2_config(hf_config) -> GPT2Config (None: the family has no HF config).
    remap_state_dict(state_dict, config) -> GPTLMHeadModel's state dict; inv_remap_state_dict the
    way back, where there is one. matches(state_dict) -> bool: the layout's key marker."""

    name: str
    module: str
    model_types: Tuple[str, ...]
    remap_state_dict: Callable
    config_to_gpt2_config: Optional[Callable] = None
    inv_remap_state_dict: Optional[Callable] = None
    matches: Optional[Callable] = None


_FAMILIES = {}  # name -> ModelFamily
_loaded = False


def register_family(family):
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family: expected a ModelFamily, got {type(family).__name__}")
    _FAMILIES[family.name] = family


def key_pattern(pattern):
    """A `matches` that is true when some key of the state dict contains the regex pattern."""
    regex = re.compile(pattern)
    return lambda state_dict: any(regex.search(key) for key in state_dict)


def families():
    """Every registered family, in key-marker order (FAMILY_MODULES, then others as registered)."""
    global _loaded
    if not _loaded:
        for name in FAMILY_MODULES:
            importlib.import_module(name)
        _loaded = True
    order = {name: i for i, name in enumerate(FAMILY_MODULES)}
    return sorted(_FAMILIES.values(), key=lambda f: order.get(f.module, len(order)))


def family_for_model_type(model_type):
    """The family registered for an HF model_type, or None."""
    for family in families():
        if model_type in family.model_types:
            return family
    return None


def family_for_state_dict(state_dict):
    """The first family whose key marker matches the state dict, or None."""
    for family in families():
        if family.matches is not None and family.matches(state_dict):
            return family
    return None


def gpt2_config_from_hf_config(hf_config):
    """An HF config (LlamaConfig, FalconConfig, ...) -> the GPT2Config of its family."""
    model_type = getattr(hf_config, "model_type", None)
    family = family_for_model_type(model_type)
    if family is None or family.config_to_gpt2_config is None:
        raise ValueError(f"gpt2_config_from_hf_config: no registered family converts "
                         f"model_type {model_type!r}")
    return family.config_to_gpt2_config(hf_config)


def checkpoint_model_type(model_name):
    """The `model_type` in the config.json beside a local checkpoint's weights, or None."""
    from flash_attn.utils.pretrained import resolve_weight_files

    config_file = Path(resolve_weight_files(model_name)[0]).parent / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("model_type")


def remap_state_dict_any(state_dict, config, model_type=None):
    """A checkpoint's state dict -> GPTLMHeadModel's: returned as is when it already is ours,
    else remapped by the family of model_type, or of its key names when model_type is None or
    claimed by no family."""
    keys = list(state_dict)
    if any(k.startswith("transformer.layers.") for k in keys):
        return state_dict
    family = family_for_model_type(model_type) if model_type is not None else None
    if family is None:
        family = family_for_state_dict(state_dict)
    if family is None:
        raise ValueError(f"remap_state_dict_any: unrecognised checkpoint layout (model_type "
                         f"{model_type!r}; first keys: {', '.join(keys[:3])})")
    return family.remap_state_dict(state_dict, config)
