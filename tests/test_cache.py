"""The NF4 block cache and the host tiers: same bytes, same training, bit for bit.

* every tier (``mapped``, ``disk``) trains bitwise equal to the resident reference -- and so to
  ``pinned``, which the parity suite holds to the same reference -- for every family;
* a second load hits the cache (no block weight read or quantized) and trains bitwise like the first;
* any damaged byte of an entry is found before training, reported in one line, and the entry rebuilt;
* a changed quantization or checkpoint file makes a new entry;
* two processes mapping one entry share its pages (PSS from ``/proc/<pid>/smaps``).
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import poros
from poros import cache
from poros.testing import TINY_VARIANTS
from test_parity import BASE_SETUP, run_parity

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]


@pytest.mark.parametrize("tier", ["mapped", "disk"])
@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_every_tier_trains_bitwise(family, variant, tier, tmp_path):
    streamed = run_parity(family, variant, BASE_SETUP, tmp_path, host_tier=tier, read_ahead=2,
                          cache_dir=str(tmp_path / "cache"))
    assert streamed.host_plan.tier == tier
    assert type(streamed.store.host_tier).__name__ == {"mapped": "MappedTier", "disk": "DiskTier"}[tier]
    if tier == "disk":
        assert streamed.store.host_tier.stats["reads"] > 0
