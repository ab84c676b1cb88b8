"""Runtime cost model against hand-computed timelines (see the comments for the arithmetic).

Profile: pre (chunk 0, fwd 1 / bwd 2), two blocks (chunks 1 and 2, fwd 10 / bwd 20), post
(no parameters, fwd 1 / bwd 2). Link: a chunk takes 5 s each way; CPU Adam 4 s per chunk;
device Adam 1 s per chunk."""
import numpy as np
import pytest

from protrain.block_mode import CKPT, NONE, SWAP
from protrain.layout import build_layout
from protrain.cost.chunk_times import CHECK_PER_ADAM
from protrain.cost.time_model import simulate

from conftest import chain_profile, slow_link


def run(profile, n_persist, n_buffer, modes, **kw):
    return run_on(slow_link(), profile, n_persist, n_buffer, modes, **kw)


def run_on(hw, profile, n_persist, n_buffer, modes, **kw):
    layout = build_layout(profile, 100)
    t = simulate(profile, layout, hw, n_persist, n_buffer, np.array([modes]), **kw)
    return {k: float(getattr(t, k)[0]) for k in t.__dataclass_fields__ if getattr(t, k) is not None}


def test_all_persistent_is_compute_plus_device_adam():
    t = run(chain_profile(), 3, 0, [NONE, NONE])
    # forward 1 + 10 + 10 + 1, backward 2 + 20 + 20 + 2, device Adam 3 chunks x 1 s
    assert t["fwd_time"] == 22 and t["bwd_time"] == 44 and t["gpu_optim_time"] == 3
    assert t["iter_time"] == 69
    assert t["h2d_bytes"] == 0 and t["d2h_bytes"] == 0 and t["cpu_optim_time"] == 0


def test_one_buffer_serialises_uploads_and_cpu_adam_is_exposed():
    t = run(chain_profile(), 1, 1, [NONE, NONE])
    # fwd: pre 0-1; chunk 1 uploads 0-5; block0 5-15 (frees the buffer at 15);
    #      chunk 2 uploads 15-20; block1 20-30; post 30-31.
    assert t["fwd_time"] == 31
    # bwd: post 31-33; block1 (chunk 2 still in the buffer) 33-53; chunk 2 grads D2H 53-58,
    #      CPU Adam 58-62; chunk 1 re-upload waits for that buffer: 58-63; block0 63-83;
    #      chunk 1 grads 83-88, CPU Adam 88-92; pre 83-85; device Adam (chunk 0) 85-86.
    assert t["bwd_time"] == 85 - 31
    assert t["iter_time"] == 92
    assert t["cpu_optim_exposed"] == 92 - 86
    assert t["cpu_optim_time"] == 8
    assert t["h2d_bytes"] == 3 * 400 and t["d2h_bytes"] == 2 * 400


def test_two_buffers_prefetch_and_reuse_in_backward():
    t = run(chain_profile(), 1, 2, [NONE, NONE])
    # fwd: chunk 1 up 0-5, chunk 2 up 5-10 (a second buffer is free); block0 5-15, block1
    #      15-25, post 25-26.
    assert t["fwd_time"] == 26
    # bwd: both chunks still resident: post 26-28, block1 28-48 (grads 48-53, Adam 53-57),
    #      block0 48-68 (grads 68-73, Adam 73-77), pre 68-70, device Adam 70-71.
    assert t["iter_time"] == 77
    assert t["h2d_bytes"] == 2 * 400


def test_more_buffers_never_slower():
    prof = chain_profile(block_params=(100,) * 6)
    times = [run(prof, 1, nb, [NONE] * 6)["iter_time"] for nb in range(1, 7)]
    assert all(a >= b for a, b in zip(times, times[1:]))
    assert times[0] > times[-1]


def test_checkpoint_adds_the_block_forward_to_backward():
    base = run(chain_profile(), 3, 0, [NONE, NONE])
    ckpt = run(chain_profile(), 3, 0, [NONE, CKPT])
    assert ckpt["bwd_time"] == base["bwd_time"] + 10
    assert ckpt["iter_time"] == base["iter_time"] + 10


