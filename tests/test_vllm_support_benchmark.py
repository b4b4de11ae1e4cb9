"""benchmarks/vllm_support.py at its quick size on a real vLLM engine (``make bench``): the exact support."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.vllm_fixtures import requires_vllm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vllm_support  # noqa: E402  (benchmarks/ is not a package)


@pytest.mark.bench
@requires_vllm
def test_asking_for_the_whole_vocabulary_leaves_no_support_unknown(tmp_path, vllm_engine_holder):
    vllm_engine_holder.close()  # one engine at a time
    output = tmp_path / "report.md"
    assert vllm_support.main(["--quick", "--output", str(output)]) == 0
    import json

    payload = json.loads(output.with_suffix(".json").read_text())
    rows = {row["K"]: row for row in payload["rows"]}
    assert rows[payload["vocab"]]["unknown"] == 0.0  # K = the vocabulary: every support is whole
    assert rows[20]["unknown"] > 0.5  # the quick build's barely trained model: most nuclei are wider than 20
    assert "| 0.9 | 20 |" in output.read_text()
