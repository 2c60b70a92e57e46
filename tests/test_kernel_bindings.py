"""The ctypes declarations of pagellm's C kernels are checked against the C definitions
when the library loads: a parameter added on one side only fails loudly."""

from __future__ import annotations

import ctypes

import pytest

from pagellm.kernels import _SOURCES, c_signatures, check_bindings, load_kernels

SOURCE = """
/* pg_commented_out(int a) { */
static int pg_helper(int a, int b) { return a + b; }
int64_t pg_sum(const float *x,
               int64_t n, // elements
               float *out) {
    return 0;
}
void pg_nothing(void) {}
const float *pg_row(const float *x, int64_t i) { return x + i; }
"""


def test_c_signatures_reads_exported_definitions() -> None:
    assert c_signatures(SOURCE) == {"pg_sum": ("int64_t", 3), "pg_nothing": ("void", 0),
                                    "pg_row": ("pointer", 2)}


def test_a_mismatched_declaration_is_named() -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    signatures = c_signatures(SOURCE)
    check_bindings({"pg_sum": ([ptr, i64, ptr], i64), "pg_nothing": ([], None), "pg_row": ([ptr, i64], ptr)},
                   signatures)
    with pytest.raises(RuntimeError, match=r"sources: pg_nothing: restype c_int, the C function returns "
                                           r"void; pg_sum: 2 argtypes, the C function takes 3$"):
        check_bindings({"pg_sum": ([ptr, i64], i64), "pg_nothing": ([], ctypes.c_int)}, signatures)
    with pytest.raises(RuntimeError, match=r"pg_gone: declared in Python, not defined in the C sources$"):
        check_bindings({"pg_gone": ([], None)}, signatures)


def test_the_library_binds_what_its_sources_define() -> None:
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler: nothing is bound")
    signatures = c_signatures("".join(open(p).read() for p in _SOURCES))
    bound = {n for n in vars(lib) if n.startswith("pg_")}  # what load_kernels declared and checked
    assert {"pg_gemm", "pg_paged_decode", "pg_decode_layers", "pg_sample_rows", "pg_q8_isa"} <= bound
    assert bound <= signatures.keys() and len(bound) >= 28