def test_hidden_swap_costs_nothing():
    # block0's 800 saved bytes: 10 s out after its forward, 10 s back while block1 runs its
    # 20 s backward: both hidden.
    t = run(chain_profile(saved=800), 3, 0, [SWAP, NONE])
    assert t["iter_time"] == 69
    assert t["h2d_bytes"] == 800 and t["d2h_bytes"] == 800


def test_swap_shares_the_upload_link_with_chunk_prefetch():
    # All offloaded, one buffer, block0 swapped (800 bytes = 10 s each way).
    # fwd: pre 0-1 (chunk 0 persistent); chunk1 up 0-5; block0 5-15; swap-out 15-25;
    #      chunk2 up 15-20; block1 20-30; post waits for swap-out of block0 (one in flight)
    #      until 25... already 30: post 30-31.
    # bwd: post 31-33; block1 (resident) 33-53; block0's prefetch is issued at 33 and holds
    #      the H2D link 33-43; chunk 1's re-upload waits for chunk 2's grads (D2H 53-58) ->
    #      58-63; block0 63-83 -> same as without swap, the link was free in time.
    swap = run(chain_profile(saved=800), 1, 1, [SWAP, NONE])
    plain = run(chain_profile(saved=800), 1, 1, [NONE, NONE])
    assert swap["iter_time"] == plain["iter_time"] == 92
    # With faster compute the prefetch and the chunk upload collide on the link.
    fast = chain_profile(saved=800, fwd=1.0, bwd=2.0)
    s = run(fast, 1, 1, [SWAP, NONE])
    p = run(fast, 1, 1, [NONE, NONE])
    assert s["iter_time"] > p["iter_time"]


def test_swap_out_throttles_forward_to_one_block_in_flight():
    # Three blocks, all swapped, saved 800 bytes (10 s out) but forward only 1 s per block:
    # block k+1 may not start before block k-1's swap-out is done.
    prof = chain_profile(block_params=(100, 100, 100), saved=800, fwd=1.0)
    t = run(prof, 4, 0, [SWAP, SWAP, SWAP])
    # pre 0-1; b0 1-2 (out 2-12); b1 2-3 (out 12-22); b2 waits for b0's out: 12-13
    # (out 22-32); post waits for b1's out: 22-23.
    assert t["fwd_time"] == 23


@pytest.mark.parametrize("nb", [0])
def test_offloaded_chunks_need_a_buffer(nb):
    with pytest.raises(ValueError):
        run(chain_profile(), 1, nb, [NONE, NONE])


def test_cpu_adam_after_backward_when_it_cannot_overlap():
    # As test_one_buffer_...: backward ends at 85; grads of chunk 2 on the host at 58, of
    # chunk 1 at 88. CPU Adam may only start after backward (85), in chunk order as the
    # runtime runs what step() leaves (the verdict waits for every gradient anyway): chunk 1
    # 88-92, chunk 2 92-96. The verdict checks ran on the device.
    t = run(chain_profile(), 1, 1, [NONE, NONE], cpu_overlap=False)
    assert t["iter_time"] == 96 and t["cpu_optim_time"] == 8
    # Checked on the host as they land (accumulated gradients; 1 s: 58-59, 88-89): Adam can
    # start after backward and the checks, chunk 2 89-93, chunk 1 93-97.
    t = run_on(slow_link(grad_check_rate=100.0), chain_profile(), 1, 1, [NONE, NONE], cpu_overlap=False,
               checks_on_host=True)
    assert t["iter_time"] == 97 and t["cpu_optim_time"] == 8 + 2
    # unmeasured, the check rate is CHECK_PER_ADAM times CPU Adam's
    t = run(chain_profile(), 1, 1, [NONE, NONE], cpu_overlap=False, checks_on_host=True)
    check = 4 / CHECK_PER_ADAM
    assert t["iter_time"] == pytest.approx(88 + check + 8) and t["cpu_optim_time"] == pytest.approx(8 + 2 * check)
    # on a CPU "device" the device's checks are on its one timeline, before each offload
    inline = run_on(slow_link(copy_engines=0, grad_check_rate=100.0), chain_profile(), 1, 1, [NONE, NONE],
                    cpu_overlap=False)
    plain = run_on(slow_link(copy_engines=0, grad_check_rate=100.0), chain_profile(), 1, 1, [NONE, NONE])
    assert inline["bwd_time"] == plain["bwd_time"] + 2 - 8     # checks in, CPU Adam out of backward


