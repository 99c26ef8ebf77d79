"""upipe_tools.tensorboard_follow (`upipe tensorboard`): a metrics file of upipe train as TensorBoard scalars."""
import json
import os
import struct

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

tensorboardX = pytest.importorskip("tensorboardX")
from tool_run import run_tool  # noqa: E402


def scalars(logdir):
    """Every (tag, step, value) of the event files in logdir (TFRecord framing: length,
    its CRC, the event, its CRC)."""
    from tensorboardX.proto import event_pb2
    out = []
    for name in os.listdir(logdir):
        with open(os.path.join(logdir, name), "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_steps_become_scalars(tmp_path):
    metrics = tmp_path / "m.jsonl"
    rows = [{"step": 1, "loss": 5.5, "lr": 1e-4, "grad_norm": 2.0, "time": "2026-12-03T06:40:12.345Z"},
            {"step": 2, "loss": 5.0, "lr": 2e-4, "grad_norm": 1.5, "eval_loss": 5.2},
            {"final": True, "steps": 2}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_tool("tensorboard_follow", str(metrics), "--logdir", str(tmp_path / "tb"))
    assert r.returncode == 0, r.stderr
    got = scalars(tmp_path / "tb")
    assert ("train/loss", 1, 5.5) in got
    assert ("train/loss", 2, 5.0) in got
    assert any(t == "eval/loss" and s == 2 and abs(v - 5.2) < 1e-6 for t, s, v in got)
    assert not any(t == "eval/loss" and s == 1 for t, s, v in got)


def test_a_broken_line_is_named(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0, "lr": 0.1}\n{"step": 2, "lo\n')
    r = run_tool("tensorboard_follow", str(metrics), "--logdir", str(tmp_path / "tb"))
    assert r.returncode != 0
    assert "line 2 is not JSON" in r.stderr


def run_follow(metrics, logdir):
    return run_tool("tensorboard_follow", str(metrics), "--logdir", str(logdir))


def one_error_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("tensorboard_follow: error:"), r.stderr
    return lines[0]


def test_invalid_utf8_is_one_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(b'{"step": 1, "loss": 1.0, "lr": 0.1}\n{"step": 2, "loss": \xff\xfe}\n')
    assert "not UTF-8" in one_error_line(run_follow(metrics, tmp_path / "tb"))


def test_a_logdir_that_is_a_file_is_one_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0, "lr": 0.1}\n')
    (tmp_path / "tb").write_text("a file")
    assert "--logdir" in one_error_line(run_follow(metrics, tmp_path / "tb"))


def test_deep_json_is_one_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": ' + "[" * 100000 + "]" * 100000 + "}\n")
    assert "line 1" in one_error_line(run_follow(metrics, tmp_path / "tb"))
