"""CUDA-only: kvikio (GPUDirect Storage or its compatibility mode) round trips device tensors."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.bool, torch.int64])
def test_kvikio_round_trip_on_the_device(dtype, tmp_path):
    pytest.importorskip("kvikio")
    from protrain.runtime.storage import BlockFile, KvikioStore, RunDirectory
    run = RunDirectory(tmp_path, 2**22)
    store = KvikioStore(verify=True)
    f = BlockFile(run.path / "b.act", 2**20)
    src = (torch.randn(257, 129, device="cuda") * 4).to(dtype).t().contiguous()
    flat = src.reshape(-1).view(torch.uint8)
    off = f.alloc(flat.numel())
    back = torch.empty_like(flat)
    store.read(f, off, back, store.write(f, off, flat, after=None)).result()
    assert torch.equal(back.view(dtype).view(src.shape), src)
    print(store.name)
    store.close()
    f.close()
    run.close()


def test_store_choice_on_cuda_is_kvikio_exactly_when_it_does_gpudirect_storage(tmp_path):
    """Without GDS kvikio bounces on streams that synchronise with the compute stream: the
    POSIX backend then, and the reason says why."""
    kvikio = pytest.importorskip("kvikio")
    from protrain.runtime.storage import choose_store, kvikio_gds
    gds, why = kvikio_gds(kvikio, tmp_path)
    store = choose_store(torch.device("cuda"), tmp_path)
    print(store.name, store.reason)
    assert store.name == ("kvikio (GPUDirect Storage)" if gds else "posix"), why
    assert store.reason == why
    store.close()


def test_posix_backend_round_trips_device_tensors_off_the_compute_stream(tmp_path):
    """The POSIX backend bounces device tensors through its pinned buffer on the I/O thread's
    own stream: the round trip must be exact while the compute stream is busy."""
    from protrain.runtime.storage import BlockFile, PosixStore, RunDirectory
    from protrain.runtime.streams import Streams
    streams = Streams(torch.device("cuda"))
    run = RunDirectory(tmp_path, 2**26)
    store = PosixStore(verify=True, streams=streams)
    f = BlockFile(run.path / "b.act", 2**25)
    src = torch.randint(0, 255, (9 * 2**20 + 123,), dtype=torch.uint8, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy / 64                      # keep the compute stream occupied
    off = f.alloc(src.numel())
    back = torch.empty_like(src)
    store.read(f, off, back, store.write(f, off, src, after=streams.compute_event())).result()
    assert torch.equal(back, src)
    store.close()
    assert streams.pinned_bytes() == 0
    f.close()
    run.close()
