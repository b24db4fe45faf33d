"""An engine that cannot start (issue 23): `make run` with a model directory whose weights are
missing. The supervisor restarts the engine with a doubling backoff instead of a busy loop,
and the web tier keeps serving everything that does not need the engine, saying why what
does cannot be served."""

import json
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.config.live_platform import (
    chat,
    demo_login,
    drain,
    read_until,
    run_platform,
    stop,
    supervisor_status,
    wait_for_http,
)

NUM_RESTARTS = 4  # restarts after 1, 2, 4 and 8 s


@pytest.fixture
def broken_platform(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    # a config runplatform accepts, and no weights: the engine exits as it loads the model
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    process, base = run_platform(
        tmp_path, REDIS_URL=None, MODEL_PATH=str(model), SERVED_MODEL_NAME="tiny", ENGINE_ARGS=""
    )
    try:
        api_key = read_until(process, r"API key: (sk-\S+)", timeout=120).group(1)
        output = drain(process)
        wait_for_http(f"{base}/health/live", timeout=120, ok_only=True)
        yield process, base, api_key, output
    finally:
        stop(process)


def _status(url: str, cookie: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_an_engine_that_cannot_start_backs_off_and_the_web_tier_serves_on(
    broken_platform, tmp_path
):
    process, base, api_key, output = broken_platform
    deadline = time.monotonic() + 120
    while supervisor_status(tmp_path)["engine"]["restarts"] < NUM_RESTARTS:
        assert time.monotonic() < deadline, supervisor_status(tmp_path)
        assert process.poll() is None, "".join(output)
        time.sleep(0.5)

    # each restart waits twice as long as the one before: the loop does not spin
    delays = [
        int(match.group(1))
        for match in re.finditer(
            r"engine exited with code \S+; restarting it in (\d+) s", "".join(output)
        )
    ]
    assert delays[:NUM_RESTARTS] == [1, 2, 4, 8], "".join(output)
    status = supervisor_status(tmp_path)
    assert status["engine"]["last_exit_code"] not in (0, None)
    # a web process or worker that died beside the engine says why in the platform's output
    assert status["daphne"]["restarts"] == status["celery"]["restarts"] == 0, (
        status,
        "".join(output),
    )

    # what needs no engine is served; what does is refused with a reason and a retry time
    assert _status(f"{base}/health/live")[0] == 200
    assert _status(f"{base}/accounts/login/")[0] == 200
    ready, body = _status(f"{base}/health/ready")
    assert ready == 503 and json.loads(body)["checks"]["database"] == "ok"
    refused = chat(base, api_key)
    assert refused.status == 503, "".join(output)[-6000:]
    assert int(refused.headers["Retry-After"]) > 0
    assert refused.body["error"]["code"] == "engine_unavailable"
    cookie = demo_login(tmp_path, base)
    console, page = _status(f"{base}/console/platform/", cookie)
    assert console == 200 and "restarting" in page
    chat_page, _ = _status(f"{base}/chat/", cookie)
    assert chat_page == 200

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
