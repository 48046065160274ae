"""R4.6, R4.8 at scale (slow, not in CI: ``pytest -m slow tests/test_exactness_slow.py``):
5,000 held-out inputs of 1 token to the model's limit from 16 concurrent clients, a mode-2
server serving learned counts against a mode-0 server: every answer byte-identical."""

from __future__ import annotations

import pytest

from bench.exactness import run
from tests.conftest import L3


@pytest.mark.slow
def test_mode2_answers_are_byte_identical_to_mode0_at_scale(tmp_path):
    result = run(L3, 5000, 16, (8, 512), work=tmp_path)
    assert result["drift"] is None, result
    assert result["forwards_by_count"].get("2", 0) > 0, result  # learned counts were served
    assert result["differing_answers"] == 0, result
