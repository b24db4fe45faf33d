"""`make run`'s command end to end: a real Daphne serving the admin, the printed
credentials logging in, and SIGTERM stopping everything."""

import http.cookiejar
import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.config.live_platform import (
    children,
    read_until,
    run_platform,
    run_platform_on_tiny_model,
    stop,
    wait_for_http,
)


@pytest.fixture
def platform_process(tmp_path):
    process, base = run_platform_on_tiny_model(tmp_path)
    yield process, base
    stop(process)


def test_run_serves_the_admin_and_the_printed_credentials_log_in(platform_process):
    process, base = platform_process
    login = read_until(process, r"login: (\S+) / (\S+)", timeout=120)
    api_key = read_until(process, r"API key: (sk-\S+)", timeout=10).group(1)
    wait_for_http(f"{base}/admin/login/", timeout=60)

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{base}/admin/login/").read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    form = urllib.parse.urlencode(
        {
            "csrfmiddlewaretoken": token,
            "username": login.group(1),
            "password": login.group(2),
            "next": "/admin/",
        }
    ).encode()
    request = urllib.request.Request(
        f"{base}/admin/login/", data=form, headers={"Referer": f"{base}/admin/login/"}
    )
    admin_index = opener.open(request).read().decode()
    assert "Site administration" in admin_index
    assert "Tenants, plans, keys and usage" in admin_index
    assert opener.open(f"{base}/static/admin/css/base.css").status == 200

    # the engine it started answers through the API with the printed key
    wait_for_http(f"{base}/health/ready", timeout=120, ok_only=True)
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    completion = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert completion["usage"]["completion_tokens"] == 3

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/admin/login/", timeout=2)
    rest = process.stdout.read()
    assert "engine stopped" in rest  # the engine shut down cleanly too
    assert "celery@" in rest and " ready." in rest  # and the Celery worker had started
    assert "batches@" in rest  # and the batch runs' worker


def _run_web_only(tmp_path, **env: str | None) -> tuple[subprocess.Popen, str]:
    return run_platform(tmp_path, "--no-demo", RUN_ENGINE="0", RUN_WORKER="0", **env)


def _refusals_counted(base: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    counted = re.findall(
        r'^llm_gateway_requests_total\{[^}]*status="401"[^}]*\} (\S+)$', text, re.M
    )
    return sum(map(float, counted))


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="several web processes need Redis")
def test_several_web_processes_share_one_port(tmp_path):
    process, base = _run_web_only(tmp_path, WEB_PROCESSES="3")
    try:
        wait_for_http(f"{base}/health/live", timeout=60, ok_only=True)
        daphnes = [c for c in children(process.pid).values() if "config.webserver --fd" in c]
        assert len(daphnes) == 3
        for _ in range(20):  # every connection is answered, whichever process takes it
            assert urllib.request.urlopen(f"{base}/health/live", timeout=5).status == 200
        # every process counts where /metrics reads, whichever of them a scrape reaches: a
        # scrape showed one process's share, another the next time
        for _ in range(30):
            refused = urllib.request.Request(f"{base}/v1/completions", b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError) as unauthorized:
                urllib.request.urlopen(refused, timeout=5)
            assert unauthorized.value.code == 401
        scrapes = {_refusals_counted(base) for _ in range(20)}
        assert scrapes == {30.0}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_several_web_processes_without_redis_are_refused(tmp_path):
    process, _ = _run_web_only(tmp_path, WEB_PROCESSES="2", REDIS_URL=None)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "WEB_PROCESSES > 1 needs REDIS_URL" in output
