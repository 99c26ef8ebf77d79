"""upipe_tools.report (`upipe report`): metrics curves, and bad input refused in one line.

run: python3 -m pytest tests/python/test_report.py
"""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("matplotlib")
from upipe_tools import report  # noqa: E402
from tool_run import run_tool  # noqa: E402


def run_report(tmp_path, *inputs):
    return run_tool("report", tmp_path / "plots", *inputs, timeout=120)


def one_error_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("report: error:"), r.stderr
    return lines[0]


def lines_of(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_resumed_run_draws_each_step_once_from_its_later_record():
    # A run to step 4, resumed from step 2's checkpoint: steps 3 and 4 are recorded twice.
    text = lines_of(*[{"step": s, "loss": 5.0 - s, "lr": 0.1} for s in (1, 2, 3, 4)],
                    *[{"step": s, "loss": 9.0 - s, "lr": 0.2} for s in (3, 4, 5)], {"final": True})
    (run,) = report.metrics_rows(text, "m.jsonl")
    assert [s["step"] for s in run["steps"]] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in run["steps"]] == [4.0, 3.0, 6.0, 5.0, 4.0]


def test_a_skipped_step_is_a_gap_not_a_refusal(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(lines_of({"step": 1, "loss": 2.0, "lr": 0.1},
                                {"step": 2, "loss": None, "lr": 0.1, "skipped": True},
                                {"step": 3, "loss": 1.5, "lr": 0.1}))
    r = run_report(tmp_path, metrics)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "plots" / "loss_curve.svg").is_file()
    metrics.write_text(lines_of({"step": 1, "loss": None, "lr": 0.1}))  # null without skipped: refused
    assert "'loss'" in one_error_line(run_report(tmp_path, metrics))


@pytest.mark.parametrize("text", ['{"step": ' + "[" * 100000 + "]" * 100000 + "}\n",
                                  "[" * 100000 + "]" * 100000,
                                  '{"step": 1, "loss": 1.0, "lr": 0.1}\n' + "{" * 50000 + "\n"])
def test_deep_json_is_one_line(tmp_path, text):
    path = tmp_path / "deep.json"
    path.write_text(text)
    line = one_error_line(run_report(tmp_path, path))
    assert "deep" in line or "not JSON" in line


def test_invalid_utf8_is_one_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b'[{"strategy": "\xff"}]')
    assert "not text" in one_error_line(run_report(tmp_path, path))
