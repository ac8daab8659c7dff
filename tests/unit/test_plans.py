"""The runtime's fast path: cutting a serialized request without parsing it, and plans."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.rpc.tensors import infer_request
from protos.inference import grpc_service_pb2 as pb
from runtime.rpc import convert
from runtime.rpc.plans import MAX_HEADER_BYTES, Plan, Plans, split_request

INPUTS = {
    "x": np.arange(8, dtype=np.float32).reshape(2, 4),
    "k": np.array([5, 7], dtype=np.int64),
}


def request_bytes(**fields: object) -> bytes:
    request = infer_request("probe", INPUTS, outputs=["y"], request_id="r-1")
    for key, value in fields.items():
        setattr(request, key, value)
    return request.SerializeToString()


def test_split_gives_the_header_and_every_raw_entry() -> None:
    raw = request_bytes()
    split = split_request(raw)
    assert split is not None
    header, entries = split
    parsed = pb.ModelInferRequest.FromString(header)
    assert parsed.model_name == "probe" and parsed.id == "r-1"
    assert [i.name for i in parsed.inputs] == ["x", "k"]
    assert [o.name for o in parsed.outputs] == ["y"]
    assert not parsed.raw_input_contents
    assert [bytes(e) for e in entries] == [a.tobytes() for a in INPUTS.values()]


def test_an_entry_over_127_bytes_has_a_multibyte_length() -> None:
    big = {"x": np.arange(1000, dtype=np.float32)}
    split = split_request(infer_request("probe", big).SerializeToString())
    assert split is not None
    assert bytes(split[1][0]) == big["x"].tobytes()


LAYOUTS = {
    "no raw entries": pb.ModelInferRequest(model_name="probe").SerializeToString(),
    "a field after the raw entries": request_bytes()
    + pb.ModelInferRequest(id="late").SerializeToString(),
    "a varint field": request_bytes() + b"\x08\x01",
    "truncated": request_bytes()[:-3],
    "a length past the end": b"\x0a\x7fprobe",
    "a varint past 64 bits": b"\x0a" + b"\xff" * 11,
    "a tag cut short": b"\x0a\x05probe\x80",
    "a header over the limit": request_bytes(id="i" * MAX_HEADER_BYTES),
}


@pytest.mark.parametrize("raw", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_an_unusual_layout_takes_the_full_path(raw: bytes) -> None:
    assert split_request(raw) is None


def plan_for(raw: bytes) -> tuple[Plan, list[np.ndarray]]:
    request = pb.ModelInferRequest.FromString(raw)
    feeds = {name: np.array(a) for name, a in INPUTS.items()}
    arrays = [INPUTS["x"] * 2]
    return Plan(request, feeds, ["y"], arrays), arrays


def test_a_plan_answers_with_the_full_paths_bytes() -> None:
    raw = request_bytes()
    plan, arrays = plan_for(raw)
    full = convert.infer_response("probe", "r-1", ["y"], arrays).SerializeToString()
    assert plan.response(arrays) == full
    longer = [np.arange(400, dtype=np.float32).reshape(100, 4)]  # another output shape
    full = convert.infer_response("probe", "r-1", ["y"], longer).SerializeToString()
    assert plan.response(longer) == full


def test_a_plan_makes_feeds_only_from_entries_that_fit() -> None:
    raw = request_bytes()
    plan, _ = plan_for(raw)
    split = split_request(raw)
    assert split is not None
    feeds = plan.feeds(split[1])
    assert feeds is not None
    for name, array in INPUTS.items():
        np.testing.assert_array_equal(feeds[name], array)
        assert feeds[name].flags.aligned
    assert plan.feeds(split[1][:1]) is None
    assert plan.feeds([split[1][0], split[1][1][:-1]]) is None


def test_an_entry_at_an_unaligned_offset_is_copied_aligned() -> None:
    raw = request_bytes(model_name="probe" + "p")  # shifts every entry by one byte
    plan, _ = plan_for(raw)
    split = split_request(raw)
    assert split is not None
    assert any(memoryview_address(e) % 4 for e in split[1])
    feeds = plan.feeds(split[1])
    assert feeds is not None
    for name, array in INPUTS.items():
        np.testing.assert_array_equal(feeds[name], array)
        assert feeds[name].flags.aligned


def memoryview_address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_plans_keep_at_most_their_capacity() -> None:
    plans = Plans(capacity=2)
    plan, _ = plan_for(request_bytes())
    for header in (b"a", b"b", b"c"):
        assert plans.full is (header == b"c")
        plans.add(header, plan)
    assert plans.get(b"a") is plan and plans.get(b"b") is plan
    assert plans.get(b"c") is None
