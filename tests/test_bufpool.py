"""Recycled transport buffers (`stages.bufpool`): a block is reused only once nothing
references it, including a CPU jax.Array that adopted it in `device_put`."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stages.bufpool import BufferPool, heap_block, shm_block, shm_supported

ALLOCATORS = [heap_block] + ([shm_block] if shm_supported() else [])


@pytest.mark.parametrize("allocate", ALLOCATORS, ids=lambda f: f.__name__)
def test_blocks_are_reused_only_when_unreferenced(allocate):
    pool = BufferPool(1 << 30, allocate)
    try:
        a, block_a = pool.take_block((256, 64), np.float32)
        assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
        view = a[10:20]                                   # a view keeps the block busy too
        del a
        b, block_b = pool.take_block((256, 64), np.float32)
        assert block_b is not block_a
        del view
        gc.collect()
        c, block_c = pool.take_block((64, 256), np.float32)   # same byte size: the freed block
        assert block_c is block_a and pool.reused == 1
        other, block_o = pool.take_block((3,), np.int8)          # another size: another block
        assert block_o not in (block_a, block_b)
        del b, c, other
    finally:
        pool.close()


def test_limit_stops_pooling():
    pool = BufferPool(1000)
    first = pool.take_block((100,), np.float64)              # 800 bytes: pooled
    assert first is not None
    assert pool.take_block((100,), np.float64) is None       # would pass the limit
    spare = pool.take((100,), np.float64)                    # take still gives (unpooled) memory
    assert spare.shape == (100,) and not np.shares_memory(spare, first[0])


def test_a_block_adopted_by_a_jax_array_stays_busy_until_the_array_dies():
    """Run in a fresh process: the CPU backend needs its device count before jax loads."""
    code = textwrap.dedent("""
        import gc, numpy as np, jax
        from stages.bufpool import BufferPool, heap_block, shm_block, shm_supported
        for allocate in [heap_block] + ([shm_block] if shm_supported() else []):
            pool = BufferPool(1 << 30, allocate)
            a, block = pool.take_block((512, 512), np.float32)
            a[:] = 7
            x = jax.device_put(a, jax.devices()[1])
            jax.block_until_ready(x)
            adopted = x.unsafe_buffer_pointer() == a.ctypes.data
            del a
            gc.collect()
            b, other = pool.take_block((512, 512), np.float32)
            assert other is not block, "reused a block a live jax.Array holds"
            b[:] = 1
            assert float(x.sum()) == 7 * 512 * 512
            del x, b
            gc.collect()
            _, again = pool.take_block((512, 512), np.float32)
            assert again in (block, other)
            print(allocate.__name__, "adopted" if adopted else "copied")
            pool.close()
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    # zero-copy adoption is what makes the pool's bookkeeping matter (and the transport fast)
    assert "heap_block adopted" in out.stdout, out.stdout
