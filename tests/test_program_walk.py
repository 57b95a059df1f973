"""Layout propagation through jaxprs (einshard.analysis.program), independent of the cost model."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from einshard._src.analysis.program.rules_structural import reshape_dims as _reshape_dims


@pytest.mark.parametrize(
    "src, dims, out, expected",
    [
        # merging heads: (b, h, k) -> (b, h*k): h sharded stays on the merged axis (it is major)
        ((4, 8, 16), ((), ("model",), ()), (4, 128), [(), ("model",)]),
        # splitting: (b, h*k) -> (b, h, k): the major piece keeps the sharding
        ((4, 128), ((), ("model",)), (4, 8, 16), [(), ("model",), ()]),
        # batch flattening: (b, s, d) -> (b*s, d) with b sharded
        ((8, 16, 32), (("data",), (), ()), (128, 32), [("data",), ()]),
        # a sharded minor axis cannot survive a merge
        ((8, 16, 32), ((), ("data",), ()), (128, 32), None),
        # unit axes are transparent
        ((1, 8, 4), ((), ("x",), ()), (8, 4), [("x",), ()]),
        ((8, 4), (("x",), ()), (8, 1, 4), [("x",), (), ()]),
    ],
)
def test_reshape_keeps_block_sharding_on_the_major_axis(src, dims, out, expected):
    assert _reshape_dims(src, dims, out) == expected


@given(
    b=st.sampled_from([1, 2, 4, 8]),
    s=st.sampled_from([1, 2, 3, 4]),
    d=st.sampled_from([2, 4, 6]),
)
def test_reshape_rule_agrees_with_block_layout(b, s, d):
    """A merge of (b, s, d) -> (b*s, d) with b split keeps each device's rows contiguous, exactly as the rule says."""
    import numpy as np

    x = np.arange(b * s * d).reshape(b, s, d)
    n = 2 if b % 2 == 0 else 1
    dims = (("x",) if n == 2 else (), (), ())
    got = _reshape_dims((b, s, d), dims, (b * s, d))
    assert got is not None
    # Device i's block of the source, reshaped, is device i's block of the result.
    blocks_src = np.split(x, n, axis=0)
    blocks_out = np.split(x.reshape(b * s, d), n, axis=0)
    for a, c in zip(blocks_src, blocks_out):
        assert (a.reshape(-1, d) == c).all()
    assert got[0] == dims[0]
