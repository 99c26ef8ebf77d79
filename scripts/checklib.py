"""What the check scripts share (check_hf_checkpoint.py, check_lora_adapter.py): running
upipe, failing loudly where it fails, and counting the checks that fail."""
import subprocess
import sys

failures = []


def upipe(binary, *args):
    """upipe's stdout; exits naming the command and its output where it fails."""
    r = subprocess.run([binary, *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"upipe {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def check(ok, what):
    """Prints one check's outcome; a failed one is kept in `failures`."""
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)
