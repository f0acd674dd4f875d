"""bench/plot_results.py reading bench_engine.py results: which way a ratio points, which file a run measured;
and quant_quality.py rows: which rows are drawn, under which label."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from plot_results import advantages, gguf_file, quality_rows  # noqa: E402


def test_advantages_point_the_way_better_is():
    engines = {
        "ours": {"decode_b32_tok_s": 800.0, "prefix_cold_ttft_s": 2.0, "startup_s": 1.0, "throughput_64_tok_s": 300.0},
        "vllm": {"decode_b32_tok_s": 500.0, "prefix_cold_ttft_s": 2.5, "startup_s": 70.0, "throughput_64_tok_s": 30.0,
                 "details": {"unlike": ["throughput_64_tok_s"]}},
        "llamacpp": {"error": "not built"},
    }
    assert advantages(engines) == {("decode_b32_tok_s", "vllm"): pytest.approx(1.6),
                                   ("prefix_cold_ttft_s", "vllm"): pytest.approx(1.25)}  # no startup, no unlike run


def test_the_measured_gguf_is_the_commands():
    run = {"ours": {"command": "bench/bench_engine.py --only ours,llamacpp --gguf /x/smollm2-Q4_K_M.gguf --repeats 3"}}
    assert gguf_file(run) == "smollm2-Q4_K_M.gguf"
    assert gguf_file({"ours": {"command": "bench/bench_engine.py --only ours"}}) == "embedded Q4_1"


def test_quality_rows_leave_out_the_float_models_and_take_the_label(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([
        {"config": "float32", "increase": {"calib": 0.0, "heldout": 0.0}},
        {"config": "float32-rotated-auto", "increase": {"calib": 1e-7, "heldout": -1e-7}},
        {"config": "gptq-w4", "increase": {"calib": 0.0478, "heldout": 0.0762}},
        {"config": "gptq-w4+tune120", "increase": {"calib": 0.0248, "heldout": 0.0302}}]))
    assert quality_rows(f"rotated={path}") == [
        ("rotated: gptq-w4", {"calib": pytest.approx(4.78), "heldout": pytest.approx(7.62)}),
        ("rotated: gptq-w4+tune120", {"calib": pytest.approx(2.48), "heldout": pytest.approx(3.02)})]
    assert [label for label, _ in quality_rows(str(path))] == ["gptq-w4", "gptq-w4+tune120"]
