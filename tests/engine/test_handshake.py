"""The head's rules for a core's handshake (multi-node data parallelism): rank in range,
no second process for a rank, a rank the head runs only from the head's own process, and
a config that agrees field by field; the data-parallel flags' own checks; and a start
that waits for ranks that never come names them."""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest

import pagellm
from pagellm.core.protocol import EngineCoreReadyResponse, engine_identity
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.exceptions import EngineStartupError
from pagellm.engine.handshake import HandshakeCheck, engine_addresses, fingerprint_diff
from tests.utils import import_benchmark

_free_port_pair = import_benchmark("compare").free_port_pair

HEAD = {"model": "LlamaForCausalLM abc 100 bytes", "max_model_len": "1024", "dtype": "float32"}


def _identity(rank: int, pid: int) -> bytes:
    return engine_identity(rank, pid.to_bytes(4, "little") + b"\x01\x02")


def _ready(rank: int, **changes: str) -> EngineCoreReadyResponse:
    return EngineCoreReadyResponse(num_gpu_blocks=10, rank=rank, fingerprint={**HEAD, **changes})


def test_handshake_rules() -> None:
    check = HandshakeCheck(num_ranks=3, fingerprint=HEAD, local_pids={0: 4242})
    assert check.refusal(_identity(0, 4242), _ready(0), taken=False) is None  # the head's own rank 0
    assert check.refusal(_identity(2, 77), _ready(2), taken=False) is None  # a remote rank
    assert check.refusal(_identity(0, 77), _ready(0), taken=False) == (
        "rank 0 runs on the head node (its --data-parallel-size-local covers it).")
    assert check.refusal(_identity(3, 77), _ready(3), taken=False) == (
        "rank 3 is out of range: data_parallel_size is 3 (ranks 0..2).")
    assert check.refusal(_identity(2, 78), _ready(2), taken=True) == (
        "rank 2 is already served by another engine core (overlapping --data-parallel-start-rank?).")
    assert check.refusal(_identity(1, 77), _ready(2), taken=False) == (
        "its identity says rank 1 and its handshake rank 2.")
    assert check.refusal(_identity(1, 77), _ready(1, max_model_len="512", dtype="bfloat16"), taken=False) == (
        "its config differs from the head's: dtype (head: float32, rank 1: bfloat16); "
        "max_model_len (head: 1024, rank 1: 512).")


def test_fingerprint_names_a_field_only_one_side_has() -> None:
    assert fingerprint_diff({"a": "1"}, {"a": "1", "b": "2"}, rank=4) == ["b (head: None, rank 4: 2)"]


