"""Runs a tool of the package as upipe runs it: `python3 -m upipe_tools.TOOL ARGS...`, the
package from this checkout's python/ (ahead of any other on PYTHONPATH)."""
import os
import subprocess
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "python"


def run_tool(tool, *args, **options):
    """The finished process (stdout and stderr captured as text unless `options` say otherwise)."""
    env = dict(os.environ)
    env.pop("UPIPE_COMMAND", None)  # the tool speaks as itself, not as upipe
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    options.setdefault("capture_output", True)
    options.setdefault("text", True)
    return subprocess.run([sys.executable, "-m", f"upipe_tools.{tool}", *map(str, args)], env=env, **options)
