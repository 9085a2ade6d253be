import pytest
from hypothesis import settings

from .procs import NodeProcess, split_rounds

# property tests check what parsing does, not how fast: on 2 busy cores one example can take
# longer than hypothesis's 200 ms deadline (seen once next to a running benchmark)
settings.register_profile("islands", deadline=None)
settings.load_profile("islands")

NETWORK_FIXTURES = {"nodes", "relays"}


def pytest_collection_modifyitems(items):
    """A test that starts nodes or relays is a `network` test (the others mark themselves)."""
    for item in items:
        if NETWORK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.network)


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
    splits = split_rounds(started)  # every multi-island test: no round of the own protocol split
    assert not splits, "rounds that split:\n" + "\n".join(splits)


def _p2pd_pids() -> set[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


@pytest.fixture(scope="session", autouse=True)
def no_stray_p2pd():
    """The suite must end with no p2pd of its own left running."""
    import time

    before = _p2pd_pids()
    yield
    deadline = time.monotonic() + 15
    while _p2pd_pids() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _p2pd_pids() - before
    assert not left, f"p2pd processes left running: {sorted(left)}"
