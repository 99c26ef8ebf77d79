"""scripts/step_time_check.py: the step-time model against measured bench rows and train
steps, its ratio printed and held to the tolerance; --calibrate's rates from the phases."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "step_time_check.py")

MODEL = {"total": 10.0, "gemm": 2.0, "attention": 6.0, "elementwise": 0.5, "all_to_all": 1.0, "ring": 0.0,
         "zero": 0.5, "data_parallel": 0.0, "host_adamw": 1.0, "lone_step_extra": 0.8}
RATES = {"gemm_tflops": 600, "attention_tflops": 500, "elementwise_ns": 400, "host_adamw_gbytes": 100}


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def bench_row(step_ms, emulated, **more):
    row = {"strategy": "upipe", "head_chunk": 8, "seq_len": 131072, "cp": 8, "emulated": emulated, "layers": 32,
           "model": "llama3-8b", "checkpoint_policy": "what=input,every=1,where=device", "step_ms": step_ms,
           "step_seconds_model": MODEL, "step_rates": RATES}
    row.update(more)
    return row


def test_bench_rows_are_held_to_the_model(tmp_path):
    rows = tmp_path / "bench.json"
    # Every rank run: the whole model (10 s); rank 0 emulated: without the collectives (8.5 s).
    rows.write_text(json.dumps([bench_row(10_500, False), bench_row(8_500, True), bench_row(20_000, False)]))
    out = run(str(rows))
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [l for l in out.stdout.splitlines() if l.startswith("bench.json")]
    assert [l.split()[-1] for l in lines] == ["1.050", "1.000", "OUTSIDE"]
    assert "1 outside" in out.stdout
    within = tmp_path / "within.json"
    within.write_text(json.dumps([bench_row(10_500, False)]))
    assert run(str(within)).returncode == 0


def test_the_last_train_step_waits_for_its_update(tmp_path):
    metrics = tmp_path / "m.jsonl"
    # The first step builds cuDNN's plans: printed, not held; the last waits for its update.
    records = [{"step": 1, "seq_len": 1024, "tokens_per_s": 30.0, "seconds": 30.0},
               {"step": 2, "seq_len": 1024, "tokens_per_s": 100.0, "seconds": 10.24},
               {"step": 3, "seq_len": 1024, "tokens_per_s": 94.0, "seconds": 10.8},
               {"final": True, "steps": 3, "step_seconds_model": MODEL, "step_rates": RATES}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = run(str(metrics))
    assert out.returncode == 0, out.stdout
    ratios = [float(l.split()[-1]) for l in out.stdout.splitlines() if l.startswith("m.jsonl")]
    assert ratios == [3.0, round(10.24 / 10.0, 3), round(10.8 / 10.8, 3)]
    records[2]["seconds"] = 20.0  # the middle step now twice the model's
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run(str(metrics)).returncode == 1


def test_an_older_run_needs_its_command(tmp_path):
    metrics = tmp_path / "old.jsonl"
    metrics.write_text(json.dumps({"step": 1, "seq_len": 1024, "tokens_per_s": 100.0}) + "\n" +
                       json.dumps({"final": True, "steps": 1}) + "\n")
    out = run(str(metrics))
    assert out.returncode != 0 and "--command" in out.stderr


def test_calibrate_scales_each_rate_by_the_measured_phase(tmp_path):
    rows = tmp_path / "bench.json"
    phases = {"attn_sdpa": 12_000.0, "mlp": 1_000.0, "loss": 1_000.0, "other": 500.0}
    table = {"side_copies": {"weights_in": {"ms": 100.0, "bytes": 5e9, "count": 64}},
             "host": {"host_adamw": {"busy_ms": 2_000.0, "cpu_ms": 30_000.0, "pieces": 900}}}
    rows.write_text(json.dumps([bench_row(10_000, False, phases_ms=phases, step_phases=table)]))
    out = run("--calibrate", str(rows))
    assert out.returncode == 0, out.stderr
    got = dict(l.split(": ", 1)[1].split(" = ") for l in out.stdout.splitlines())
    assert got["attention_tflops"] == "250"  # 6 s of it at 500 took 12 s
    assert got["gemm_tflops"] == "600"
    assert got["elementwise_ns"] == "400"
    assert got["pcie_gbytes (weights_in)"] == "50.0"
    assert got["host_adamw_gbytes (host_adamw)"] == "50.0"
