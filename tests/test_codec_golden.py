"""The codec does with every recorded input exactly what it did when the corpus was recorded
(`tests/codec_golden.py`): the same decoded value, the same encoded text and bytes, the same
error code, param, message, status and lane."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .codec_golden import _load_input, load, outcome


def test_corpus_covers_each_decoder_both_ways() -> None:
    cases = load()
    kinds = Counter((c["decoder"], next(iter(c["expect"]))) for c in cases)
    decoders = {decoder for decoder, _ in kinds}
    for decoder in ("client_event:json", "server_event:json", "from_wire:Item:strict"):
        assert kinds[decoder, "repr"] >= 20 and kinds[decoder, "error"] >= 20, decoder
    assert len(decoders) >= 25
    codes = Counter(c["expect"]["error"][0] for c in cases if "error" in c["expect"])
    assert {
        "invalid_type",
        "invalid_value",
        "unknown_parameter",
        "missing_required_parameter",
    } <= set(codes)


def test_codec_matches_the_recorded_corpus() -> None:
    differences: list[tuple[str, Any, dict[str, Any], dict[str, Any]]] = []
    for case in load():
        got = outcome(case["decoder"], _load_input(case))
        if got != case["expect"]:
            differences.append((case["decoder"], _load_input(case), case["expect"], got))
    shown = [
        f"{decoder}: {str(data)[:300]}\n  recorded {expect}\n  now      {got}"
        for decoder, data, expect, got in differences[:5]
    ]
    assert not differences, f"{len(differences)} cases differ; the first:\n" + "\n".join(shown)
