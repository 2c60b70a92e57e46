"""The ctypes mirrors of the one-region stack's C structs (models/fused_decode.py) are
checked against the compiler's layout of decode_step.c (`pg_struct_layout`): today's
match, and a mirror that lost a field, gained one or reordered two fails with a message
naming the struct and the field, and so does one whose field has the wrong type."""

from __future__ import annotations

import ctypes

import pytest

from pagellm.kernels import load_kernels
from pagellm.model_executor.models import fused_decode
from pagellm.model_executor.models.fused_decode import STRUCTS, check_struct_layouts

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = load_kernels()
    if lib is None:
        pytest.skip("the C kernels did not build (no C compiler)")
    return lib


def _with_group(mirror: type) -> tuple[tuple[str, type], ...]:
    """STRUCTS with pg_weight_group's mirror replaced."""
    return (("pg_weight_group", mirror), *STRUCTS[1:])


def test_the_mirrors_match_the_c_structs(lib: ctypes.CDLL) -> None:
    check_struct_layouts(lib)
    assert lib.pg_struct_layout(5, None, 0, None) == -1
    out, names = (ctypes.c_int64 * 64)(), ctypes.c_char_p()
    assert lib.pg_struct_layout(4, out, 64, ctypes.byref(names)) == 1 + len(fused_decode._Step._fields_)
    assert out[0] == ctypes.sizeof(fused_decode._Step)
    assert names.value.decode().split()[:3] == ["T", "hidden", "H"]


def test_a_stale_mirror_is_named(lib: ctypes.CDLL) -> None:
    class Missing(ctypes.Structure):  # k_pad forgotten
        _fields_ = [("type", _i64), ("row_bytes", _i64), ("row_start", _i64), ("rows", _i64),
                    ("data", _ptr), ("block", _i64)]

    with pytest.raises(RuntimeError, match=r"^Missing in models/fused_decode.py does not match pg_weight_group "
                                           r"in kernels/decode_step.c: field 6 is 'k_pad' in C, 'nothing' in Python$"):
        check_struct_layouts(lib, _with_group(Missing))

    class Swapped(ctypes.Structure):  # row_bytes before type
        _fields_ = [("row_bytes", _i64), ("type", _i64), ("row_start", _i64), ("rows", _i64),
                    ("data", _ptr), ("block", _i64), ("k_pad", _i64)]

    with pytest.raises(RuntimeError, match=r"^Swapped in .*: field 0 is 'type' in C, 'row_bytes' in Python$"):
        check_struct_layouts(lib, _with_group(Swapped))

    class Padded(ctypes.Structure):  # one field too many at the end
        _fields_ = [("type", _i64), ("row_bytes", _i64), ("row_start", _i64), ("rows", _i64),
                    ("data", _ptr), ("block", _i64), ("k_pad", _i64), ("extra", _i64)]

    with pytest.raises(RuntimeError, match=r"^Padded in .*: field 7 is 'nothing' in C, 'extra' in Python$"):
        check_struct_layouts(lib, _with_group(Padded))

    class Narrow(ctypes.Structure):  # a float where C has a pointer: every later field moves
        _fields_ = [("type", _i64), ("row_bytes", _i64), ("row_start", _i64), ("rows", _i64),
                    ("data", ctypes.c_float), ("block", ctypes.c_float), ("k_pad", _i64)]

    with pytest.raises(RuntimeError, match=r"^Narrow in .*: field 'block' at offset 40 in C, 36 in Python$"):
        check_struct_layouts(lib, _with_group(Narrow))
