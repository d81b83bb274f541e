"""The dtype a layer actually computes in, which autocast decides rather than the weights."""

import torch


def compute_dtype(device_type, dtype):
    """autocast's dtype on `device_type` while autocast is enabled there, else `dtype`."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype
