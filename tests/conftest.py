import uuid

import pytest

from elasticft.store import EmbeddedEtcd, RunKeys, StoreOptions, connect


@pytest.fixture(scope="session")
def etcd_server():
    """One real etcd for the whole session; tests isolate themselves by run id."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def etcd(etcd_server):
    client = connect(StoreOptions(etcd_server.endpoint))
    yield client
    client.close()


@pytest.fixture
def run_keys():
    """The etcd keys of this test's own run (a fresh run id)."""
    return RunKeys(uuid.uuid4().hex)

