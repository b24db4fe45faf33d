"""EnginePool routing against fake engines: heartbeats feed the load figures, so a request
waits for STATS only when a replica has gone quiet."""

import pytest

from inference_engine.protocol import RequestType
from serving.pool import STALLED_STEP_SECONDS, EnginePool, NoReadyReplica
from tests.inference_engine.test_client import FakeEngine

pytestmark = pytest.mark.timeout(60)


def _num_stats(engine: FakeEngine) -> int:
    return sum(kind == RequestType.STATS.value for _, kind, _ in engine.received)


@pytest.fixture
async def engines(tmp_path):
    pair = [FakeEngine(f"ipc://{tmp_path}/e{i}.sock") for i in range(2)]
    yield pair
    for engine in pair:
        engine.close()


async def test_routing_reads_the_heartbeat_stats_without_asking_again(engines, tmp_path):
    pool = EnginePool()
    endpoints = [f"ipc://{tmp_path}/e{i}.sock" for i in range(2)]
    assert (await pool.route(endpoints, None))[0] in endpoints  # connects both clients
    asked = [_num_stats(engine) for engine in engines]
    for _ in range(20):
        await pool.route(endpoints, None)
    # at most a heartbeat each went out meanwhile; no STATS per request
    assert [_num_stats(engine) - n for engine, n in zip(engines, asked, strict=True)] <= [1, 1]
    pool.close()


async def test_the_least_loaded_replica_wins(engines, tmp_path):
    pool = EnginePool()
    endpoints = [f"ipc://{tmp_path}/e{i}.sock" for i in range(2)]
    await pool.route(endpoints, None)
    with pool.track(endpoints[0]), pool.track(endpoints[0]):
        assert (await pool.route(endpoints, None))[0] == endpoints[1]
    pool.close()


async def test_a_replica_whose_step_stalls_gets_nothing_new_while_another_is_ready(
    engines, tmp_path
):
    """A stalled step (a kernel that does not return) ends its engine only at
    ``--step-timeout``; meanwhile its I/O thread still says ready, and new requests sent there
    waited behind it for minutes."""
    pool = EnginePool()
    endpoints = [f"ipc://{tmp_path}/e{i}.sock" for i in range(2)]
    engines[0].step_seconds = STALLED_STEP_SECONDS + 1
    await pool.route(endpoints, None)
    with pool.track(endpoints[1]), pool.track(endpoints[1]):  # the other is busier
        assert (await pool.route(endpoints, None))[0] == endpoints[1]
        engines[1].step_seconds = STALLED_STEP_SECONDS + 5
        for endpoint in endpoints:
            await pool.stats(endpoint)  # the next heartbeat's
        # every replica stalled: the least loaded, as before
        assert (await pool.route(endpoints, None))[0] == endpoints[0]
    pool.close()


async def test_a_silent_replica_is_not_asked_again_at_once(tmp_path):
    pool = EnginePool()
    endpoints = [f"ipc://{tmp_path}/none{i}.sock" for i in range(2)]
    with pytest.raises(NoReadyReplica):
        await pool.route(endpoints, None)
    # the next request is refused from what the pool learnt, without asking again
    clients = [pool.client(endpoint) for endpoint in endpoints]
    stats_calls = []
    for client in clients:
        client.stats = lambda timeout=None: stats_calls.append(timeout)
    with pytest.raises(NoReadyReplica):
        await pool.route(endpoints, None)
    assert stats_calls == []
    pool.close()
