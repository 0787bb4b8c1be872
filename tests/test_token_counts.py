"""Token counts for PLT: once per token per step, whatever the activation recompute settings."""

import json

import pytest
from conftest import torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.both_releases]


def counts(tmp_path, *flags):
    out = tmp_path / ("recompute" if flags else "plain")
    out.mkdir()
    torchrun("token_counts.py", *flags, env={"PEC_TEST_OUT": str(out)})
    return [json.loads((out / f"token_counts.rank{r}.json").read_text()) for r in (0, 1)]


def test_recomputed_layers_count_their_tokens_once(tmp_path):
    plain = counts(tmp_path)
    recomputed = counts(tmp_path, "--recompute-granularity", "full")
    for rank in (0, 1):
        assert recomputed[rank]["counts"] == plain[rank]["counts"]
        for layer in plain[rank]["counts"]:
            assert sum(layer) == plain[rank]["routed_per_layer"]  # each routed token once, not twice