def test_the_fingerprint_covers_what_must_agree_and_not_the_layout(tiny_model, tmp_path) -> None:
    model = tiny_model("llama")
    copy = shutil.copytree(model, tmp_path / "elsewhere")  # another node keeps it at another path
    head = EngineArgs(model=model, max_model_len=256, data_parallel_size=2, data_parallel_size_local=1,
                      data_parallel_address="127.0.0.1").create_engine_config()
    node = EngineArgs(model=str(copy), max_model_len=256, data_parallel_size=2, data_parallel_start_rank=1,
                      data_parallel_address="127.0.0.1", max_num_seqs=8).create_engine_config()
    assert head.fingerprint() == node.fingerprint()  # path, scheduling limits and rank layout may differ
    assert head.fingerprint()["pagellm"] == pagellm.__version__
    other = dataclasses.replace(node, cache_config=dataclasses.replace(node.cache_config, block_size=32))
    assert fingerprint_diff(head.fingerprint(), other.fingerprint(), 1) == ["block_size (head: 16, rank 1: 32)"]
    assert head.parallel_config.local_ranks == range(0, 1) and node.parallel_config.local_ranks == range(1, 2)
    assert engine_addresses(node.parallel_config, None) == ("tcp://127.0.0.1:29550", "tcp://127.0.0.1:29551")
    v6 = dataclasses.replace(node.parallel_config, data_parallel_address="::1", data_parallel_rpc_port=7000)
    assert engine_addresses(v6, None) == ("tcp://[::1]:7000", "tcp://[::1]:7001")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"data_parallel_size": 2, "data_parallel_size_local": 1},
     "Ranks on other nodes (data_parallel_size_local < data_parallel_size, or a data_parallel_start_rank) "
     "need data_parallel_address"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "data_parallel_size_local must be in [0, 2]"),
    ({"data_parallel_size": 2, "data_parallel_start_rank": 2}, "data_parallel_start_rank must be in [0, 2)"),
    ({"data_parallel_size": 2, "data_parallel_start_rank": 1, "data_parallel_size_local": 2},
     "data_parallel_size_local must be in [0, 1] (ranks 1..1 from data_parallel_start_rank 1), got 2."),
    ({"data_parallel_rpc_port": 65535}, "data_parallel_rpc_port must be in [1, 65534]"),
    ({"data_parallel_size": 2, "data_parallel_external_lb": True, "data_parallel_address": "10.0.0.1"},
     "data_parallel_external_lb runs one rank per server"),
    ({"data_parallel_size": 2, "data_parallel_backend": "rays"}, "data_parallel_backend must be one of mp, ray; got 'rays'."),
    ({"data_parallel_size": 2, "data_parallel_backend": "ray", "data_parallel_size_local": 1,
      "data_parallel_address": "10.0.0.1"},
     "data_parallel_backend='ray' places every rank on the Ray cluster: it does not combine with "
     "data_parallel_size_local / data_parallel_start_rank"),
    ({"data_parallel_size": 2, "data_parallel_backend": "ray", "data_parallel_external_lb": True},
     "data_parallel_backend='ray' serves every rank from one server"),
])
def test_bad_data_parallel_layouts_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kwargs).verify_args()


def test_the_cli_has_vllms_multi_node_flags() -> None:
    from pagellm.entrypoints.cli.main import build_parser

    args = build_parser("serve").parse_args([
        "serve", "m", "--headless", "-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2",
        "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345"])
    assert (args.headless, args.data_parallel_size, args.data_parallel_size_local, args.data_parallel_start_rank,
            args.data_parallel_address, args.data_parallel_rpc_port) == (True, 4, 2, 2, "10.0.0.1", 13345)
    assert args.data_parallel_backend == "mp"
    ray = build_parser("serve").parse_args(["serve", "m", "-dp", "2", "--data-parallel-backend", "ray"])
    assert EngineArgs.from_cli_args(ray).data_parallel_backend == "ray"


def test_the_ray_backend_without_ray_names_the_extra(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"data_parallel_backend='ray' needs Ray, which is not installed: "
                                         r"pip install 'pagellm\[ray\]'."):
        EngineArgs(data_parallel_size=2, data_parallel_backend="ray").verify_args()


def test_llm_refuses_the_ray_backend(tiny_model) -> None:
    from pagellm import LLM

    with pytest.raises(ValueError, match="engine cores as Ray actors"):
        LLM(model=tiny_model("llama"), max_model_len=256, data_parallel_backend="ray")




def test_a_start_names_the_ranks_that_never_connected(tiny_model, monkeypatch) -> None:
    """A head that runs no rank itself (--data-parallel-size-local 0) and no node
    connecting: the start fails after PAGELLM_ENGINE_READY_TIMEOUT_S, naming ranks and
    address."""
    from pagellm.engine.core_client import EngineCoreClient

    monkeypatch.setenv("PAGELLM_ENGINE_READY_TIMEOUT_S", "0.5")
    port = _free_port_pair()
    config = EngineArgs(model=tiny_model("llama"), max_model_len=256, data_parallel_size=2,
                        data_parallel_size_local=0, data_parallel_address="127.0.0.1",
                        data_parallel_rpc_port=port).create_engine_config()
    with pytest.raises(EngineStartupError) as e:
        EngineCoreClient.make_async_mp_client(config)
    assert str(e.value) == (f"Engine core(s) [0, 1] never connected to tcp://127.0.0.1:{port} within 0.5 s "
                            "(PAGELLM_ENGINE_READY_TIMEOUT_S).")


