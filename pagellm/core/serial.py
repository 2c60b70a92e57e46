"""msgpack encoding of the wire structs (msgspec); no pickle on the wire."""

from __future__ import annotations

from typing import Any

import msgspec

from pagellm.core.protocol import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest

_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
ready_decoder = msgspec.msgpack.Decoder(EngineCoreReadyResponse)
abort_decoder = msgspec.msgpack.Decoder(list[str])
# UTILITY payload: (call_id, method_name, args)
utility_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[Any]])
# STOP payload: (reason, refused)
stop_decoder = msgspec.msgpack.Decoder(tuple[str, bool])
