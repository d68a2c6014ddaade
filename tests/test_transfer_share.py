"""benchmarks/transfer_share.py: the issue's Llama-8B transfer share, from the cost model (pure, fast)."""
from __future__ import annotations

import pytest

from benchmarks.transfer_share import LLAMA8B, MIB, SCENARIOS, run, topology, transfer_share


def test_the_example_is_the_issues():
    nbytes = LLAMA8B["tokens_per_microbatch"] * LLAMA8B["d_model"] * LLAMA8B["bytes_per_element"]
    assert nbytes == 128 * MIB


def test_socket_today_costs_a_large_share_and_xla_under_five_percent():
    res = run(ms=(8,))
    assert "not a measurement" in res["what"] and res["assumptions"]
    share = {k: v["by_microbatches"]["8"]["share"] for k, v in res["scenarios"].items()}
    assert share["socket-today-slow"] > share["socket-today"] > 0.3
    assert share["socket-today"] > share["socket-fixed"] > share["xla-ib"] > share["xla-nvlink"] > 0
    assert share["xla-ib"] < 0.05
    today = res["scenarios"]["socket-today"]["by_microbatches"]["8"]
    # the issue's 85-200 ms per edge, most of it 8 pageable H2D copies on the receiver's thread
    assert 0.085 < today["edge_delay_s"] < 0.2
    assert today["edge"]["recv_block_s"] > 0.6 * today["edge_delay_s"]


@pytest.mark.parametrize("m", [4, 16])
def test_more_microbatches_do_not_hide_a_blocking_transport(m):
    sock = transfer_share(topology(SCENARIOS["socket-today"]), 128 * MIB, 0.13, m)
    xla = transfer_share(topology(SCENARIOS["xla-ib"]), 128 * MIB, 0.13, m)
    assert sock["share"] > 0.3 and xla["share"] < 0.05
    assert sock["sender_held_s"] == pytest.approx(2 * m * sock["edge"]["send_block_s"])
