"""upipe's Python tools: the offline helpers beside the engine (training itself never runs
Python). The upipe binary carries this package and runs each tool as `python3 -m
upipe_tools.TOOL` with the package on PYTHONPATH:

  prepare_data        upipe prepare-data: documents and chats into a corpus (with its
                      modules chat_data, corpus_writer and prepare_encode)
  niah_text           upipe eval --niah: the needles in a model tokenizer's own tokens
  report              upipe report: plots of bench, plan, eval and metrics files
  tensorboard_follow  upipe tensorboard: a metrics file as TensorBoard scalars

From a checkout the same runs as `PYTHONPATH=python python3 -m upipe_tools.TOOL ...`.
"""
import os


def error_line(tool, message):
    """The one line a tool's refusal prints: upipe's own (`upipe: error: COMMAND: ...`) when
    upipe runs it (UPIPE_COMMAND in the environment), else `TOOL: error: ...`."""
    command = os.environ.get("UPIPE_COMMAND")
    return f"upipe: error: {command}: {message}" if command else f"{tool}: error: {message}"


def program(tool, command):
    """The program name a tool's --help and usage show: upipe's command where upipe runs it."""
    return f"upipe {command}" if os.environ.get("UPIPE_COMMAND") else f"python3 -m upipe_tools.{tool}"
