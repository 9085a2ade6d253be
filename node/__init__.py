"""The islands-node daemon, its command line and its configuration; the Task API and `attach`."""

from .task import StepResult, Task, TaskContext

__all__ = ["StepResult", "Task", "TaskContext", "attach"]


def __getattr__(name: str):
    if name == "attach":  # the network and the island core load only when asked for
        from .attached import attach

        return attach
    raise AttributeError(name)
