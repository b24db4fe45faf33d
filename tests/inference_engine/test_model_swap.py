"""How CONTROL load swaps models where two cannot be held at once (``replace``), driven through
the controller with a fake loader: the order of unload and load, and what a failure leaves."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.model_control import LOADING, READY, UNLOADED, ModelController
from inference_engine.protocol import ControlRequest


class Harness:
    """A controller whose switches are recorded and whose loads fail for the named models."""

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.switches: list[str | None] = []
        self.loads: list[str] = []
        self.switched_to = threading.Event()
        self.controller = ModelController(
            EngineConfig(model="/models/a"), self.switch, loader=self.load, replace=True
        )

    def load(self, config: EngineConfig):
        self.loads.append(config.model)
        if config.model in self.failing:
            raise ValueError(f"cannot load {config.model}")
        return SimpleNamespace(config=config)

    def switch(self, loaded) -> None:
        self.switches.append(None if loaded is None else loaded.config.model)
        self.switched_to.set()

    def busy_loop_switches(self) -> None:
        """What the busy loop does once the serving model's requests are done."""
        assert self.switched_to.wait(5)
        self.switched_to.clear()
        model = self.switches[-1]
        self.controller.switched(None if model is None else SimpleNamespace(config=model_of(model)))


def model_of(path: str) -> EngineConfig:
    return EngineConfig(model=path)


@pytest.fixture
def dirs(tmp_path):
    for name in ("b", "broken"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return tmp_path


def test_the_serving_model_is_unloaded_before_the_next_is_built(dirs):
    harness = Harness(failing=set())
    controller = harness.controller
    reply = controller.handle(ControlRequest("load", model=str(dirs / "b")))
    assert reply.ok
    assert harness.switches == [None] and harness.loads == []  # nothing built yet
    assert controller.state == LOADING and "unloading /models/a" in controller.detail
    harness.busy_loop_switches()  # unloaded: now the load starts
    harness.busy_loop_switches()
    assert harness.loads == [str(dirs / "b")] and harness.switches == [None, str(dirs / "b")]
    assert (controller.state, controller.model_path, controller.detail) == (
        READY,
        str(dirs / "b"),
        "",
    )


def test_a_failed_load_brings_the_previous_model_back(dirs):
    harness = Harness(failing={str(dirs / "broken")})
    controller = harness.controller
    assert controller.handle(ControlRequest("load", model=str(dirs / "broken"))).ok
    harness.busy_loop_switches()
    harness.busy_loop_switches()
    assert harness.loads == [str(dirs / "broken"), "/models/a"]
    assert controller.state == READY and controller.model_path == "/models/a"
    assert "failed" in controller.detail and "serving /models/a again" in controller.detail


def test_when_the_previous_model_fails_too_nothing_is_served_and_stats_say_why(dirs):
    harness = Harness(failing={str(dirs / "broken"), "/models/a"})
    controller = harness.controller
    assert controller.handle(ControlRequest("load", model=str(dirs / "broken"))).ok
    harness.busy_loop_switches()
    for _ in range(100):
        if controller.state != LOADING:
            break
        threading.Event().wait(0.02)
    assert controller.state == UNLOADED and controller.model_path is None
    assert "loading /models/a again failed" in controller.detail


def test_beside_is_the_default_controller_and_model_swap_is_validated():
    assert ServerConfig().model_swap == "auto"
    with pytest.raises(ValueError, match="model_swap must be one of"):
        ServerConfig(model_swap="swap")
    controller = ModelController(EngineConfig(model="/m"), lambda loaded: None)
    assert controller.replace is False
