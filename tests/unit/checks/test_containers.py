"""Doctor's view of an agent's container, through any ContainerEngine (checks/containers.py)."""

from __future__ import annotations

import pytest

from tpuboot.checks.containers import ABSENT, RUNNING, container_state
from tpuboot.containers.engine import Container, EngineNotFound


class OneContainer:
    """An engine that knows one container (only ``inspect`` is asked)."""

    def __init__(self, container: Container | None) -> None:
        self.container = container

    def inspect(self, name: str) -> Container:
        if self.container is None:
            raise EngineNotFound(f"no such container: {name}")
        return self.container


@pytest.mark.parametrize(
    ("container", "said"),
    [
        (None, ABSENT),
        (Container("a", running=True, status="running"), RUNNING),
        (Container("a", running=True, status="restarting"), "restarting"),
        (Container("a", status="exited", exit_code="137"), "exited (exit code 137)"),
        (Container("a", status="exited"), "exited"),  # the engine gave no code
        (Container("a", status="created"), "created"),
        (Container("a"), "stopped"),  # an engine that says nothing of its state
    ],
)
def test_every_engine_is_read_the_same_way(container: Container | None, said: str) -> None:
    assert container_state(OneContainer(container), "tpuboot-vbar") == said  # type: ignore[arg-type]
