import pytest

from .procs import NodeProcess


@pytest.fixture
def nodes():
    """Start NodeProcess-es with nodes(args, run_dir); every one is torn down after the test."""
    started: list[NodeProcess] = []

    def start(args, run_dir, **kw) -> NodeProcess:
        node = NodeProcess(list(args), run_dir, **kw)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()
