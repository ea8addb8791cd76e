"""Training an EAGLE-3 head for a target by self-distillation (pipeline.py ties the steps):
prompts (prompts.py) -> the target's own answers (distill.py) -> its hidden states and
distributions per position (teacher.py) -> a reduced draft vocabulary (vocab.py) -> the
multi-step training-time-test objective (loop.py) -> a speculators-format checkpoint with its
recipe and data manifest (write.py), which export/eagle3.py reads and `ortspec export
--draft-head` imports."""

from .pipeline import TrainConfig, TrainResult, train_head

__all__ = ["TrainConfig", "TrainResult", "train_head"]
