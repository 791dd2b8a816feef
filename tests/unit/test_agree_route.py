"""Where ``ckptd.trainer.agree`` sends a group's agreement: the group itself (a CPU
backend), a gloo side group made once (NCCL), or, where no gloo group can be made, the
group itself on its device, with one warning. A stand-in ``torch.distributed`` records
what is asked of it; the real one runs in tests/e2e/test_agree_cost.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from ckptd.trainer import agree


class FakeDist:
    """The parts of ``torch.distributed`` that choosing a route uses."""

    def __init__(self, backend: str, *, gloo: bool = True, fails: bool = False) -> None:
        self.backend = backend
        self.gloo = gloo
        self.fails = fails
        self.made: list[dict[str, Any]] = []

        class Group:
            WORLD = object()

        self.group = Group

    def get_backend(self, group: Any = None) -> str:
        return self.backend

    def is_gloo_available(self) -> bool:
        return self.gloo

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return [0, 2]

    def new_group(self, **kwargs: Any) -> object:
        self.made.append(kwargs)
        if self.fails:
            raise RuntimeError("no interface to bind")
        return object()


@pytest.fixture(autouse=True)
def no_routes() -> Iterator[None]:
    agree._routes.clear()
    yield
    agree._routes.clear()


@pytest.mark.parametrize("backend", ["gloo", "mpi", "cpu:gloo,cuda:nccl"])
def test_a_cpu_backend_is_used_as_it_is(backend: str) -> None:
    dist = FakeDist(backend)
    route = agree._route(dist, None)
    assert route == agree._Route(None, on_cpu=True)
    assert dist.made == []


def test_nccl_gets_one_gloo_side_group_made_once() -> None:
    dist = FakeDist("nccl")
    first = agree._route(dist, None)
    assert agree._route(dist, None) is first
    assert dist.made == [{"backend": "gloo"}]
    assert first.on_cpu and first.group is not None


def test_a_subgroup_side_group_is_made_by_its_members_alone() -> None:
    dist = FakeDist("nccl")
    subgroup = object()
    route = agree._route(dist, subgroup)
    assert dist.made == [{"ranks": [0, 2], "backend": "gloo", "use_local_synchronization": True}]
    assert route.on_cpu and route.group is not subgroup


@pytest.mark.parametrize(
    ("gloo", "fails", "why"),
    [(False, False, "built without gloo"), (True, True, "no interface to bind")],
)
def test_without_a_gloo_group_the_group_itself_is_used_with_one_warning(
    caplog: pytest.LogCaptureFixture, gloo: bool, fails: bool, why: str
) -> None:
    dist = FakeDist("nccl", gloo=gloo, fails=fails)
    with caplog.at_level(logging.WARNING, logger="ckptd.trainer"):
        route = agree._route(dist, None)
        assert agree._route(dist, None) is route
    assert route == agree._Route(None, on_cpu=False)
    (record,) = caplog.records
    assert why in record.getMessage()
    assert "one device synchronisation per step" in record.getMessage()
