"""Streams and devices, on the fake GPU of tests/fake_gpu.py: plan() and run() on different streams
ordered through events, the stream an array's interface names, outputs allocated and lengths read
on the launch stream, and programs loaded and launched on the instance's device whichever device
is current."""

from __future__ import annotations

from splitkv import oneshot, runtime
from tests.fake_gpu import _DeviceArray, _qkv, fake_gpu  # noqa: F401 - fake_gpu: a fixture, used by name


def test_plan_and_run_switch_to_the_device_of_the_instance(fake_gpu):
    # A torch caller on GPU 1 may leave CuPy's current device at 0: the programs must still be
    # loaded and launched on the instance's device, and the caller's device given back.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", device=1)
    assert fake_gpu.current == 0
    attn.plan([5, 9])
    assert {device for _, device in fake_gpu.loads} == {1}
    q, k, v = _qkv(2, 8, 2, 128, 16)
    attn.run(q, k, v)
    assert [launch.device for launch in fake_gpu.launches] == [1]
    assert fake_gpu.current == 0


def test_cluster_queries_made_on_another_device_load_on_the_instances(fake_gpu):
    # The occupancy of a cluster size may be asked for outside plan(), with another GPU current: the
    # program it loads (and later plans reuse) must still live on the instance's GPU.
    attn = runtime.DecodeAttention(8, 2, 128, device=1)
    assert fake_gpu.current == 0
    attn._max_active_clusters(8)
    attn.plan([3000, 1500], variant="split", num_splits=8)
    assert {device for _, device in fake_gpu.loads} == {1}
    assert fake_gpu.current == 0


def test_run_allocates_its_outputs_on_the_launch_stream(fake_gpu):
    # A pool may hand a block out again once its stream has passed the free: the block must belong
    # to the stream the kernel writes it on, not to whatever stream was current.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([5, 9], stream=77)
    attn.run(*_qkv(2, 8, 2, 128, 16), return_lse=True, stream=77)
    assert [(shape, stream) for shape, _, stream in fake_gpu.allocations] == [((2, 8, 128), 77), ((2, 8), 77)]


def test_plan_and_run_on_different_streams_are_ordered_on_the_gpu(fake_gpu):
    # Host lengths planned on CuPy's stream, torch tensors run on torch's: the run's stream waits
    # for the plan's writes, and the next plan's writes wait for that run.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    q, k, v = _qkv(2, 8, 2, 128, 16)
    attn.plan([5, 9], stream=5)
    ((event, plan_stream),) = fake_gpu.event_records
    assert plan_stream == 5 and not fake_gpu.event_waits
    attn.run(q, k, v, stream=7)
    attn.run(q, k, v, stream=7)
    assert fake_gpu.event_waits == [(7, event)]  # once: the second run follows the first on its stream
    assert fake_gpu.event_records[-2:] == [(event, 7), (event, 7)]
    attn.plan([6, 9], stream=5)
    assert fake_gpu.event_waits[-1] == (5, event)
    assert len(fake_gpu.launches) == 2


def test_run_waits_for_the_stream_an_interface_names(fake_gpu):
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([5, 9], stream=7)
    q, k, v = _qkv(2, 8, 2, 128, 16)
    k.__cuda_array_interface__["stream"] = 0x4400  # the producer's work on k may still be queued there
    attn.run(q, k, v, stream=7)
    event, producer = fake_gpu.event_records[1]
    assert producer == 0x4400 and fake_gpu.event_waits == [(7, event)]


def test_a_plan_that_grows_the_workspace_first_waits_for_the_last_run(fake_gpu):
    # The old buffer returns to the pool of the stream that allocated it, which may hand it out
    # while a run on another stream still writes it: plan() waits for that run on the host first.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([4000, 9], stream=5)
    attn.run(*_qkv(2, 8, 2, 128, 4000), stream=7)
    attn.plan([4000, 9], stream=5)  # same sizes: nothing replaced, no host wait
    assert fake_gpu.host_waits == []
    attn.plan([4000] * 8, stream=5)  # a larger batch: a larger lengths buffer
    assert fake_gpu.host_waits and set(fake_gpu.host_waits) == {fake_gpu.event_records[0][0]}


def test_decode_reads_device_lengths_on_the_launch_stream(fake_gpu):
    # The lengths, like q, k and v, are ready on the stream the call runs on; read on another
    # stream, the read-back could see lengths not written yet.
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    lens = _DeviceArray((2,), "<i4", [5, 1000])
    read_on = []
    plain_get = lens.get
    lens.get = lambda: (read_on.append(fake_gpu.stream), plain_get())[1]
    oneshot.decode(q, k, v, lens, stream=7)
    assert read_on == [7]
    (launch,) = fake_gpu.launches
