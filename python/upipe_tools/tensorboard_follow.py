"""Shows a training run in TensorBoard: follows `upipe train --metrics-json FILE` and writes
each step's numbers as TensorBoard scalars (through tensorboardX's event writer).

usage: upipe tensorboard METRICS.jsonl --logdir DIR [--follow] [--poll SECONDS]

  METRICS.jsonl  the file train --metrics-json writes (one JSON object per step, then a
                 final one; a resumed run appends to it)
  --logdir DIR   where the event files go: `tensorboard --logdir DIR` shows them
  --follow       keep reading as the run writes (as tail -f) until its final record, or
                 Ctrl-C; without it, convert what is there and stop

Scalars: train/loss, train/lr, train/grad_norm, train/tokens_per_s,
train/model_tflops_per_s, train/seq_len, eval/loss (where measured), each at its step and
at the wall-clock time the run wrote it. A step written twice (a run resumed from an
earlier checkpoint) is written again: TensorBoard shows the later value.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

from . import error_line, program

SCALARS = [("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
           ("tokens_per_s", "train/tokens_per_s"), ("model_tflops_per_s", "train/model_tflops_per_s"),
           ("seq_len", "train/seq_len"), ("eval_loss", "eval/loss")]


class bad_input(Exception):
    pass


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        fail(f"{message}; see --help")


def fail(message):
    """Bad input ends as one line and status 2."""
    print(error_line("tensorboard_follow", message), file=sys.stderr)
    sys.exit(2)


def wall_time(record):
    """The record's "time" (ISO 8601, UTC) as seconds since the epoch, or now."""
    text = record.get("time")
    if isinstance(text, str):
        try:
            return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return time.time()


def write_record(writer, record, where):
    """Writes one step's scalars; returns True for the run's final record."""
    if not isinstance(record, dict):
        raise bad_input(f"{where}: not a JSON object")
    if record.get("final"):
        return True
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad_input(f"{where}: 'step' must be a whole number of 0 or more, found {json.dumps(step)[:40]}")
    when = wall_time(record)
    for key, tag in SCALARS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            writer.add_scalar(tag, value, global_step=step, walltime=when)
    return False


def follow(path, writer, keep_following, poll):
    """Reads complete lines from `path` (a partial last line waits for its newline)."""
    done = False
    pending = ""
    number = 0
    with open(path, "r", encoding="utf-8") as f:
        while True:
            try:
                chunk = f.read()
            except UnicodeDecodeError as e:
                raise bad_input(f"not UTF-8 text after line {number} ({e.reason}); give the file of upipe train "
                                f"--metrics-json") from None
            if chunk:
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    number += 1
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise bad_input(f"line {number} is not JSON ({e})")
                    except RecursionError:
                        raise bad_input(f"line {number} nests too deep to be a metrics record") from None
                    done = write_record(writer, record, f"line {number}") or done
                writer.flush()
            if done or not keep_following:
                return number
            time.sleep(poll)


def main(argv):
    parser = ArgumentParser(prog=program("tensorboard_follow", "tensorboard"), description=__doc__.splitlines()[0])
    parser.add_argument("metrics")
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--poll", type=float, default=2.0)
    a = parser.parse_args(argv)
    if not (a.poll > 0 and math.isfinite(a.poll)):
        fail(f"--poll {a.poll} must be a positive number of seconds, e.g. 2")
    if not os.path.isfile(a.metrics):
        fail(f"{a.metrics} is not a file: give the file of upipe train --metrics-json")
    if os.path.exists(a.logdir) and not os.path.isdir(a.logdir):
        fail(f"--logdir {a.logdir} is not a folder: give a folder for the event files (made where missing)")
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        fail("needs tensorboardX (python3 -m pip install tensorboardX)")
    try:
        writer = SummaryWriter(logdir=a.logdir)
    except OSError as e:
        fail(f"cannot write event files into --logdir {a.logdir}: {e.strerror or e}")
    try:
        lines = follow(a.metrics, writer, a.follow, a.poll)
    except bad_input as e:
        fail(f"{a.metrics}: {e}")
    except OSError as e:
        fail(f"cannot read {a.metrics}: {e.strerror or e}")
    except KeyboardInterrupt:
        lines = None
    finally:
        writer.close()
    print(f"tensorboard_follow: {a.metrics} -> {a.logdir}" + (f" ({lines} lines)" if lines is not None else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