def test_a_stray_message_on_the_engine_socket_is_ignored_not_fatal() -> None:
    """The head's ROUTER listens on an open TCP port: what is not a handshake is logged
    and dropped; a real handshake after it reads as one."""
    import zmq

    from pagellm.core import serial
    from pagellm.core.protocol import HANDSHAKE_FAILED
    from pagellm.engine.handshake import read_handshake

    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://stray")
        dealer.setsockopt(zmq.IDENTITY, _identity(1, 99))
        dealer.connect("inproc://stray")
        for frames in ([b"junk"], [b"a", b"b", b"c"]):
            dealer.send_multipart(frames)
            assert router.poll(2000) and read_handshake(router) is None
        dealer.send_multipart([HANDSHAKE_FAILED, b"OSError: no memory"])
        assert router.poll(2000)
        failed = read_handshake(router)
        assert (failed.rank, failed.response, str(failed.startup_error())) == (
            1, None, "Engine core initialization failed: OSError: no memory")
        dealer.send(serial.encode(_ready(1)))
        assert router.poll(2000)
        hs = read_handshake(router)
        assert (hs.identity, hs.rank, hs.response) == (_identity(1, 99), 1, _ready(1))
    finally:
        dealer.close(linger=0)
        router.close(linger=0)


def test_stray_output_frames_are_dropped_not_fatal() -> None:
    """The head's output port is open to other nodes: a frame that is no message, or one
    from a rank this server does not serve, is logged and dropped; the loop goes on."""
    import zmq

    from pagellm.core import serial
    from pagellm.core.protocol import EngineCoreOutputs, engine_dead_frame
    from pagellm.engine.core_client import HangWatch, _decode_frame

    watch = HangWatch(0.0, [0, 1])
    assert _decode_frame(zmq.Frame(b"\xc1 not msgpack"), {}, watch) is None
    assert _decode_frame(zmq.Frame(serial.encode(EngineCoreOutputs(engine_index=7))), {}, watch) is None
    assert _decode_frame(zmq.Frame(engine_dead_frame(7, "gone")), {}, watch) is None
    served = _decode_frame(zmq.Frame(serial.encode(EngineCoreOutputs(engine_index=1))), {}, watch)
    assert isinstance(served, EngineCoreOutputs) and served.engine_index == 1


def test_llm_refuses_engine_cores_on_other_nodes(tiny_model) -> None:
    from pagellm import LLM

    with pytest.raises(ValueError, match=r"LLM runs its engine core on this machine; engine cores on other "
                                         r"nodes \(data_parallel_address\) are served by `pagellm serve`."):
        LLM(tiny_model("llama"), max_model_len=256, data_parallel_address="127.0.0.1")


def test_during_the_start_a_rank_whose_core_has_gone_is_free_again() -> None:
    """Rank 1 accepted, then its core gone (its node started another): the new core's
    READY is accepted in its place; while the first is still connected, a second core for
    the rank is refused as taken and told to stop."""
    import zmq

    from pagellm.core import serial
    from pagellm.engine.handshake import _take_handshake

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    check = HandshakeCheck(num_ranks=2, fingerprint=HEAD, local_pids={0: 4242})
    accepted: dict = {}
    dealers = []

    def handshake(pid: int) -> zmq.Socket:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, _identity(1, pid))
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(serial.encode(_ready(1)))
        assert router.poll(2000)
        _take_handshake(router, check, {}, accepted, {})
        dealers.append(dealer)
        return dealer

    try:
        first = handshake(11)
        assert accepted[1][0] == _identity(1, 11)
        second = handshake(12)  # the first still connected: taken
        assert accepted[1][0] == _identity(1, 11)
        assert second.poll(2000) and second.recv_multipart()[0] == b"\x04"  # STOP
        first.close(linger=0)
        deadline = time.monotonic() + 5
        while True:  # until the ROUTER has seen the connection close
            try:
                router.send_multipart([_identity(1, 11), b"\x01", serial.encode([])])
            except zmq.ZMQError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handshake(13)
        assert accepted[1][0] == _identity(1, 13)
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        router.close(linger=0)