def test_accumulation_micro_step_has_no_optimizer():
    t = run(chain_profile(), 1, 1, [NONE, NONE], optimizer_step=False)
    # backward ends at 85; no device Adam, no CPU Adam
    assert t["iter_time"] == 85 and t["gpu_optim_time"] == 0 and t["cpu_optim_time"] == 0
    assert t["d2h_bytes"] == 2 * 400  # gradients still leave the device to be accumulated


def test_two_ranks_shard_uploads_offloads_and_cpu_adam():
    # world 2, collective bandwidth 80 B/s: an upload is the 200-byte shard over PCIe (2.5 s)
    # plus the all-gather of the other half (2.5 s) = 5 s, as before; CPU Adam does half a
    # chunk (2 s); the persistent chunk's 400 fp32 gradient bytes are all-reduced at the end:
    # 2 * 400 * 1/2 / 80 = 5 s, before device Adam (1 s).
    layout = build_layout(chain_profile(), 100)
    hw = slow_link(collective_bandwidth=80.0)
    t = simulate(chain_profile(), layout, hw, 1, 1, np.array([[NONE, NONE]]), world=2)
    # backward ends at 85 as with one rank; CPU Adam: chunk 2 at 58-60, chunk 1 at 88-90;
    # device: 85 + 5 (all-reduce) + 1 (Adam) = 91.
    assert float(t.iter_time[0]) == 91
    assert float(t.cpu_optim_time[0]) == 4
    assert float(t.h2d_bytes[0]) == 3 * 200     # only this rank's shards cross PCIe


@pytest.mark.parametrize("gds", [True, False])
def test_ssd_block_writes_and_reads_on_the_nvme_queues(gds):
    from protrain.block_mode import SSD
    # block0's 800 saved bytes at 40 B/s: written 11-31 after its forward; the post part (two
    # parts later) waits for that write (one block in flight): 31-32. Read back when block1's
    # backward starts (34) until 54; block0's backward waits: 54-74; pre 74-76; Adam 76-79.
    layout = build_layout(chain_profile(saved=800), 100)
    hw = slow_link(nvme_write_bandwidth=40.0, nvme_read_bandwidth=40.0, nvme_gds=gds)
    t = simulate(chain_profile(saved=800), layout, hw, 3, 0, np.array([[SSD, NONE]]))
    assert float(t.fwd_time[0]) == 32 and float(t.iter_time[0]) == 79
    # GDS bypasses the host: nothing on the PCIe queues; compatibility mode bounces through it.
    assert float(t.h2d_bytes[0]) == (0 if gds else 800) and float(t.d2h_bytes[0]) == (0 if gds else 800)


def test_ssd_shares_the_upload_queue_in_compatibility_mode():
    from protrain.block_mode import SSD
    fast = chain_profile(saved=800, fwd=1.0, bwd=2.0)
    layout = build_layout(fast, 100)
    times = {gds: float(simulate(fast, layout, slow_link(nvme_write_bandwidth=80.0,
                                                         nvme_read_bandwidth=80.0, nvme_gds=gds),
                                 1, 1, np.array([[SSD, NONE]])).iter_time[0]) for gds in (True, False)}
    assert times[True] < times[False]


def test_without_a_copy_engine_every_transfer_and_cpu_adam_is_on_the_compute_timeline():
    t = run_on(slow_link(copy_engines=0), chain_profile(), 1, 2, [NONE, NONE])
    # fwd: pre 0-1; chunk 1 up 1-6; block0 6-16; chunk 2 up 16-21; block1 21-31; post 31-32.
    assert t["fwd_time"] == 32
    # bwd: post 32-34; block1 34-54; chunk 2 grads 54-59, CPU Adam 59-63; block0 63-83;
    #      grads 83-88, Adam 88-92; pre 92-94; device Adam 94-95: the sum of everything.
    assert t["iter_time"] == 95 == 22 + 44 + 2 * 5 + 2 * 5 + 2 * 4 + 1
    async_ = run(chain_profile(), 1, 2, [NONE, NONE])["iter_time"]
    assert async_ == 77 and t["h2d_bytes"] == 2 * 400


