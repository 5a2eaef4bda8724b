"""Every Prometheus counter sglang-pic serves on ``/metrics`` is in a guide, by its full name."""

from __future__ import annotations

import pytest
from conftest import REPO

DOCS = REPO / "docs"


def _tables() -> dict[str, dict[str, tuple[str, str]]]:
    from sglang_pic.position_free import shifted_batches
    from sglang_pic.spans import store_tier
    from sglang_pic.sparse import metrics as sparse_metrics

    return {"sparse": sparse_metrics.COUNTERS, "position_free": shifted_batches.COUNTERS,
            "span_store": store_tier.COUNTERS}


@pytest.mark.parametrize("feature", ["sparse", "position_free", "span_store"])
def test_every_counter_is_in_the_docs(feature):
    text = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    names = [name for name, _ in _tables()[feature].values()]
    missing = [n for n in names if f"`{n}_total`" not in text]
    assert names and not missing, missing
