"""``fastpipe train``: a character-level GPT trained through ``Pipe`` on Python's standard library."""

from fastpipe.train.model import GPTConfig, LMHead, LMLoss, build_gpt
from fastpipe.train.options import SYNC_SCHEDULES, TrainError, add_arguments
from fastpipe.train.run import run

__all__ = ["GPTConfig", "LMHead", "LMLoss", "build_gpt", "SYNC_SCHEDULES", "TrainError", "add_arguments", "run"]