def test_a_cpu_adam_thread_takes_the_updates_off_the_compute_timeline():
    """The same CPU "device" with CPU Adam on a thread of its own: copies still on the compute
    timeline, the two updates (4 each) beside it; the second ends with backward, after the
    pre part's backward began - it is exposed past the device's work only where it runs over."""
    t = run_on(slow_link(copy_engines=0, cpu_adam_thread=True), chain_profile(), 1, 2, [NONE, NONE])
    assert t["fwd_time"] == 32
    # bwd: post 32-34; block1 34-54; chunk 2 grads 54-59 (Adam 59-63 beside); block0 59-79;
    #      grads 79-84 (Adam 84-88 beside); pre 84-86; device Adam 86-87; Adam ends at 88.
    assert t["bwd_time"] == 86 - 32 and t["iter_time"] == 88
    assert t["cpu_optim_exposed"] == 1 and t["cpu_optim_time"] == 8
    # with the updates left for after backward, they run on into the next forward
    wait = run_on(slow_link(copy_engines=0, cpu_adam_thread=True), chain_profile(), 1, 2, [NONE, NONE],
                  cpu_overlap=False, carry_over=True)
    assert wait["iter_time"] < 87 + 8


def test_one_copy_engine_for_both_directions_sits_between():
    prof = chain_profile(block_params=(100,) * 4, saved=800)
    modes = [SWAP, SWAP, NONE, NONE]
    times = [run_on(slow_link(copy_engines=e), prof, 1, 2, modes)["iter_time"] for e in (2, 1, 0)]
    assert times[0] < times[1] < times[2]


def _lowest_first(arrivals: dict[int, float], turn: float) -> dict[int, tuple[float, float]]:
    """The worker's order, simulated apart: whenever the CPU is free it takes the lowest chunk
    whose gradients are on the host (``arrivals``), each for ``turn`` seconds."""
    t, pending, out = 0.0, set(), {}
    events = sorted(arrivals.items(), key=lambda kv: kv[1])
    while events or pending:
        while events and events[0][1] <= t:
            pending.add(events.pop(0)[0])
        if not pending:
            t = events[0][1]
            continue
        c = min(pending)
        pending.discard(c)
        out[c] = (t, t + turn)
        t += turn
    return out


def test_exact_updates_run_lowest_chunk_first_and_carry_into_the_next_forward():
    """Without clipping, CPU Adam slower than backward: six offloaded chunks' gradients land
    faster than their updates (10 s each) end. The CPU takes the lowest pending chunk first
    (the runtime's worker does), so what backward leaves runs in the next forward's upload
    order and that forward waits for its first offloaded chunk, not the whole backlog -
    checked against a simulation of that order written apart, and against the gradient order
    the model priced before (issue 37 item 3)."""
    hw = slow_link(cpu_adam_rate=10.0)
    profile = chain_profile((100,) * 6, fwd=10.0, bwd=4.0)
    layout = build_layout(profile, 100)
    trace: list = []
    t = simulate(profile, layout, hw, 1, 2, np.array([[NONE] * 6]), carry_over=True, trace=trace)
    landed = {int(label.split()[1]): end for lane, what, label, start, end in trace
              if lane == "d2h" and what == "offload"}
    updates = {int(label.split()[1]): (start, end) for lane, what, label, start, end in trace
               if lane == "cpu_adam"}
    assert sorted(landed) == list(range(1, 7))
    assert updates == _lowest_first(landed, 10.0)
    ends = [updates[c][1] for c in range(1, 7)]
    assert ends != sorted(ends, reverse=True)           # not the order the gradients landed in
    # The iteration: the device's work, then the next forward's uploads each after its update.
    device_end = max(end for lane, what, *_, end in trace if lane == "compute")
    ups = {int(label.split()[1]): start for lane, what, label, start, end in trace
           if lane == "h2d" and what == "upload" and start < t.fwd_time[0]}
    late = max(updates[c][1] - device_end - ups[c] for c in ups)
    assert t.iter_time[0] == pytest.approx(max(device_end + max(late, 0.0), 60.0))
    # In gradient order chunk 1 would be updated last: the next forward would wait longer.
    fifo_end, fifo = 0.0, {}
    for c in sorted(landed, reverse=True):
        fifo_end = max(fifo_end, landed[c]) + 10.0
        fifo[c] = fifo_end
    fifo_late = max(fifo[c] - device_end - ups[c] for c in ups)
    assert fifo_late >= late + 10.0
