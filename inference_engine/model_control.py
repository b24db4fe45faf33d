"""CONTROL: loading and unloading models while the engine keeps answering.

A load runs on its own thread: it builds the new ``EngineCore`` and tokenizers next to the
serving ones, then hands them to the busy loop, which switches once the current model's
requests have finished. While a load or unload is under way, new requests are refused with
``model_loading`` (the router sends them to another replica); a load that fails leaves the
current model serving and says why in STATS.

Where two models cannot be held at once (``replace``: on a GPU, the serving model's KV cache
was sized to fill the device), a load first unloads the serving model once its requests have
finished, then builds the new one; if that fails, it loads the previous model again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inference_engine.config import EngineConfig
from inference_engine.core import EngineCore
from inference_engine.protocol import ControlRequest, ControlResponse, ErrorCode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

READY, LOADING, UNLOADED = "ready", "loading", "unloaded"


@dataclass
class LoadedModel:
    """Everything the server swaps in at once."""

    config: EngineConfig
    core: EngineCore
    # one tokenizer per thread: the I/O thread encodes while the output thread decodes
    input_tokenizer: PreTrainedTokenizerBase
    output_tokenizer: PreTrainedTokenizerBase


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer without a length limit of its own: the engine refuses a prompt
    past its ``max_model_len`` itself (``context_length_exceeded``), so the tokenizer's
    ``model_max_length`` would only log transformers' "Token indices sequence length is
    longer than the specified maximum" warning for every such prompt."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


def load_model(config: EngineConfig) -> LoadedModel:
    input_tokenizer = load_tokenizer(config.model)
    # structured outputs compile against the input tokenizer, on the same (I/O) thread
    core = EngineCore(config, tokenizer=input_tokenizer)
    return LoadedModel(config, core, input_tokenizer, load_tokenizer(config.model))


class ModelController:
    def __init__(
        self,
        config: EngineConfig,
        switch: Callable[[LoadedModel | None], None],
        loader: Callable[[EngineConfig], LoadedModel] = load_model,
        replace: bool = False,
    ) -> None:
        """``switch(model)`` asks the busy loop to swap in ``model`` (None: unload) once the
        current requests are done; it calls ``switched()`` when it has. ``replace``: unload the
        serving model before building the next one (``replace`` may also be set once the
        first model is up and its device known)."""
        self.base_config = config  # the engine's flags; a load changes only the model
        self.model_path: str | None = config.model
        self.replace = replace
        self._switch = switch
        self._loader = loader
        self._lock = threading.Lock()
        self.state = READY
        self.detail = ""
        # a replacing load waiting for the serving model's unload: (its config, that model)
        self._load_after_unload: tuple[EngineConfig, str] | None = None
        # what STATS says once the next switch is done (a failed load's reason)
        self._detail_after_switch = ""

    @property
    def refusal(self) -> tuple[ErrorCode, str] | None:
        """Why a new request must be refused now, if it must."""
        if self.state == LOADING:
            return ErrorCode.MODEL_LOADING, f"the engine is switching models ({self.detail})"
        if self.state == UNLOADED:
            return ErrorCode.MODEL_NOT_LOADED, "no model is loaded (CONTROL unload)"
        return None

    def handle(self, request: ControlRequest) -> ControlResponse:
        with self._lock:
            if self.state == LOADING:
                return ControlResponse(False, f"busy: {self.detail}")
            if request.action == "load":
                return self._start_load(request.model)
            if request.action == "unload":
                if self.state == UNLOADED:
                    return ControlResponse(True, "no model was loaded")
                self.state, self.detail = LOADING, "unloading: finishing running requests"
                self._switch(None)
                return ControlResponse(True, "unloading")
        return ControlResponse(False, f"unknown action {request.action!r} (use load or unload)")

    def _start_load(self, model: str | None) -> ControlResponse:
        if not model or not (Path(model) / "config.json").is_file():
            return ControlResponse(False, f"no Hugging Face model directory at {model!r}")
        config = dataclasses.replace(self.base_config, model=model)
        self.state = LOADING
        if self.replace and self.model_path is not None:
            self.detail = f"unloading {self.model_path} to load {model}: finishing its requests"
            self._load_after_unload = (config, self.model_path)
            self._switch(None)
            return ControlResponse(True, f"loading {model} once {self.model_path} is unloaded")
        self.detail = f"loading {model}"
        self._start_thread(config, None)
        return ControlResponse(True, f"loading {model}")

    def _start_thread(self, config: EngineConfig, previous: str | None) -> None:
        threading.Thread(
            target=self._load, args=(config, previous), name="engine-load", daemon=True
        ).start()

    def _load(self, config: EngineConfig, previous: str | None) -> None:
        """Build ``config``'s model and hand it to the busy loop; ``previous``: the model
        unloaded to make room, loaded again if this one fails."""
        try:
            loaded = self._loader(config)
        except Exception as exc:  # noqa: BLE001 - reported in STATS
            logger.exception("loading %s failed", config.model)
            failure = f"load of {config.model} failed: {exc}"
            if previous is not None:
                self._reload(previous, failure)
                return
            with self._lock:
                self.state = READY if self.model_path is not None else UNLOADED
                self.detail = failure
            return
        with self._lock:
            self.detail = f"loaded {config.model}; finishing running requests"
        self._switch(loaded)

    def _reload(self, model: str, failure: str) -> None:
        """After a replacing load failed: serve ``model`` again, or nothing if it fails too."""
        with self._lock:
            self.detail = f"{failure}; loading {model} again"
        try:
            loaded = self._loader(dataclasses.replace(self.base_config, model=model))
        except Exception as exc:  # noqa: BLE001 - reported in STATS
            logger.exception("loading %s again failed", model)
            with self._lock:
                self.state = UNLOADED
                self.detail = f"{failure}; loading {model} again failed: {exc}"
            return
        with self._lock:
            self._detail_after_switch = f"{failure}; serving {model} again"
        self._switch(loaded)

    def switched(self, loaded: LoadedModel | None) -> None:
        """Called by the busy loop once ``loaded`` (None: nothing) is serving."""
        with self._lock:
            detail, self._detail_after_switch = self._detail_after_switch, ""
            if loaded is None and self._load_after_unload is not None:
                (config, previous), self._load_after_unload = self._load_after_unload, None
                self.model_path, self.detail = None, f"loading {config.model}"
                self._start_thread(config, previous)
            elif loaded is None:
                self.model_path, self.state, self.detail = None, UNLOADED, "unloaded"
            else:
                self.model_path, self.state, self.detail = loaded.config.model, READY, detail
