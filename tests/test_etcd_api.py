"""eft's own etcd messages: made from etcd_api.proto, by a protoc whose code runs on every protobuf
eft allows (4.21 on), and read by a real etcd as its own. .ci/lane_constraints runs this file
and the store's tests on protobuf 4.25, 5.29 and 6.x with a grpcio of their time."""

import hashlib
import re
import uuid
from pathlib import Path

import google.protobuf

from elasticft.store import etcd_api_pb2 as api
from elasticft.store import etcd_rpc
from elasticft.store.etcd_requests import put_request, range_request

STORE = Path(api.__file__).parent  # the installed package: the wheel carries the .proto


def test_the_generated_messages_are_made_from_the_proto_as_it_is():
    # a field added to the .proto without running tools/gen_etcd_api.sh would never reach the wire
    proto = (STORE / "etcd_api.proto").read_bytes()
    stamped = re.search(r"etcd_api\.proto sha256: ([0-9a-f]{64})", (STORE / "etcd_api_pb2.py").read_text())
    assert stamped, "etcd_api_pb2.py lacks its stamp: regenerate it with tools/gen_etcd_api.sh"
    assert stamped.group(1) == hashlib.sha256(proto).hexdigest(), \
        "etcd_api.proto changed since etcd_api_pb2.py was generated: run tools/gen_etcd_api.sh"


def test_the_generated_messages_ask_for_no_protobuf_version():
    # The code of protoc 26 and later refuses, at import, any protobuf older than itself: a container
    # pinning protobuf 4.x could not import eft (docs/install.md). Regenerating with such a protoc fails here.
    source = (STORE / "etcd_api_pb2.py").read_text()
    assert "runtime_version" not in source and "ValidateProtobufRuntimeVersion" not in source
    assert "from google.protobuf.internal import builder" in source


def test_a_message_survives_the_wire_on_this_protobuf():
    request = range_request("/eft/a", "/eft/b", limit=3, sort_order="descend", sort_target="mod", count_only=True)
    again = api.RangeRequest.FromString(request.SerializeToString())
    assert (again.key, again.range_end, again.limit, again.count_only) == (b"/eft/a", b"/eft/b", 3, True)
    assert again.sort_order == api.RangeRequest.DESCEND, google.protobuf.__version__


def test_etcd_reads_eft_s_messages_as_its_own(etcd):
    # field numbers as etcd's: a put with a lease and a range with a count travel as etcd reads them
    key = f"/eft-test/api/{uuid.uuid4().hex}"
    members = etcd._rpc
    granted = members.call(etcd_rpc.LEASE_GRANT, api.LeaseGrantRequest(TTL=30))
    members.call(etcd_rpc.PUT, put_request(key, b"v", granted.ID))
    got = members.call(etcd_rpc.RANGE, range_request(key))
    assert [(kv.key, kv.value, kv.lease) for kv in got.kvs] == [(key.encode(), b"v", granted.ID)]
    counted = members.call(etcd_rpc.RANGE, range_request(key, key + "\0", count_only=True))
    assert counted.count == 1 and not counted.kvs
    members.call(etcd_rpc.LEASE_REVOKE, api.LeaseRevokeRequest(ID=granted.ID))
    assert not members.call(etcd_rpc.RANGE, range_request(key)).kvs, "the lease's key outlived the lease"
