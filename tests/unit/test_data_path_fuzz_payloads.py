"""Fuzzing the data path's parsers, part 3: what the records carry (tensors, fragments, a stage's edges).

Issue "One data plane", item 2 (part 1, ``test_data_path_fuzz.py``, has the helpers). Whatever a peer
sends, the outcome is a valid result or the parser's documented error, never another exception:

* tensors (``nebula_common/codec``): ``decode_tensor`` of every built-in wire codec, nested specs included,
  with the payload changed past the CRC (a consistent but buggy peer) and in the receive buffer the edge
  hands over (a ``bytearray``, adopted) -> CodecError (WireFormatError); ``TensorStreamDecoder`` with its
  stream options (ef, delta, start) and edited headers -> CodecError; exact integer tensors ->
  WireFormatError; a header claiming a huge tensor is refused before anything is sized from it;
* fragments of the paced link (``services/switch/pacing.py``: ``Reassembler``) -> PacingError;
* the stage proxy's look at what a stage sends (``services/trainer/stage_proxy.py``: ``_is_close``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from nebula_common.codec import CodecError, TensorStreamDecoder, TensorStreamEncoder, decode_tensor, get_codec
from nebula_common.codec import registry as codec_registry
from nebula_common.codec.base import numel
from nebula_common.codec.registry import SpecNode, parse_spec
from nebula_common.codec.wire import (
    CHECKSUM_VERSION,
    WireFormatError,
    decode_integer_tensor,
    encode_integer_tensor,
    encode_tensor,
    header_checksum,
)
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from nebula_common.rpc.framing import encode_chunk
from services.switch.link_handshake import parse_link_message
from services.switch.pacing import MAX_PARTIAL_BYTES, Fragment, PacingError, Reassembler
from services.trainer.stage_proxy import _is_close
from tests.unit.test_data_path_fuzz import MUTATIONS, fuzz, mutated, peak_while

WIRE_SPECS = [
    *("none", "fp16", "bf16", "int8", "int8(scale=row)", "int8(block=5)", "int8(rounding=stochastic)"),
    *("int4", "int4(block=3)", "topk(0.3)", "topk(0.02)", "svd(0.5)", "lowrank(2)", "powersgd(2)"),
    *("zstd", "zstd(int8)", "fp16(svd(0.5))", "bf16(topk(0.2))", "int8(lowrank(2))", "int4(powersgd(1))"),
    "zstd(fp16(topk(0.2)))",
]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _names(node: SpecNode) -> set[str]:
    return {node.name}.union(*(_names(arg) for arg in node.args if isinstance(arg, SpecNode)))


def test_every_built_in_wire_codec_is_fuzzed() -> None:
    """A codec added to the library is added here too: its decoder faces peers' bytes (told apart by the
    factory's module: the plug-ins other tests register are not the library's)."""
    built_in = {
        name
        for name, factory in codec_registry._registry.items()
        if factory.__module__.startswith("nebula_common.codec.")
        and factory.__module__ != "nebula_common.codec.stream_options"
    }
    assert built_in <= set().union(*(_names(parse_spec(spec)) for spec in WIRE_SPECS))


def _copy(header: tensor_pb2.TensorHeader) -> tensor_pb2.TensorHeader:
    copy = tensor_pb2.TensorHeader()
    copy.CopyFrom(header)
    return copy


@fuzz(300)
@given(
    spec=st.sampled_from(WIRE_SPECS),
    shape=st.lists(st.integers(0, 6), max_size=3),
    dtype=st.sampled_from(DTYPES),
    mutations=st.one_of(st.just([]), MUTATIONS),
    adopt=st.booleans(),
)
def test_every_codec_decodes_what_it_encoded_and_a_changed_payload_is_refused_or_well_formed(
    spec: str, shape: list[int], dtype: torch.dtype, mutations: list, adopt: bool
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)), dtype=torch.float64).to(dtype)
    encoded = encode_tensor(x, spec)
    sent = bytes(encoded.payload)
    payload = mutated(sent, mutations)
    header = _copy(encoded.header)
    header.payload_size = len(payload)
    header.checksum = header_checksum(header, payload)  # past the CRC: the codec's own checks must hold
    try:
        y = decode_tensor(header, bytearray(payload) if adopt else payload)  # the edge adopts a bytearray
    except CodecError:
        assert payload != sent, f"{spec} refused its own payload"
        event("changed: refused")
        return
    assert tuple(y.shape) == tuple(shape) and y.dtype == dtype
    event("round trip" if payload == sent else "changed: decoded, well formed")
    if payload == sent:
        assert torch.equal(y, get_codec(spec).decode(sent, tuple(shape), dtype))
        assert spec != "none" or torch.equal(y, x)


EDITS = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("delta"), st.booleans()),
    st.tuples(st.just("delta_base_checksum"), st.integers(0, (1 << 32) - 1)),
    st.tuples(
        st.just("codec"), st.sampled_from(["none", "fp16", "int8", "ef(int8)", "auto", "zstd(", "x" * 300])
    ),
    st.tuples(st.just("shape"), st.lists(st.integers(-1, 6), max_size=3)),
    st.tuples(st.just("dtype"), st.sampled_from(["float16", "float32", "int64", "", "\u00e9"])),
    st.tuples(st.just("payload_size"), st.integers(0, (1 << 64) - 1)),
    st.tuples(st.just("raw_size"), st.integers(0, (1 << 64) - 1)),
    st.tuples(st.just("checksum_version"), st.integers(0, 3)),
)


def _edited(
    header: tensor_pb2.TensorHeader, payload: bytes, edits: list, mutations: list, fix_crc: bool
) -> tuple[tensor_pb2.TensorHeader, bytes]:
    header = _copy(header)
    for name, value in edits:
        if name == "shape":
            header.shape[:] = value
        else:
            setattr(header, name, value)
    payload = mutated(payload, mutations) if mutations else payload
    if fix_crc:
        header.checksum = header_checksum(header, payload)
    return header, payload


STREAM_SPECS = [
    "none",
    "ef(int8)",
    "delta(none)",
    "delta(fp16(topk(0.5)),cache=2)",
    "start(int8(scale=row),1,fp16)",
]


@fuzz(120)
@given(
    spec=st.sampled_from([*STREAM_SPECS, "ef(zstd(int8))"]),
    size=st.tuples(st.integers(1, 4), st.integers(1, 5)),
    steps=st.integers(1, 3),
    edits=st.lists(EDITS, max_size=2),
    mutations=st.one_of(st.just([]), MUTATIONS),
    fix_crc=st.booleans(),
)
def test_a_stream_decoder_reads_its_encoders_frames_and_a_changed_one_is_refused_or_well_formed(
    spec: str, size: tuple[int, int], steps: int, edits: list, mutations: list, fix_crc: bool
) -> None:
    encoder, decoder = TensorStreamEncoder(spec), TensorStreamDecoder(spec)
    ids, generator = list(range(size[0])), torch.Generator().manual_seed(sum(size))
    for step in range(steps):
        x = torch.randn(size, generator=generator)
        encoded = encoder.encode(x, step=step, sample_ids=ids)
        changed = step == steps - 1 and bool(edits or mutations)
        header, payload = encoded.header, bytes(encoded.payload)
        if changed:  # the last frame, edited and/or changed (the CRC fixed or not)
            header, payload = _edited(header, payload, edits, mutations, fix_crc)
        try:
            y = decoder.decode(header, bytearray(payload), sample_ids=ids)
        except CodecError:
            assert changed, f"{spec} refused its encoder's frame of step {step}"
            return
        assert tuple(y.shape) == tuple(header.shape) and y.dtype == x.dtype
        if not changed and spec == "none":
            assert torch.equal(y, x)
        elif not changed and spec == "delta(none)":
            assert torch.allclose(y, x, atol=1e-5)  # x - base + base, in float32


@fuzz(150)
@given(
    dtype=st.sampled_from([torch.int64, torch.int32]),
    values=st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=12),
    edits=st.lists(EDITS, max_size=2),
    mutations=st.one_of(st.just([]), MUTATIONS),
    fix_crc=st.booleans(),
)
def test_integer_tensors_travel_exactly_or_are_refused(
    dtype: torch.dtype, values: list[int], edits: list, mutations: list, fix_crc: bool
) -> None:
    x = torch.tensor(values, dtype=dtype)
    encoded = encode_integer_tensor(x, step=3)
    header, payload = _edited(encoded.header, bytes(encoded.payload), edits, mutations, fix_crc)
    try:
        y = decode_integer_tensor(header, bytearray(payload))
    except WireFormatError:
        assert edits or mutations
        return
    assert tuple(y.shape) == tuple(header.shape) and y.dtype in (torch.int64, torch.int32)
    if not (edits or mutations):
        assert torch.equal(y, x)


@pytest.mark.parametrize(
    ("shape", "codec"),
    [([1 << 33], "none"), ([1 << 20, 1 << 20], "fp16"), ([1 << 31, 2], "int8"), ([1 << 31], "zstd(int8)")],
)
def test_a_header_claiming_a_huge_tensor_is_refused_before_anything_is_sized_from_it(
    shape: list[int], codec: str
) -> None:
    payload = bytes(64)
    header = tensor_pb2.TensorHeader(
        dtype="float32",
        shape=shape,
        codec=codec,
        payload_size=len(payload),
        raw_size=numel(shape) * 4,
        checksum_version=CHECKSUM_VERSION,
    )
    header.checksum = header_checksum(header, payload)

    def refuse() -> None:
        with pytest.raises(WireFormatError, match=r"^(shape|payload_size|payload):"):
            decode_tensor(header, payload)

    assert peak_while(refuse) < 1 << 20


# ----- fragments of the paced link --------------------------------------------------------------
FRAGMENTS = st.builds(
    Fragment,
    stream=st.integers(0, 3),
    offset=st.one_of(st.integers(0, 40), st.integers(0, (1 << 64) - 1)),
    data=st.binary(max_size=16).map(memoryview),
    last=st.booleans(),
    whole=st.none(),
)


@fuzz(200)
@given(fragments=st.lists(FRAGMENTS, max_size=12))
def test_fragments_join_or_are_a_pacing_error(fragments: list[Fragment]) -> None:
    reassembler = Reassembler()
    for fragment in fragments:
        received = parse_link_message(fragment.encode()).fragment  # off the wire, as the link reads it
        try:
            whole = reassembler.add(received)
        except PacingError:
            continue
        assert whole is None or isinstance(whole, bytes)
        assert 0 <= reassembler.held <= MAX_PARTIAL_BYTES


@fuzz(100)
@given(
    items=st.lists(st.tuples(st.binary(max_size=64), st.lists(st.integers(1, 16), max_size=4)), max_size=5)
)
def test_items_cut_into_fragments_join_back_whole(items: list[tuple[bytes, list[int]]]) -> None:
    """Each item on a stream of its own, cut where ``cuts`` say; the streams' fragments interleaved."""
    per_item: list[list[Fragment]] = []
    for stream, (item, cuts) in enumerate(items):
        starts = sorted({0, *(cut for cut in itertools.accumulate(cuts) if cut < len(item))})
        ends = [*starts[1:], len(item)]
        per_item.append(
            [
                Fragment(stream, a, memoryview(item[a:b]), b == len(item), None)
                for a, b in zip(starts, ends, strict=True)
            ]
        )
    reassembler, joined = Reassembler(), {}
    for turn in range(max((len(f) for f in per_item), default=0)):
        for stream, fragments in enumerate(per_item):
            if turn < len(fragments):
                whole = reassembler.add(parse_link_message(fragments[turn].encode()).fragment)
                if whole is not None:
                    joined[stream] = whole
    assert joined == {stream: item for stream, (item, _) in enumerate(items)} and reassembler.held == 0


# ----- what a stage sends through its proxy ----------------------------------------------------------
CLOSES = st.builds(
    lambda reason, error: relay_pb2.EdgeMessage(
        close=relay_pb2.EdgeClose(reason=reason, error=error)
    ).SerializeToString(),
    st.text(max_size=12),
    st.booleans(),
)


@fuzz(200)
@given(raw=st.one_of(st.binary(max_size=64), CLOSES, st.tuples(CLOSES, MUTATIONS).map(lambda m: mutated(*m))))
@example(raw=encode_chunk("j", "e", 0, 1, 0, b"\x12\x00", True)[0])  # a framed chunk is never parsed
def test_the_stage_proxy_tells_a_close_from_anything_else(raw: bytes) -> None:
    try:
        message = relay_pb2.EdgeMessage.FromString(raw)
    except Exception:  # protobuf's DecodeError: then it is no close
        message = relay_pb2.EdgeMessage()
    assert _is_close(raw) is (raw[:1] != b"\x4a" and message.WhichOneof("body") == "close")
